"""The cpu backend catches what CUDA would break (docs/design.md §5).

Each test breaks one rule of CUDA's execution or memory model on purpose -- a missing hand-over, a
module shell that keeps weights, a release before the last use, an unordered cross-stream access --
and checks that the cpu backend stops it with a message that names what went wrong. Then: what is
alive on a device stays within two stages' weights and one microbatch's working set however many
microbatches and steps run, and the watchdog judges progress by the devices, not the hosts.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.memory_oracle import (
    gradients_downloading,
    hand_offs_in_flight,
    microbatches_of,
    slow_gradient_downloads,
    working_set,
)
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.backend import MemoryLedger, make_backend
from roundpipe.errors import StreamProtocolError
from roundpipe.runtime import memory_guard
from roundpipe.runtime.microbatch_context import MicrobatchContext
from roundpipe.runtime.shells import LayerShells
from roundpipe.runtime.transfers import TaskOutputs
from roundpipe.runtime.worker import Worker
from roundpipe.testing import faults

torch.set_num_threads(1)


def _train(config: dict, steps: int = 1, num_layers: int = 2):
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama", num_layers=num_layers), roundpipe.RunConfig(**config)) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for _ in range(steps):
            pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()


CONFIG = dict(devices="cpu:2", num_microbatches=2, sanitize=True, policy="roundpipe", partition=None)


# ----------------------------------------------------------------------------- broken on purpose
def test_an_output_freed_before_its_download_is_caught_naming_the_tensor_and_both_streams(monkeypatch):
    """An activation a compute made is read by the download on d2h: freed on the host (at issue time,
    on CUDA) before compute has waited for that download, the caching allocator could give its block
    to compute's next tensor while d2h still reads it."""

    def drops_at_once(self, keep):  # frees the outputs without waiting for their downloads
        while len(self.waiting) > keep:
            _, slots = self.waiting.pop(0)
            self.release(slots)

    monkeypatch.setattr(TaskOutputs, "drop", drops_at_once)
    with pytest.raises(StreamProtocolError) as info:
        _train(CONFIG)
    msg = str(info.value)
    assert "of cpu:" in msg and "float32" in msg  # the tensor: tag, shape, dtype, device
    assert "/compute and used on cpu:" in msg and "/d2h" in msg  # both streams
    assert "neither handed over nor ordered" in msg and "record_stream" in msg


def test_a_shell_that_keeps_its_weights_is_caught(monkeypatch):
    """Cached module shells that stay bound keep every layer a device ever ran alive on it."""
    monkeypatch.setattr(LayerShells, "unbind", lambda self, layers: None)
    with pytest.raises(StreamProtocolError) as info:
        _train(CONFIG)
    msg = str(info.value)
    assert "tensor 'weights:" in msg and "released from the memory ledger" in msg
    assert "still alive" in msg and "module shell" in msg


def test_memory_released_before_its_last_use_is_caught(monkeypatch):
    """The upload gives an activation's memory back at once, while the compute still has to read it."""
    reserve = MemoryLedger.reserve

    def releases_at_once(self, tensors, what, tag):
        reserve(self, tensors, what, tag)
        if what.startswith("act["):
            self.release(tensors, what, tag)

    monkeypatch.setattr(MemoryLedger, "reserve", releases_at_once)
    with pytest.raises(StreamProtocolError) as info:
        _train(CONFIG)
    msg = str(info.value)
    assert "tensor 'act[" in msg and "released from the memory ledger by" in msg
    assert "but is still alive" in msg and "before its last use" in msg


def test_a_device_that_still_holds_a_tensor_after_the_step_is_caught(monkeypatch):
    """Workers are stateless: a context module left on the device after a step is a leak."""
    release = MicrobatchContext.release

    def keeps_the_context_module(self):
        module, self.module = self.module, None
        release(self)
        self.module = module

    monkeypatch.setattr(MicrobatchContext, "release", keeps_the_context_module)
    with pytest.raises(StreamProtocolError, match=r"still holds \d+ tensors .* after the step") as info:
        _train(CONFIG)
    assert "context module" in str(info.value)


def test_a_cross_stream_read_without_an_event_is_caught():
    backend = make_backend("cpu:1", sanitize=True)
    try:
        dev = backend.devices[0]
        compute, d2h = dev.streams["compute"], dev.streams["d2h"]
        made = {}

        def produce():
            made["t"] = torch.ones(4, 4)
            dev.hand_over(made["t"], d2h)
            dev.ledger.reserve(made["t"], "out", "activations")

        compute.submit(produce, name="producer")
        compute.synchronize()  # the host saw it finish, but d2h was never ordered after it
        d2h.submit(lambda: dev.to_host(made["t"]), name="reader")
        with pytest.raises(
            StreamProtocolError, match="'out' .* is read by 'reader' on cpu:0/d2h without waiting"
        ):
            d2h.synchronize()
    finally:
        backend.close()


def test_the_same_read_ordered_by_an_event_passes():
    backend = make_backend("cpu:1", sanitize=True)
    try:
        dev = backend.devices[0]
        compute, d2h = dev.streams["compute"], dev.streams["d2h"]
        made, got = {}, {}

        def produce():
            made["t"] = torch.ones(4, 4)
            dev.hand_over(made["t"], d2h)
            dev.ledger.reserve(made["t"], "out", "activations")

        def read():
            got["host"] = dev.to_host(made["t"])
            dev.ledger.release(made.pop("t"), "out", "activations")

        compute.submit(produce, name="producer")
        d2h.wait_event(compute.record_event())
        d2h.submit(read, name="reader")
        d2h.synchronize()
        assert torch.equal(got["host"], torch.ones(4, 4))
        assert dev.memory.in_use == 0  # the device tensor died with its release
    finally:
        backend.close()


