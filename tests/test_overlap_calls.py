"""Consecutive calls overlapped (``RunConfig(overlap_calls=True)``, async optimizer only).

A ``forward_backward`` returns once its loss is on the host and the call before it has completed;
its remaining backward, its last gradient downloads and their additions go on behind the next
call, whose tasks the workers issue behind them on the same streams. Training is exactly what the
drained calls train (the same operations in the same order on every stream and on the host
thread), which is the one-step-stale reference; an error of a call that already returned reaches
the next call that waits, with its context; the pipeline stays usable.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from support.reference import (
    assert_same_run,
    pipeline_train,
    reference_train_one_step_stale,
)
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError, PipelineStateError, StageError
from roundpipe.testing import faults

torch.set_num_threads(1)

ASYNC = dict(num_microbatches=3, policy="roundpipe", partition=None, optimizer_mode="async")


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:3"])
def test_overlapped_calls_train_as_the_one_step_stale_reference(devices):
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    want = reference_train_one_step_stale(model, batch, 4)
    got = pipeline_train(model, batch, 4, devices=devices, overlap_calls=True, **ASYNC)
    assert_same_run(got, want)


def _accumulated_run(model, batch, *, overlap: bool) -> tuple[list[float], dict]:
    """Three optimizer steps of two calls each (gradient accumulation), losses and final weights."""
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    config = roundpipe.RunConfig(devices="cpu:2", overlap_calls=overlap, **ASYNC)
    losses = []
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for _ in range(3):
            for n, half in enumerate(halves):
                out = pipe.forward_backward(
                    half["input_ids"],
                    half["labels"],
                    attention_mask=half["attention_mask"],
                    accumulate=n == 0,
                    loss_tokens=tokens,
                )
                losses.append(out.loss)
            pipe.step()
        return losses, pipe.state_dict()


def test_overlapped_accumulation_calls_train_as_drained_ones():
    model = make_model("qwen3", num_layers=3)
    batch = make_batch(batch=6)
    drained_losses, drained = _accumulated_run(model, batch, overlap=False)
    overlap_losses, overlapped = _accumulated_run(model, batch, overlap=True)
    assert overlap_losses == drained_losses
    for name, value in drained["masters"].items():
        assert torch.equal(overlapped["masters"][name], value), name


class _HeldGradients:
    """Holds the download of the embedding's gradients of the first call (the last thing its
    backward sends down) until ``release`` is set; then lets it pass, or raises ``error``."""

    def __init__(self, monkeypatch, error: BaseException | None = None):
        self.held, self.release, self.passed = threading.Event(), threading.Event(), threading.Event()
        self.error = error
        point = faults.point

        def holding(where, **context):
            if where == "grads" and context.get("layer") == "embed" and context.get("step") == 0:
                self.held.set()
                self.release.wait(10.0)
                self.passed.set()
                if self.error is not None:
                    raise self.error
            return point(where, **context)

        monkeypatch.setattr(faults, "point", holding)


def test_a_call_returns_while_its_last_gradients_are_still_going_down(monkeypatch):
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    want = pipeline_train(model, batch, 2, devices="cpu:2", **ASYNC)
    held = _HeldGradients(monkeypatch)
    config = roundpipe.RunConfig(devices="cpu:2", overlap_calls=True, **ASYNC)
    losses = []
    try:
        with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
            pipe.configure_optimizer(lr=1e-3, eps=1e-4, weight_decay=0.0)
            losses.append(
                pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"]).loss
            )
            # without the overlap the call returns only once the held download has passed
            returned_first = not held.passed.is_set()
            held.release.set()
            pipe.step()
            losses.append(
                pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"]).loss
            )
            pipe.step()
    finally:
        held.release.set()
    assert returned_first, "forward_backward waited for its last gradient download"
    assert held.held.is_set() and held.passed.is_set()
    assert losses == want.losses


def test_an_error_after_the_call_returned_reaches_the_next_call(monkeypatch):
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    held = _HeldGradients(monkeypatch, error=RuntimeError("the link went down"))
    config = roundpipe.RunConfig(devices="cpu:2", overlap_calls=True, **ASYNC)
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        first = pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
        assert not held.passed.is_set()
        held.release.set()
        pipe.step()
        with pytest.raises(StageError) as caught:
            pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
        message = str(caught.value)
        assert "the link went down" in message and "gradients of embed" in message, message
        assert caught.value.step == 0, message
        assert any("an earlier call" in n for n in getattr(caught.value, "__notes__", [])), message
        pipe.abandon_step()
        again = pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
        pipe.step()
        pipe.state_dict()  # waits for the call in flight
    assert torch.isfinite(torch.tensor([first.loss, again.loss])).all()


def test_closing_with_a_failed_call_in_flight_raises_its_error_and_closes(monkeypatch):
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    held = _HeldGradients(monkeypatch, error=RuntimeError("the link went down"))
    config = roundpipe.RunConfig(devices="cpu:2", overlap_calls=True, **ASYNC)
    pipe = roundpipe.wrap(copy.deepcopy(model), config)
    pipe.configure_optimizer(lr=1e-3)
    pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
    held.release.set()
    with pytest.raises(StageError, match="the link went down"):
        pipe.close()
    with pytest.raises(PipelineStateError, match="closed"):
        pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])


def test_overlap_calls_needs_the_async_optimizer():
    with pytest.raises(ConfigError, match="optimizer_mode='async'"):
        roundpipe.RunConfig(overlap_calls=True)


def test_a_training_run_with_overlapped_calls_is_the_run_without(tmp_path):
    """``roundpipe train`` with ``run.overlap_calls``: gradient accumulation, learning-rate changes
    (queued behind the call in flight), evaluations and checkpoints (which complete it) in between;
    the same losses, evaluations and masters bit for bit."""
    from test_train import _masters, _quiet, _recipe

    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    runs = {}
    for overlap in (False, True):
        run = {"optimizer_mode": "async", "overlap_calls": overlap}
        recipe = _recipe(tmp_path / str(overlap), run=run)
        runs[overlap] = Trainer(config_from_dict(recipe), log=_quiet).fit()
    drained, overlapped = runs[False], runs[True]
    assert overlapped.steps == drained.steps == 6
    assert overlapped.train_losses == drained.train_losses
    assert overlapped.eval == drained.eval
    want, got = _masters(drained.checkpoint), _masters(overlapped.checkpoint)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def _overlapped_trace(monkeypatch, calls: int, between=lambda pipe: None) -> list[tuple[str, str]]:
    """The device ledger's (event, what) over ``calls`` overlapped calls on ``cpu:1``, each call's
    start marked; ``between(pipe)`` runs after the first call."""
    from roundpipe.runtime.worker import Worker

    run = Worker.run

    def marked(self, step, flows):
        self.device.ledger.mark(f"start of call {step.index}")
        return run(self, step, flows)

    monkeypatch.setattr(Worker, "run", marked)
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", overlap_calls=True, **ASYNC)) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        ledger = pipe.backend.devices[0].ledger
        ledger.trace = []
        for call in range(calls):
            pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
            pipe.step()
            if call == 0:
                between(pipe)
    return [(event, what) for event, what, *_ in ledger.trace]


def _call_start(trace: list[tuple[str, str]], index: int) -> int:
    return trace.index(("mark", f"start of call {index}"))


def test_the_last_stage_holds_its_weights_and_the_next_calls_first(monkeypatch):
    """The next call's first task runs layers the last stage runs too (``embed``: forward stage 0
    and backward stage 0), read from the compute copy the update after this call wrote. They go up
    while the last stage computes, into memory of their own: both versions are on the device, as
    the next stage's weights are within a call (the simulator uploads them there). Before, they were
    allocated behind the last task (Llama-3.1-8B on one virtual RTX 4090: 0.22 s a step waiting)."""
    trace = _overlapped_trace(monkeypatch, calls=3)
    end = _call_start(trace, 2)  # the boundary between the second call and the third
    last = max(n for n in range(end) if trace[n][0] == "mark" and trace[n][1].startswith("compute"))
    assert trace[last] == ("mark", "compute B0.2"), trace[last - 5 : end]
    held = 0
    for event, what in trace[:last]:
        if what == "weights:embed":
            held += 1 if event == "reserve" else -1
    assert held == 2, trace[last - 5 : end]  # the last task's and the next call's
    start = trace[end:]
    assert ("reserve", "weights:embed") not in start[: start.index(("mark", "compute F0.0"))]


def test_without_room_for_both_the_last_gradients_are_freed_first(monkeypatch):
    """The plan leaves no room beside a stage's own peak (``FlowPlan.room``) and the device's free
    bytes cannot hold the first task's weights beside the draining gradients: nothing is uploaded
    for the next call during the last task, and those gradients are freed first, after their
    download, as at the end of a drained call."""
    from roundpipe.backend.cpu import CpuDevice

    def no_room(pipe):  # after the first call: the plan's memory check, before it, reads them too
        pipe.last_plan.room = [0]
        monkeypatch.setattr(CpuDevice, "free_bytes", lambda self: 0)

    trace = _overlapped_trace(monkeypatch, calls=2, between=no_room)
    second = trace[_call_start(trace, 1) + 1 :]
    first = second[: next(n for n, (_, what) in enumerate(second) if what.startswith("inputs."))]
    events = [(event, what.split(":")[0]) for event, what in first]
    assert events.index(("release", "grads")) < events.index(("reserve", "weights")), first
