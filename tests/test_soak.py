"""A run that fails must say why, keep its last completed step and resume exactly: the trainer
under injected faults (``roundpipe.testing.faults``), in-process and as ``roundpipe train``
subprocesses that fail, are killed and resume (the soak)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import _masters, _quiet, _recipe

from roundpipe.errors import StageError
from roundpipe.testing import faults
from roundpipe.testing.faults import Fault
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.recipe import config_from_dict, dump_recipe
from roundpipe.train.trainer import LOG_FILE, Trainer

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return _masters(CheckpointManager(run_dir / "checkpoints").latest())


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_a_failed_step_is_logged_checkpointed_at_the_last_completed_step_and_resumed_exactly(tmp_path):
    """Step 5's second forward_backward fails in a layer: the error reaches the caller, train.log
    has the traceback, a checkpoint of step 4 is written (the failure came before any update), and
    ``resume="auto"`` ends where a run without the fault ends, bit for bit."""
    groups = dict(run={"max_steps": 6}, eval={"every": None}, checkpoint={"every": None})
    clean = config_from_dict(_recipe(tmp_path / "clean", **groups))
    Trainer(clean, log=_quiet).fit()
    faulty = config_from_dict(_recipe(tmp_path / "faulty", **groups))
    # grad_accum 2: step 5's calls are the pipeline's 9th and 10th (indices 8 and 9)
    with faults.injected(Fault("forward", step=9, layer="layers.1")), pytest.raises(StageError) as err:
        Trainer(faulty, log=_quiet).fit()
    assert err.value.step == 9 and err.value.layer == "layers.1"
    run = Path(faulty.output_dir)
    log = (run / LOG_FILE).read_text()
    assert "step 5 failed: StageError" in log and "Traceback" in log and "InjectedFault" in log
    assert "wrote a checkpoint of step 4" in log
    assert CheckpointManager(run / "checkpoints").latest_step() == 4
    result = Trainer(faulty, resume="auto", log=_quiet).fit()
    assert result.steps == 6
    _same(_final(run), _final(Path(clean.output_dir)))


@pytest.mark.slow
def test_a_failure_half_way_through_an_update_writes_no_checkpoint_and_says_why(tmp_path):
    """An eager update (no clipping) that fails in the middle leaves some layers updated: no state
    is consistent, so none is saved, and the log says to resume from the last checkpoint."""
    groups = dict(run={"max_steps": 4, "grad_accum": 1}, eval={"every": None}, checkpoint={"every": 2})
    config = config_from_dict(_recipe(tmp_path, **groups))
    with faults.injected(Fault("optimizer", layer="layers.0")), pytest.raises(StageError):
        Trainer(config, log=_quiet).fit()
    log = (Path(config.output_dir) / LOG_FILE).read_text()
    assert "no checkpoint written: step 1 failed half-way through its optimizer update" in log
    assert CheckpointManager(Path(config.output_dir) / "checkpoints").latest_step() is None


def _train_command(recipe: Path, env_faults: list[dict] | None, timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(faults.ENV, None)
    if env_faults:
        env[faults.ENV] = json.dumps(env_faults)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "roundpipe.cli", "train", str(recipe), "--resume", "auto"],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    return proc.returncode, proc.stderr, time.perf_counter() - t0


# What the soak injects, in turn; "step" is filled in. Device points use the pipeline's call index
# (grad_accum 1: the trainer's step minus one), the others the trainer's step.
SOAK_FAULTS = [
    {"where": "forward", "kind": "error", "layer": "layers.1"},
    {"where": "data", "kind": "kill"},
    {"where": "backward", "kind": "error"},
    {"where": "upload", "kind": "error"},
    {"where": "checkpoint", "kind": "kill"},
    {"where": "forward", "kind": "stall", "seconds": 30},
    {"where": "download", "kind": "error"},
    {"where": "forward", "kind": "kill", "layer": "layers.0"},
    {"where": "forward", "kind": "oom"},
    {"where": "checkpoint", "kind": "error"},
    {"where": "data", "kind": "error"},
    {"where": "backward", "kind": "kill"},
]
DEVICE_POINTS = ("forward", "backward", "upload", "download")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 8 minutes on 2 shared cores: 11 processes, each starting afresh
def test_soak_a_run_survives_a_fault_every_20_steps_kills_included_and_ends_exactly(tmp_path, request):
    """``--soak-steps`` steps on cpu:4, checkpoints every 10; about every 18 steps a fault from
    SOAK_FAULTS (SIGKILL among them) stops ``roundpipe train``, which is started again with
    ``--resume auto`` each time. No step is lost: the final weights equal a fault-free run's."""
    steps = request.config.getoption("--soak-steps")
    groups = dict(
        run={
            "devices": "cpu:4", "num_microbatches": 4, "grad_accum": 1, "max_steps": steps, "policy": "roundpipe",
            "options": {"watchdog_s": 2.0, "partition": None},  # one plan for both runs, whatever they profile
        },
        eval={"every": None}, checkpoint={"every": 10, "keep_last": 2}, optim={"max_grad_norm": 1.0},
    )  # fmt: skip
    recipes = {}
    for name in ("clean", "soak"):
        recipe = config_from_dict(_recipe(tmp_path / name, **groups))
        recipes[name] = tmp_path / f"{name}.yaml"
        recipes[name].write_text(dump_recipe(recipe))
    code, err, clean_s = _train_command(recipes["clean"], None, timeout=1200)
    assert code == 0, err
    rng = random.Random(0)
    fault_steps = [min(steps - 1, 18 * k + rng.randint(-4, 4)) for k in range(1, steps // 18 + 1)]
    run = tmp_path / "soak" / "run"
    table = []
    for i, at in enumerate(fault_steps):
        fault = dict(SOAK_FAULTS[i % len(SOAK_FAULTS)])
        if fault["where"] == "checkpoint":
            at = (at // 10) * 10 or 10  # checkpoints are written every 10 steps
        fault["step"] = at - 1 if fault["where"] in DEVICE_POINTS else at
        before = CheckpointManager(run / "checkpoints").latest_step() or 0
        code, err, seconds = _train_command(recipes["soak"], [fault], timeout=600)
        after = CheckpointManager(run / "checkpoints").latest_step() or 0
        table.append((fault, code, err.strip().splitlines()[-1:] or [""], before, after, seconds))
        assert code != 0, f"the fault {fault} did not stop the run: {err}"
        if fault["kind"] == "kill":
            assert code == -9, (fault, code, err)
        else:
            assert code == 1 and "roundpipe train: failed:" in err, (fault, code, err)
            if fault["where"] != "checkpoint":  # the last completed step was saved on the way out
                assert after == at - 1, (fault, before, after, err)
    code, err, _ = _train_command(recipes["soak"], None, timeout=1200)
    assert code == 0, err
    assert CheckpointManager(run / "checkpoints").latest_step() == steps
    _same(_final(run), _final(tmp_path / "clean" / "run"))
    for fault, code, last, before, after, seconds in table:
        print(
            f"soak: {fault} -> exit {code}, resumed from {before}, left {after}, {seconds:.1f}s: {last[0][:120]}"
        )
    print(f"soak: {len(table)} faults survived over {steps} steps; fault-free run {clean_s:.0f}s")
