"""Faults injected into a running pipeline (``roundpipe.testing.faults``): each surfaces in the
caller's thread as a specific error saying where it happened, the pipeline stays usable, a step
that failed before any update is redone exactly, and nothing leaks: no thread, device byte or
pinned host byte outlives a failure or a closed pipeline."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.backend.cpu import PINNED, waiting
from roundpipe.errors import DeviceOutOfMemory, OptimizerError, StageError, WatchdogTimeout
from roundpipe.testing import faults
from roundpipe.testing.faults import Fault, InjectedFault

torch.set_num_threads(1)

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

# Deferred updates (clipping needs the whole gradient): no layer is updated before step(), so a
# failure anywhere in forward_backward leaves the last completed step intact.
DEFERRED = dict(lr=1e-2, max_grad_norm=1e9)

# (fault, the error it must surface as, what that error must say about where)
CASES = {
    "forward error": (Fault("forward", layer="layers.1", microbatch=1), StageError, {"layer": "layers.1"}),
    "backward error": (Fault("backward", microbatch=0), StageError, {"microbatch": 0}),
    "upload error": (Fault("upload", device="cpu:1"), StageError, {"device": "cpu:1"}),
    "download error": (Fault("download", device="cpu:0"), StageError, {"device": "cpu:0"}),
    "gradient download error": (Fault("grads", device="cpu:1"), StageError, {"device": "cpu:1"}),
    "device out of memory": (Fault("forward", kind="oom", layer="layers.0"), DeviceOutOfMemory, {"layer": "layers.0"}),
    "optimizer error": (Fault("optimizer", layer="layers.0"), OptimizerError, {"layer": "layers.0"}),
    "worker stall": (Fault("forward", kind="stall", layer="layers.1", seconds=1.6), WatchdogTimeout, {}),
}  # fmt: skip


def _pipe(model, **config):
    config = {"devices": "cpu:2", "num_microbatches": 2, "policy": "1f1b", "partition": None, **config}
    pipe = roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(**config))
    pipe.configure_optimizer(**DEFERRED)
    return pipe


def _train(pipe, batch, steps: int) -> None:
    for _ in range(steps):
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        pipe.step()


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict()["masters"].items()}


@pytest.fixture(scope="module")
def model():
    return make_model("llama", num_layers=2)


@pytest.fixture(scope="module")
def batch():
    return make_batch(batch=4)


@pytest.fixture(scope="module")
def fault_free(model, batch):
    with _pipe(model) as pipe:
        _train(pipe, batch, 3)
        return _weights(pipe)


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_surfaces_with_where_it_happened_and_the_step_is_redone_exactly(
    case, model, batch, fault_free
):
    """Step 2 of 3 fails; the error names the step (and the layer, microbatch, device it knows);
    the pipeline drops the failed step and trains on: the weights equal a fault-free run's."""
    fault, error, where = CASES[case]
    fault.step = 1  # the second forward_backward (the optimizer point has no step: it is the second)
    fault.fired = 0
    # A 1 s watchdog only where the stall is the fault: elsewhere a loaded machine's slow task would
    # trip it first (CI did).
    with _pipe(model, watchdog_s=1.0 if fault.kind == "stall" else 300.0) as pipe:
        _train(pipe, batch, 1)
        plan = [fault] if fault.where != "optimizer" else [Fault("optimizer", layer=fault.layer)]
        with faults.injected(*plan) as active, pytest.raises(error) as caught:
            _train(pipe, batch, 1)
        assert active[0].fired == 1
        err = caught.value
        for attr, value in where.items():
            assert getattr(err, attr) == value, (attr, str(err))
        if isinstance(err, StageError) and not isinstance(err, OptimizerError):
            assert err.step == 1 and isinstance(err.__cause__, InjectedFault)
        if isinstance(err, DeviceOutOfMemory):
            assert err.step == 1 and "plan" in "".join(err.__notes__)
        if isinstance(err, WatchdogTimeout):  # the stalled work ends within the recovery's grace, so
            # the pipeline goes on (how long it takes to surface: benchmarks/fault_table.py)
            assert "no progress" in str(err), str(err)
        assert pipe.abandon_step() is (fault.where != "optimizer")
        if fault.where == "optimizer":
            return  # half an update applied: nothing consistent to redo (the trainer's job to say so)
        _train(pipe, batch, 2)  # the failed step again, then the third
        got = _weights(pipe)
    assert got.keys() == fault_free.keys()
    for name in got:
        torch.testing.assert_close(got[name], fault_free[name], rtol=0, atol=0, msg=name)


