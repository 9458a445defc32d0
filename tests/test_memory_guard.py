"""The memory guards: a run whose plan needs more device memory than a device has free is refused
before its first step, with the device, both figures and the levers in the message; a run that
fits goes on unchanged. Free memory is faked (``Device.free_bytes``), as tests/test_train.py fakes
the available host RAM for the host guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.backend.cpu import CpuDevice
from roundpipe.errors import DeviceMemoryError
from roundpipe.partition.cost import LayerCost
from roundpipe.runtime import memory_guard
from roundpipe.schedule import Partition
from roundpipe.schedule.policies import POLICIES

torch.set_num_threads(1)

# No profile: the plan is known from the config (roundpipe, one layer per stage, 2 microbatches).
FIXED = {"devices": "cpu:2", "policy": "roundpipe", "partition": None, "num_microbatches": 2}


def _fb(pipe, batch):
    return pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
    )


def _fake_free(monkeypatch, free: dict[int, int | None]) -> list[int]:
    """Device ``i`` reports ``free[i]`` bytes free (missing: unbounded); returns the list of
    indexes asked, in order."""
    asked: list[int] = []

    def free_bytes(self):
        asked.append(self.index)
        return free.get(self.index)

    monkeypatch.setattr(CpuDevice, "free_bytes", free_bytes)
    return asked


def test_a_plan_that_does_not_fit_a_device_is_refused_with_the_figures_and_the_levers(monkeypatch):
    _fake_free(monkeypatch, {0: 1 << 40, 1: 50_000})
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        with pytest.raises(DeviceMemoryError) as info:
            _fb(pipe, make_batch(batch=4))
        assert pipe.last_plan is None  # refused before anything ran
        assert all(d.bytes_in == 0 for d in pipe.backend.devices)
    err = info.value
    msg = str(err)
    assert err.device == "cpu:1" and err.free == 50_000 and err.planned > 50_000
    assert msg.startswith("cpu:1 has 0.00 GiB (50,000 bytes) free")
    assert f"{err.planned / 2**30:.2f} GiB ({err.planned:,} bytes)" in msg
    assert "roundpipe, 2 microbatches of up to 2 x" in msg
    for lever in ("num_microbatches above 2", "data.max_length", "lora.enabled", "bf16"):
        assert lever in msg, lever
    assert "head_shards" not in msg  # the fullest stage is a block: the head is no lever here
    assert "ROUNDPIPE_DEVICE_MEMORY_CHECK=0" in msg
    assert isinstance(err, MemoryError) and isinstance(err, roundpipe.RoundpipeError)


def test_the_planned_figure_is_the_partitioners_rule_for_the_plan(monkeypatch):
    """Not a second ledger: the refused figure is the largest stage by ``partition.stage_bytes`` /
    ``last_stage_bytes`` over the planner's layer bytes (a rotating deal runs every stage)."""
    from roundpipe.partition.memory import pair_peak_bytes

    _fake_free(monkeypatch, {0: 1})
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        decision = pipe._planner.decide(*batch["input_ids"].shape)
        costs = pipe._planner._layer_costs(2 * batch["input_ids"].shape[1])
        with pytest.raises(DeviceMemoryError) as info:
            _fb(pipe, batch)
    assert info.value.planned == pair_peak_bytes(costs, decision.forward, decision.backward)


def test_a_plan_that_fits_trains_and_is_checked_once(monkeypatch):
    asked = _fake_free(monkeypatch, {0: 1 << 40, 1: 1 << 40})
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for _ in range(3):  # the rotating deal builds a plan per start device: checked once
            assert _fb(pipe, batch).loss > 0
            pipe.step()
    assert asked == [0, 1]


def test_without_a_capacity_the_cpu_backend_is_unbounded_and_trains():
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        assert [d.free_bytes() for d in pipe.backend.devices] == [None, None]
        assert _fb(pipe, make_batch(batch=4)).loss > 0


def test_cpu_free_bytes_is_the_capacity_less_what_is_alive(monkeypatch):
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED, device_capacity=1 << 30)) as pipe:
        dev = pipe.backend.devices[0]
        slack = dev.allocation_slack()  # what the caching allocator may reserve beyond a plan
        assert 0 < slack < (1 << 30) // 100
        assert dev.free_bytes() == (1 << 30) - slack  # between steps the workers hold nothing
        monkeypatch.setattr(dev.allocator, "allocated", 4096)  # as if a tensor were alive on it
        assert dev.free_bytes() == (1 << 30) - slack - 4096


