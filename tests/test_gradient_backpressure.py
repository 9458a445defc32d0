"""Back-pressure of the host thread's gradient additions on a worker (runtime/gradients.py).

A worker downloads a backward stage's fp32 gradients into pinned host buffers that the host thread
gives back once it has added them. However slow the host thread is, a device must not have more
than a bounded number of stages waiting to be added (else the pinned buffers grow with the model);
the bound is ``ADDING_BEHIND`` stages downloaded besides the one on its way down and the one just
flushed, so that the worker does not wait for the addition of the stage whose download has just
ended (Qwen3-32B on one virtual RTX 4090 lost 0.1 s of GPU time a stage to that wait).
"""

from __future__ import annotations

import threading
import time

import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.runtime import gradients
from roundpipe.runtime.step import StepRun

torch.set_num_threads(1)


def _most_waiting_additions(monkeypatch) -> int:
    """The most gradient additions one device had queued and not yet done, at any time, in a step
    of 8 one-layer stages on one device whose host thread takes 50 ms an addition."""
    lock, waiting, most = threading.Lock(), [0], [0]
    on_grads, accumulate = StepRun.on_grads, StepRun._accumulate

    def queued(self, *args):
        with lock:
            waiting[0] += 1
            most[0] = max(most[0], waiting[0])
        return on_grads(self, *args)

    def slow(self, *args):
        time.sleep(0.05)
        accumulate(self, *args)
        with lock:
            waiting[0] -= 1

    monkeypatch.setattr(StepRun, "on_grads", queued)
    monkeypatch.setattr(StepRun, "_accumulate", slow)
    model = make_model("llama", num_layers=8)
    batch = make_batch(batch=4)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, policy="roundpipe", partition=None)
    with roundpipe.wrap(model, config) as pipe:
        pipe.forward_backward(**batch)
    return most[0]


BOUND = gradients.ADDING_BEHIND + 2


def test_a_slow_host_holds_a_bounded_number_of_stages_downloaded(monkeypatch):
    most = _most_waiting_additions(monkeypatch)
    print("most additions waiting:", most)
    assert most <= BOUND


def test_without_the_bound_the_waiting_stages_pile_up(monkeypatch):
    """The count above can exceed the bound: with none, most of the step's stages wait at once."""
    monkeypatch.setattr(gradients, "ADDING_BEHIND", 100)
    most = _most_waiting_additions(monkeypatch)
    print("most additions waiting:", most)
    assert most > BOUND
