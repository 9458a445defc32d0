"""``roundpipe plan`` and ``roundpipe simulate`` on the host they plan for: its RAM and cores given
(``--host-ram``, ``--host-cores``) or read from this machine when it is the target; a model they do
not know is one error, not a table of failed candidates."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from roundpipe.cli import main
from roundpipe.presets import GIB, load_hardware

SMALL = ["--seq-len", "512", "--global-batch", "4"]


def _json(capsys, argv: list[str]) -> dict:
    main(argv)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_an_unknown_model_is_one_error(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--model", "nosuchmodel", "--hardware", "1xrtx3090", *SMALL])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"roundpipe {command}: error: unknown model 'nosuchmodel'"), err
    assert err.count("\n") == 1, err


def test_host_ram_decides_whether_a_full_fine_tune_fits(capsys):
    """qwen3-8b fully fine-tuned keeps ~137 GiB of state on the host: it fits the preset's host and
    not one of 64 GiB."""
    argv = ["simulate", "--model", "qwen3-8b", "--hardware", "1xrtx3090", *SMALL, "--json"]
    roomy = _json(capsys, argv)
    assert roomy["fits"] and roomy["host_memory_bytes"] == load_hardware("1xrtx3090").host_memory_bytes
    small = _json(capsys, [*argv, "--host-ram", "64", "--host-cores", "8"])
    assert not small["fits"] and "host" in small["reason"], small["reason"]
    assert small["host_memory_bytes"] == 64 * GIB and small["cpu_cores"] == 8
    plan = _json(capsys, ["plan", *argv[1:], "--host-ram", "64", "--time-budget", "5"])
    assert not plan["fits"] and plan["host_memory_bytes"] == 64 * GIB


def test_virtual_cpu_devices_plan_for_this_machine_by_default(capsys):
    argv = ["simulate", "--model", "qwen3-0.6b", "--hardware", "2xcpu", "--seq-len", "64", "--json"]
    out = _json(capsys, argv)
    assert out["host_memory_bytes"] == psutil.virtual_memory().total
    assert out["cpu_cores"] == (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    )
    here = _json(capsys, ["simulate", "--model", "qwen3-0.6b", "--hardware", "1xrtx3090", *SMALL, "--json",
                          "--host-ram", "this"])  # fmt: skip
    assert here["host_memory_bytes"] == psutil.virtual_memory().total


def test_a_bad_host_figure_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--model", "qwen3-8b", "--hardware", "1xrtx3090", *SMALL, "--host-ram", "-4"])
    assert info.value.code == 2
    assert "--host-ram" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_help_says_where_the_host_figures_come_from(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--host-ram" in text and "--host-cores" in text and "this machine" in text and "preset" in text
