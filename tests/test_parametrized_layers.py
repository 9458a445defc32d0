"""Layers whose forward re-parametrizes a weight (peft's LoRA on fused MoE experts, through
``target_parameters`` or ``target_modules="all-linear"``, registers and removes a torch
parametrization on every call) train exactly like plain peft on several device threads."""

from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext

import torch
import torch.nn.utils.parametrize as P
from support.reference import assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.models.parametrized import confined_cache, layers_that_parametrize

torch.set_num_threads(1)


def test_lora_on_fused_experts_trains_like_plain_peft_on_two_devices():
    model = make_model("qwen3_moe", lora="all-linear")
    batch = make_batch(batch=4)
    want = reference_train(model, batch, steps=2)
    got = pipeline_train(
        model, batch, steps=2, devices="cpu:2", policy="roundpipe", partition=None, num_microbatches=2
    )
    assert_same_run(got, want)


def test_the_layers_that_re_parametrize_are_found():
    model = make_model("qwen3_moe", lora="all-linear")
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)) as pipe:
        found = layers_that_parametrize(pipe.adapter)
    blocks = {layer.index for layer in pipe.adapter.layers if "layers." in layer.name}
    assert found and found <= blocks
    with roundpipe.wrap(make_model("llama", lora="default"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        assert layers_that_parametrize(pipe.adapter) == frozenset()


class _Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def _read_twice_while_another_thread_caches(confine: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Read a parametrized weight in two calls, each in its own ``cached()``, with another thread
    inside a ``cached()`` of its own all along, the weight changed between the calls."""
    inside, leave = threading.Event(), threading.Event()

    def other():
        with P.cached():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        lin = torch.nn.Linear(2, 2)
        P.register_parametrization(lin, "weight", _Double())
        reads = []
        for _ in range(2):
            with confined_cache(lin) if confine else nullcontext(), P.cached():
                reads.append(lin.weight)
            with torch.no_grad():
                lin.parametrizations.weight.original.mul_(3)
        left = [k for k in list(P._cache) if k[0] == id(lin)]
    finally:
        leave.set()
        t.join()
    return reads[0], reads[1], left


def test_torch_keeps_one_parametrization_cache_for_every_thread():
    """Why: a call's cached weight outlives its own cached() while another thread is in one, and
    the next call reads it back, stale."""
    first, second, left = _read_twice_while_another_thread_caches(confine=False)
    assert second is first and left


def test_a_confined_call_leaves_nothing_in_the_cache_and_reads_its_own_weights():
    first, second, left = _read_twice_while_another_thread_caches(confine=True)
    assert left == [] and torch.equal(second, 3 * first)


class _HeldWhileTakingOut(dict):
    """A parametrization cache whose iteration, on the thread named ``taker``, signals ``entered``
    and waits for ``go``: that thread's confined call is caught taking its entries out."""

    def __init__(self, entered: threading.Event, go: threading.Event):
        super().__init__()
        self.entered, self.go = entered, go

    def __iter__(self):
        if threading.current_thread().name == "taker":
            self.entered.set()
            self.go.wait(10)
        return super().__iter__()


def test_a_confined_read_dies_with_its_call_while_another_thread_takes_its_own_entries_out():
    """A confined call's cached weight is dead when the call ends, even if another thread, taking
    its own entries out of the cache, holds the dict the weight went into when this call's
    cached() ended and torch put a fresh dict in its place (a device tensor the size of the
    weight outliving its task, which the memory ledger reports)."""
    entered, go = threading.Event(), threading.Event()
    other = torch.nn.Linear(2, 2)
    P._cache = _HeldWhileTakingOut(entered, go)

    def take_out():
        with confined_cache(other):
            pass

    taker = threading.Thread(target=take_out, name="taker")
    release = threading.Timer(0.5, go.set)  # the taker finishes on its own, later
    try:
        taker.start()
        assert entered.wait(10)
        release.start()
        lin = torch.nn.Linear(2, 2)
        P.register_parametrization(lin, "weight", _Double())
        with confined_cache(lin):
            with P.cached():
                read = weakref.ref(lin.weight)
            assert P._cache_enabled == 0  # this call's cached() ended and replaced the dict
        alive = read() is not None
    finally:
        go.set()
        taker.join(10)
        release.cancel()
        P._cache = {}
    assert not alive, "the weight read in the call outlived it, held by another thread's dict"
