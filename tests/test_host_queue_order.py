"""The host thread's order: jobs run in submission order, except that a step's own jobs (gradient
additions, checks, losses) pass the previous step's background updates (the async optimizer's
per-layer steps) of other layers. A worker waits for its gradient additions (back-pressure), so a
whole model's update ahead of them left the GPU idle: on a virtual RTX 4090, Qwen3-32B's workers
waited ~8 s of a 27 s step for additions queued behind the previous step's update."""

from __future__ import annotations

import threading

import torch
from support.reference import assert_same_run, pipeline_train, reference_train_one_step_stale
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.optim import LayerwiseAdamW
from roundpipe.runtime import optimizer_steps
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.testing import faults
from roundpipe.testing.faults import Fault

torch.set_num_threads(1)


def _ran_in_order(jobs) -> list[str]:
    """Submit ``jobs`` (name, keyword arguments) behind a gate, so all are queued before any runs;
    the names in the order they ran."""
    q = HostQueue()
    gate, ran = threading.Event(), []
    try:
        q.submit(gate.wait)
        for name, kw in jobs:
            q.submit(lambda name=name: ran.append(name), **kw)
        gate.set()
        q.drain()
    finally:
        gate.set()  # (a failure above must not leave the thread waiting at the gate)
        q.close()
    return ran


def test_a_step_job_passes_background_jobs_it_shares_nothing_with():
    ran = _ran_in_order(
        [
            ("update 1", dict(touches={1}, background=True)),
            ("update 2", dict(touches={2}, background=True)),
            ("add 3", dict(touches={3})),
            ("add 2", dict(touches={2})),  # waits for update 2: the same layer's gradients
            ("add 4", dict(touches={4})),  # after add 2: the step's own jobs keep their order
        ]
    )
    assert ran == ["add 3", "update 1", "update 2", "add 2", "add 4"]


def test_a_job_that_touches_everything_is_passed_by_none_and_passes_none():
    ran = _ran_in_order(
        [
            ("update 1", dict(touches={1}, background=True)),
            ("barrier", dict(background=True)),  # touches None: everything
            ("add 3", dict(touches={3})),
            ("everything", {}),
        ]
    )
    assert ran == ["update 1", "barrier", "add 3", "everything"]


def test_jobs_without_background_keep_their_order():
    ran = _ran_in_order([(f"job {i}", dict(touches={i % 2})) for i in range(6)])
    assert ran == [f"job {i}" for i in range(6)]


def test_the_next_steps_gradients_are_added_while_the_last_update_still_runs():
    """Async optimizer, cpu backend: each layer group's update stalls 0.3 s on the host thread, so
    the previous step's update lasts 1.2 s into the next step. That step's gradient additions must
    not wait for it: the head's starts before the embedding's update (stepped last) does. (The step
    still ends after the update: a ``forward_backward`` returns once the host queue is drained.)"""
    model = make_model("llama")
    batch = make_batch(batch=4)
    config = roundpipe.RunConfig(
        devices="cpu:1", num_microbatches=2, policy="roundpipe", partition=None, optimizer_mode="async"
    )
    with roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        pipe.forward_backward(batch["input_ids"], batch["labels"])
        groups = 4  # the embedding, two decoder layers, the head
        with faults.injected(Fault("optimizer", kind="stall", seconds=0.3, times=groups)):
            pipe.step()  # queues the update; each group's step stalls first, on the host thread
            pipe.forward_backward(batch["input_ids"], batch["labels"])
        host = [s for s in pipe.last_timeline().spans if s.lane == "host"]
        pipe.step()
    stepped = {s.name: s for s in host if s.kind == "optim"}
    added = sorted(s.start for s in host if s.kind == "accumulate")
    assert len(stepped) == groups == 4 and added, [(s.name, s.start, s.end) for s in host]
    # a span starts after its stall: the embedding's (the last group) starts 1.2 s into the step
    assert stepped["optim:embed"].start >= 1.2, [(s.name, s.start, s.end) for s in host]
    assert added[0] < stepped["optim:embed"].start, [(s.name, s.start, s.end) for s in host]


def test_an_async_update_is_cut_into_jobs_that_gradient_additions_pass_between(monkeypatch):
    """A layer group's update is cut into host jobs of at most ``UPDATE_PART_BYTES`` of fp32
    masters (a larger parameter is a job of its own), so an addition into a group waits for the
    part running when it arrives, not for the whole group's update (Qwen3-32B on a virtual RTX
    4090: a layer's update takes ~125 ms, its largest parameter's ~33 ms; the workers waited 3.6 s
    a step for additions). With every parameter its own job, async training is unchanged."""
    monkeypatch.setattr(optimizer_steps, "UPDATE_PART_BYTES", 1, raising=False)
    model = make_model("llama")
    batch = make_batch(batch=4)
    want = reference_train_one_step_stale(model, batch, 3)
    config = dict(
        devices="cpu:1", num_microbatches=2, policy="roundpipe", partition=None, optimizer_mode="async"
    )
    got = pipeline_train(model, batch, 3, **config)
    assert_same_run(got, want)
    jobs = []
    step_group = LayerwiseAdamW.step_group
    monkeypatch.setattr(LayerwiseAdamW, "step_group", lambda self, *a: jobs.append(a) or step_group(self, *a))
    with roundpipe.wrap(model, roundpipe.RunConfig(**config)) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        pipe.forward_backward(batch["input_ids"], batch["labels"])
        pipe.step()  # queues the update, which the next call's host queue runs
        pipe.forward_backward(batch["input_ids"], batch["labels"])
        assert len(jobs) == sum(p.requires_grad for p in model.parameters()), jobs
