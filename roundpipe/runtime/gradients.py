"""A device's weight-gradient accumulators: summed on the device per backward stage, then downloaded.

Consecutive backward tasks of one stage on a device (roundpipe runs a stage for every microbatch in
a row) add into one fp32 accumulator, and it goes down to the CPU once, when the device moves on:
M times fewer gradient downloads and host additions than one per microbatch. The download is cut
into chunks of ``copy_chunk_bytes`` paced over the device's next tasks, after each task's activation
downloads (``paced_copies.py``: a copy engine runs copies in issue order, so a stage's fp32
gradients issued at once would hold every later activation download). At most one earlier
accumulator may still be on its way down while the next one fills; each is freed on compute after
its download (docs/design.md §5); an overlapped call leaves its last ones to the next call (``carry``). Only the device's worker thread calls ``GradientAccumulators`` (and, once
it has ended, ``Executor.settle`` through ``Worker.end_of_calls``); the hook ``into_accumulator``
makes runs in the compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from roundpipe.backend import Device, Event, tensor_bytes
from roundpipe.runtime.exchange import AbortedWait, Slot
from roundpipe.runtime.numerics import TaskChecks
from roundpipe.runtime.paced_copies import Chunk, CopyGroup, PacedCopies
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.task_errors import failing_as_task
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.testing import faults

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun

# How many downloaded stages of a device the host thread may still have to add when the device
# opens its next accumulator (besides the one still on its way down). With none, the worker waits at
# every stage for the addition of the stage whose download has just ended, while the GPU runs out
# of issued work (Qwen3-32B on one virtual RTX 4090: ~0.1 s a stage, 0.69x the simulator's
# throughput); with one, that addition runs during the next stage.
ADDING_BEHIND = 1


class Flushed:
    """A flushed accumulator on its way down: ``downloaded`` (the event after its last chunk) and
    ``added`` (set once the host thread has added it) are None until its last chunk is issued."""

    def __init__(self, acc: Slot, what: str):
        self.acc, self.what = acc, what
        self.download: CopyGroup | None = None
        self.downloaded: Event | None = None
        self.added = None


class GradientAccumulators:
    """The open accumulator of one device (``open``), and the flushed ones still draining."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.copies = PacedCopies(device.streams["d2h_grads"])
        self._draining: list[Flushed] = []  # each flushed accumulator, oldest first
        self.carried = False  # the last call left its accumulators draining (``carry``)
        self.start()

    def start(self) -> None:
        """A new call: no accumulator open; the last call's may still be draining (``carry``)."""
        self._acc: Slot | None = None  # the open accumulator: piece -> fp32 device gradient
        self._acc_range, self._acc_count = range(0), 0
        self._adding: list[Flushed] = []  # freed, maybe not added yet: oldest first

    def reset(self) -> None:
        """After a failed step: forget the open and draining accumulators (their memory went with
        the device's)."""
        self._acc, self._draining, self.carried = None, [], False
        self.copies.clear()

    def carry(self) -> None:
        """The end of an overlapped call: issue what is left of the draining accumulators' downloads
        (every host job of the call is then queued) and leave them to the next call, whose worker
        frees them once they are down (``drop_downloaded``) where the plan leaves room for them,
        else after or before its first task's weights are allocated (``drop``); or
        ``Worker.end_of_calls`` when no call follows."""
        for flushed in self._draining:
            assert flushed.download is not None
            self.copies.finish(flushed.download)
        self._adding.clear()  # the host queue has every job of the call
        self.carried = bool(self._draining)

    def open(self, step: StepRun, flow: TaskFlow, say: Callable[[str], None]) -> Slot:
        """The device-side fp32 sum of ``flow``'s backward stage's weight gradients, keyed by piece
        (a new one when the device moves on to another stage). ``say``: the worker's status."""
        if self._acc is not None and self._acc_range != flow.layers_bwd:
            self.flush(step)
        if self._acc is None:
            # At most one earlier accumulator may still be on its way down while this one fills: the
            # host waits for the one before it and frees it on compute (on CUDA the new one is
            # allocated when this task is issued, in compute's pool), and for the addition of the
            # one before that.
            say(
                f"{flow.task}: waiting for the gradients two stages back to download "
                f"and those {ADDING_BEHIND + 2} back to be added"
            )
            self.drop(keep=1)
            self.carried = False  # the last call's left: one drains as the stage before this one
            self._acc, self._acc_range, self._acc_count = Slot({}), flow.layers_bwd, 0
        return self._acc

    def issued(self, step: StepRun, flow: TaskFlow, remaining: list[TaskFlow]) -> None:
        """A backward task adding into the open accumulator has been issued: keep summing while
        this device's next backward is over the same layers (forwards in between, as in 1F1B rows,
        do not touch it), else flush it."""
        self._acc_count += 1
        nxt = next((f for f in remaining if f.layers_bwd), None)
        if nxt is None or nxt.layers_bwd != flow.layers_bwd:
            self.flush(step)

    def flush(self, step: StepRun) -> None:
        """Queue the open accumulator's download, in chunks, and its hand-over to the host thread: a
        dict ``{(entry key, rows or None): fp32 gradient of those rows}``, a piece cut into row
        ranges when it is larger than a chunk. The device accumulator stays until ``drop`` frees it
        on compute, after its download."""
        if self._acc is None:
            return
        acc, layers, count = self._acc, self._acc_range, self._acc_count
        self._acc = None
        dev, streams = self.device, self.streams
        host_grads = Slot({})
        first = self.setup.adapter.layers[layers.start].name
        flushed = Flushed(acc, f"grads:{layers}")

        def chunk(piece, a, b, key, fault) -> Chunk:
            def download():
                with failing_as_task(
                    dev,
                    lambda e: f"downloading the gradients of {first}.. failed: {e}",
                    dict(layer=first, task=f"grads:{first}", step=step.index),
                ):
                    if fault:
                        faults.point("grads", step=step.index, device=dev.name, layer=first)
                    if piece is not None:
                        g = acc.value[piece]
                        host_grads.value[key] = dev.to_host(g if b is None else g[a:b])

            return download, (f"grads:{first}", "download")

        chunks: list[Chunk] = []
        size = self.setup.config.copy_chunk_bytes
        for piece, g in acc.value.items():  # complete: the backward closures ran when issued
            rows = g.shape[0] if g.dim() else 1
            step_rows = max(1, size // max(1, tensor_bytes(g) // max(rows, 1)))
            if step_rows >= rows or g.dim() == 0:
                chunks.append(chunk(piece, None, None, piece, not chunks))
                continue
            k, at = piece[0], piece[1][0] if piece[1] is not None else 0
            for a in range(0, rows, step_rows):
                b = min(rows, a + step_rows)
                chunks.append(chunk(piece, a, b, (k, (at + a, at + b)), not chunks))
        if not chunks:  # nothing trained here: the fault point still fires once
            chunks.append(chunk(None, None, None, None, True))

        def issued(event: Event) -> None:
            flushed.downloaded = event
            flushed.added = step.on_grads(layers, host_grads, count, event)

        flushed.download = self.copies.add([streams["compute"].record_event()], chunks, issued)
        self._draining.append(flushed)

    def draining_bytes(self) -> int:
        """The device bytes of the flushed accumulators not freed yet."""
        return sum(tensor_bytes(g) for f in self._draining if f.acc.value for g in f.acc.value.values())

    def pace(self, remaining: list[TaskFlow]) -> None:
        """Between tasks, after the task's own downloads: issue this task's share of the queued
        gradient chunks, spread over the tasks left until this device flushes its next accumulator."""
        if self.copies.pending:
            self.copies.pace(_tasks_to_next_flush(remaining) + 1)

    def drop_downloaded(self) -> None:
        """Free, without a wait, the accumulators the last call left whose download has ended (the
        host asks the events; it does not wait for them)."""
        while self._draining and self._draining[0].downloaded is not None:
            if not self._draining[0].downloaded.query():
                break
            self._free(self._draining.pop(0))
        self.carried = bool(self._draining)

    def drop(self, keep: int, host_waits: bool = True) -> None:
        """Free the device accumulators of every flushed stage but the last ``keep``: the host waits
        for each download (so compute does not), then compute frees it. With ``keep`` 1 (a new
        accumulator opens) the host also waits until at most ``ADDING_BEHIND`` freed stages are
        still to be added by the host thread (back-pressure: a slow optimizer thread holds a
        bounded number of stages' downloaded gradients per device, not every one the device makes).
        ``host_waits=False`` (the last overlapped call's accumulators, ``carry``): compute waits for
        the downloads instead, so the host goes on and the memory is free, in stream order, before
        whatever is allocated after."""
        if not keep:
            self.carried = False
        while len(self._draining) > keep:
            flushed = self._draining.pop(0)
            assert flushed.download is not None
            self.copies.finish(flushed.download)
            assert flushed.downloaded is not None
            if host_waits:
                flushed.downloaded.synchronize()
            self._free(flushed)
            if flushed.added is not None:
                self._adding.append(flushed)
        if not keep:
            self._adding.clear()  # the end of a call: the host queue has every one of its jobs
        while len(self._adding) > ADDING_BEHIND:
            oldest = self._adding.pop(0)
            assert oldest.added is not None
            while not oldest.added.wait(0.05):
                if self.setup.backend.aborted:
                    raise AbortedWait(f"abandoned waiting for the host to add {oldest.what}")

    def _free(self, flushed: Flushed) -> None:
        """Free ``flushed``'s device accumulator on compute, after its download."""
        compute, dev, acc, what = self.streams["compute"], self.device, flushed.acc, flushed.what
        assert flushed.downloaded is not None
        compute.wait_event(flushed.downloaded)

        def free():
            grads, acc.value = acc.value, None
            dev.ledger.release(list(grads.values()), what, "grads")
            del grads

        compute.submit(free, name=f"release {what}")


def _tasks_to_next_flush(remaining: list[TaskFlow]) -> int:
    """How many of ``remaining`` are issued before the device flushes its next accumulator (after
    the last backward over the next backward's layers before a backward over others; at the end of
    the step when none follows)."""
    first = next((n for n, f in enumerate(remaining) if f.layers_bwd), None)
    if first is None:
        return len(remaining)
    last = first
    for n in range(first + 1, len(remaining)):
        if remaining[n].layers_bwd:
            if remaining[n].layers_bwd != remaining[first].layers_bwd:
                break
            last = n
    return last + 1


def into_accumulator(acc: dict, piece, made: list, checks: TaskChecks, layer: int, name: str):
    """A post-accumulate hook that moves ``param.grad`` into ``acc[piece]`` (fp32, summed over the
    stage's microbatches; a shard's gradient covers only its rows), noting in ``checks`` whether
    this microbatch's gradient is finite (``layer``: its highest layer in the stage); a piece it
    adds first is appended to ``made`` (for the memory ledger)."""

    def hook(param: torch.Tensor) -> None:
        # torch calls this hook right after it accumulated into param.grad: it is set
        g, param.grad = cast(torch.Tensor, param.grad), None
        checks.gradient(layer, name, g)
        if piece in acc:
            acc[piece].add_(g)
        else:
            acc[piece] = g if g.dtype == torch.float32 else g.to(torch.float32)
            made.append(piece)

    return hook