def test_a_device_runs_out_of_what_is_alive_not_of_what_the_ledger_says(monkeypatch):
    """A compute's temporaries count: a capacity that fits the ledger's plan but not the working set
    fails with DeviceOutOfMemory naming the device and the task (the planner's check before the
    step, which would refuse it, switched off)."""
    monkeypatch.setenv(memory_guard.SWITCH, "0")
    model = make_model("llama", num_layers=2)
    batch = make_batch(batch=4)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1")) as probe:
        two_layers = sum(sorted(probe.store.layer_bytes)[-2:])
    with (
        roundpipe.wrap(
            model,
            roundpipe.RunConfig(
                devices="cpu:1", device_capacity=two_layers + 20_000, policy="roundpipe", partition=None
            ),
        ) as pipe,
        pytest.raises(roundpipe.DeviceOutOfMemory, match="cpu:0 is out of memory placing") as info,
    ):
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
    assert info.value.capacity == two_layers + 20_000


# ----------------------------------------------------------------------------- memory bound
@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [2, 8, 16])
def test_what_is_alive_on_a_device_stays_within_two_stages_and_one_working_set(microbatches):
    """roundpipe on 4 virtual devices, 4 steps: the bytes really alive on any device never exceed
    two stages' weights (current + prefetched) plus one microbatch's working set (and the next
    task's incoming hand-offs, uploaded while the current task computes, and the previous stage's
    fp32 gradients still on their way down), at every step. With 2 microbatches every gradient
    download is slowed down, so that those gradients are surely there."""
    model = make_model("llama", num_layers=4)
    batch = make_batch(batch=32)
    split = microbatches_of(batch, microbatches)
    need = working_set(model, split) + hand_offs_in_flight(model, split)
    config = roundpipe.RunConfig(
        devices="cpu:4", num_microbatches=microbatches, policy="roundpipe", partition=None
    )  # one layer per stage
    slow = [slow_gradient_downloads()] if microbatches == 2 else []
    with faults.injected(*slow), roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        two_stages = 2 * max(pipe.store.layer_bytes)  # one layer per stage
        downloading = gradients_downloading(pipe.store)
        peaks = []
        for _ in range(4):
            pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
            peaks.append(max(d["peak_bytes"] for d in pipe.stats()["devices"]))
            assert all(d.memory.in_use == 0 for d in pipe.backend.devices)  # nothing stays between steps
    bound = two_stages + downloading + need
    print(
        f"microbatches {microbatches}: peaks {sorted(set(peaks))}, bound {bound} = {two_stages} + {downloading} + {need}"
    )
    assert max(peaks) <= bound
    assert max(peaks) > two_stages  # the devices did hold weights and work: the bound is not vacuous


# ----------------------------------------------------------------------------- watchdog
@pytest.mark.slow
def test_the_watchdog_counts_what_the_devices_finish_not_what_the_hosts_issue(monkeypatch):
    """A long step whose every task is slow (0.2 s) but finishes keeps the watchdog (1 s) quiet even
    when the host-side issue counter is frozen, as on CUDA where workers issue far ahead."""
    model = make_model("llama", num_layers=3)

    def slow(module, args, output):
        time.sleep(0.2)

    for layer in model.model.layers:
        layer.register_forward_hook(slow)
    monkeypatch.setattr(Worker, "tasks_done", property(lambda self: 0, lambda self, v: None), raising=False)
    batch = make_batch(batch=4)
    with roundpipe.wrap(
        model,
        roundpipe.RunConfig(
            devices="cpu:1", num_microbatches=4, watchdog_s=1.0, policy="roundpipe", partition=None
        ),
    ) as pipe:
        t0 = time.monotonic()
        out = pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        assert time.monotonic() - t0 > 1.0  # the step did outlast the watchdog's limit
    assert out.loss > 0


def test_copy_byte_counts_are_exact_when_copy_streams_count_at_once():
    """Two copy streams of one device count their bytes at the same time (h2d and h2d_weights; d2h
    and d2h_grads): an unlocked ``+=`` from two threads loses updates (it did under CI's load)."""
    import sys
    import threading

    from roundpipe.backend.cpu import CpuBackend

    backend = CpuBackend(1, sanitize=False)
    dev, t = backend.devices[0], torch.zeros(3)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:

        def count():
            for _ in range(50_000):
                dev.count_in(t)
                dev.count_out(t)

        threads = [threading.Thread(target=count) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
        backend.close()
    assert dev.bytes_in == dev.bytes_out == 2 * 50_000 * 12


def test_the_cuda_events_a_host_waits_on_block_instead_of_spinning(monkeypatch):
    """cudaEventSynchronize on an event made with default flags busy-waits: every host thread that
    waits (workers, the host queue) would burn a core the CPU optimizer needs."""
    from roundpipe.backend import cuda

    made = []

    class Recorded:
        def __init__(self, **flags):
            made.append(flags)

        def record(self, stream):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    stream = cuda.CudaStream.__new__(cuda.CudaStream)  # no GPU here: only what record_event reads
    stream.stream, stream._error = object(), None
    stream.record_event()
    assert made == [{"blocking": True}]