def test_an_automatic_plan_is_checked_once_it_is_chosen(monkeypatch):
    """policy/partition/num_microbatches "auto": the first batch is profiled, then the chosen plan
    is checked before it runs."""
    free: dict[int, int | None] = {}
    _fake_free(monkeypatch, free)
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.profile(batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"])
        free[1] = 10_000
        with pytest.raises(DeviceMemoryError, match=r"^cpu:1 has .* free but the plan needs") as caught:
            _fb(pipe, batch)
        assert pipe.layer_times is not None and pipe.last_plan is None
        assert "(profile," not in str(caught.value)


def test_the_profiling_step_is_checked_too(monkeypatch):
    """The first batch's profiling step (one layer per task) is a plan as well: refused before it
    runs where it does not fit, not out of memory in it."""
    _fake_free(monkeypatch, {1: 10_000})
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        with pytest.raises(DeviceMemoryError, match=r"^cpu:1 has .* free but the plan needs .*\(profile, "):
            _fb(pipe, make_batch(batch=4))
        assert pipe.layer_times is None and pipe.last_plan is None


def test_the_switch_starts_a_refused_plan_anyway(monkeypatch):
    _fake_free(monkeypatch, {0: 1, 1: 1})
    monkeypatch.setenv(memory_guard.SWITCH, "0")
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        assert _fb(pipe, make_batch(batch=4)).loss > 0


def test_a_fixed_assignment_plans_each_device_for_its_own_stages():
    """1f1b keeps stage d on device d: devices are planned apart, the head's device the fullest; a
    rotating deal plans every device for the fullest stage."""
    costs = [
        LayerCost(f"l{i}", 0.0, 0.0, 1000 * (i + 1), 0, 10, 0, kind=k, recompute=k != "head")
        for i, k in enumerate(["embed", "block", "block", "head"])
    ]
    part = Partition.from_sizes([2, 2])
    table = POLICIES["1f1b"](part, part, 2, 2)
    fixed = memory_guard.device_peaks(costs, table, rotates=False)
    rotating = memory_guard.device_peaks(costs, table, rotates=True)
    assert fixed[0].nbytes < fixed[1].nbytes and "l2..l3" in fixed[1].what
    assert rotating[0].nbytes == rotating[1].nbytes == fixed[1].nbytes


def test_roundpipe_train_exits_2_with_one_line_on_a_refusal(tmp_path: Path, monkeypatch, capsys):
    import yaml

    from roundpipe.commands.train import main

    run = tmp_path / "run"
    recipe = {
        "model": {
            "config": {
                "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
            },
            "tokenizer": "byte",
        },
        "data": {
            "train": str(run / "data" / "train.jsonl"), "eval": str(run / "data" / "eval.jsonl"),
            "synthetic": "reverse", "synthetic_samples": [32, 8], "prompt_template_no_input": "{instruction}>",
            "max_length": 24,
        },
        "run": {"name": "t", "output_dir": str(run), "devices": "cpu:2", "batch_size": 8, "num_microbatches": 2, "max_steps": 2},
        "checkpoint": {"on_error": False},
        "logging": {"progress": False, "plots": False, "tensorboard": False},
    }  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    _fake_free(monkeypatch, {0: 1000, 1: 1000})
    with pytest.raises(SystemExit) as info:
        main([str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "roundpipe train: error: cpu:0 has 0.00 GiB (1,000 bytes) free"
    )


def test_the_room_a_plan_leaves_allows_for_the_estimates_error(monkeypatch):
    """``FlowPlan.room`` is what a call boundary may hold beyond the stages' own rule (the next
    call's first weights, the last call's gradients). The planned peak is an estimate, within about
    20% either way: counted at 1.2x it, a device whose real peak is that much over the estimate
    does not run out for what the boundary holds. Left in full, the room would hand that device
    the 20% a second time."""
    free = 1 << 30
    _fake_free(monkeypatch, {0: free, 1: free})
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**FIXED)) as pipe:
        _fb(pipe, batch)
        peaks = pipe._planner.planned_peaks(pipe.last_plan.table, 2, tuple(batch["input_ids"].shape))
        room = pipe.last_plan.room
    assert room == [free - int(1.2 * p.nbytes) for p in peaks]
    assert memory_guard.room([None, peaks[0]], [1000, None]) == [1000, None]
    assert memory_guard.room(peaks[:1], [peaks[0].nbytes]) == [0]  # never below nothing