def test_an_update_that_failed_half_way_is_not_abandoned(model, batch, monkeypatch):
    """Eager updates (no clipping) step the upper layers during the backward: a failure in the
    lowest stage's backward after that leaves the weights part old, part new. The lowest stage's
    last backward is issued (and fails) only once an upper group has stepped: a closure runs when
    it is issued, which may be before the host thread has stepped anything."""
    pipe = roundpipe.wrap(
        copy.deepcopy(model),
        roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, policy="1f1b", partition=None),
    )
    point, waited = faults.point, []

    def after_an_update(where, **context):
        if where == "backward" and context.get("layer") == "embed" and context.get("microbatch") == 1:
            deadline = time.monotonic() + 30
            with waiting():  # the device's streams run meanwhile, as a GPU's would
                while not pipe._updates.partial and time.monotonic() < deadline:
                    time.sleep(0.01)
            waited.append(pipe._updates.partial)
        return point(where, **context)

    monkeypatch.setattr(faults, "point", after_an_update)
    with pipe:
        pipe.configure_optimizer(lr=1e-2)
        with faults.injected(Fault("backward", layer="embed", microbatch=1)), pytest.raises(StageError):
            _train(pipe, batch, 1)
        assert waited and waited[0], f"no upper layer group stepped eagerly before the failure: {waited}"
        assert pipe.abandon_step() is False


@pytest.mark.slow
def test_a_worker_stuck_for_good_surfaces_and_the_pipeline_says_it_cannot_go_on(model, batch, monkeypatch):
    """Work that never returns cannot be stopped: the watchdog's error reaches the caller once the
    recovery's grace (5 s here) is over instead of never, and the next step is refused with the
    reason; the last completed step's state can still be saved."""
    import roundpipe.backend.cpu as cpu
    from roundpipe.errors import PipelineStateError

    monkeypatch.setattr(cpu, "STOP_TIMEOUT_S", 0.2)
    pipe = _pipe(model, watchdog_s=1.0)
    _train(pipe, batch, 1)
    saved = _weights(pipe)
    stall = Fault("forward", kind="stall", seconds=9)  # "for good": longer than the grace
    with faults.injected(stall):
        t0 = time.perf_counter()
        with pytest.raises(WatchdogTimeout) as caught:  # before the stall ends (pytest-timeout: no hang)
            _train(pipe, batch, 1)
    assert "cannot run another step" in "".join(caught.value.__notes__)
    with pytest.raises(PipelineStateError, match="cannot run another step"):
        _train(pipe, batch, 1)
    assert pipe.abandon_step()
    for name, w in _weights(pipe).items():
        torch.testing.assert_close(w, saved[name], rtol=0, atol=0)
    pipe.close()  # does not wait for the stuck closure
    time.sleep(
        max(0.0, 9.5 - (time.perf_counter() - t0))
    )  # let the stalled closure end, so no thread outlives the test


def _alive() -> tuple[int, int]:
    gc.collect()
    threads = sum(t.is_alive() for t in threading.enumerate())
    return threads, PINNED.alive


@pytest.mark.slow
def test_nothing_leaks_over_50_open_train_close_cycles_and_20_failures(model, batch):
    """Threads, device bytes (the sanitizer's measure of live storages) and pinned host bytes
    (live page-locked allocations) return to where they were."""
    _alive()
    before = _alive()
    for i in range(50):
        with _pipe(model, host_memory=("arena", "pinned", "pageable")[i % 3]) as pipe:
            _train(pipe, batch, 1)
            devices = pipe.backend.devices
        assert all(d.memory.in_use == 0 for d in devices)
        del pipe, devices
    assert _alive() == before
    with _pipe(model) as pipe:
        kinds = [Fault("forward", layer="layers.1"), Fault("upload"), Fault("download"), Fault("backward")]
        kinds += [Fault("forward", kind="oom")]
        for i in range(20):
            fault = copy.copy(kinds[i % len(kinds)])
            with faults.injected(fault), pytest.raises((StageError, DeviceOutOfMemory)):
                _train(pipe, batch, 1)
            assert fault.fired == 1
            assert pipe.abandon_step()
            assert all(d.memory.in_use == 0 for d in pipe.backend.devices)
        _train(pipe, batch, 1)
    del pipe
    assert _alive() == before


def test_the_environment_enables_faults_and_a_bad_plan_says_what_to_write(monkeypatch):
    monkeypatch.setenv(faults.ENV, '[{"where": "data", "step": 3, "kind": "kill"}]')
    with faults.injected():  # restores whatever was active before, afterwards
        plan = faults.from_environment()
        assert plan == [Fault("data", kind="kill", step=3)]
    monkeypatch.setenv(faults.ENV, '[{"where": "nowhere"}]')
    with pytest.raises(roundpipe.ConfigError, match="fault point 'nowhere'"):
        faults.from_environment()
    monkeypatch.setenv(faults.ENV, "{not json")
    with pytest.raises(roundpipe.ConfigError, match="JSON list of faults"):
        faults.from_environment()


def test_no_plan_means_no_fault():
    assert faults._PLAN is None  # the state every other test and every run starts from
    faults.point("forward", step=0, layer="layers.0")  # returns at once


def test_a_note_reaches_the_message_where_python_has_no_notes():
    """Python 3.10 (which setup.cfg allows) has no BaseException.add_note: the note joins the
    message there instead of raising AttributeError from the error path."""
    from roundpipe.errors import StageError, add_note, fold_note

    err = StageError("stage 1 failed", device="cpu:0")
    fold_note(err, "this pipeline cannot run another step")
    assert str(err) == "stage 1 failed [device=cpu:0]\nthis pipeline cannot run another step"
    bare = RuntimeError()
    fold_note(bare, "a note")
    assert bare.args == ("a note",)
    add_note(err, "and another")
    assert "and another" in "".join(getattr(err, "__notes__", [])) + str(err)
