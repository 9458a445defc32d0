"""A device's weight-gradient accumulators: summed on the device per backward stage, then downloaded.

Consecutive backward tasks of one stage on a device (roundpipe runs a stage for every microbatch in
a row) add into one fp32 accumulator, and it goes down to the CPU once, when the device moves on:
M times fewer gradient downloads and host additions than one per microbatch. At most one earlier
accumulator may still be on its way down while the next one fills; each is freed on compute after
its download (docs/design.md §5). Only the device's worker thread calls ``GradientAccumulators``;
the hook ``into_accumulator`` makes runs in the compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from roundpipe.backend import Device
from roundpipe.runtime.exchange import AbortedWait, Slot
from roundpipe.runtime.numerics import TaskChecks
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.task_errors import failing_as_task
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.testing import faults

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun


class GradientAccumulators:
    """The open accumulator of one device (``open``), and the flushed ones still draining."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.start()

    def start(self) -> None:
        """A new step: no accumulator open or draining."""
        self._draining: list = []  # (downloaded, added, slot, what) of each flushed accumulator
        self._acc: Slot | None = None  # the open accumulator: piece -> fp32 device gradient
        self._acc_range, self._acc_count = range(0), 0

    def reset(self) -> None:
        """After a failed step: forget the open accumulator (its memory went with the device's)."""
        self._acc = None

    def open(self, step: StepRun, flow: TaskFlow, say: Callable[[str], None]) -> Slot:
        """The device-side fp32 sum of ``flow``'s backward stage's weight gradients, keyed by piece
        (a new one when the device moves on to another stage). ``say``: the worker's status."""
        if self._acc is not None and self._acc_range != flow.layers_bwd:
            self.flush(step)
        if self._acc is None:
            # At most one earlier accumulator may still be on its way down while this one fills: the
            # host waits for the one before it and frees it on compute (on CUDA the new one is
            # allocated when this task is issued, in compute's pool).
            say(f"{flow.task}: waiting for the gradients of two stages back to download")
            self.drop(keep=1)
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
        """Download the open accumulator and hand it to the host thread: a dict
        ``{(entry key, rows or None): fp32 gradient of those rows}``. The device accumulator stays
        until ``drop`` frees it on compute, after its download."""
        if self._acc is None:
            return
        acc, layers, count = self._acc, self._acc_range, self._acc_count
        self._acc = None
        dev, streams = self.device, self.streams
        host_grads = Slot()

        first = self.setup.adapter.layers[layers.start].name

        def download():
            with failing_as_task(
                dev,
                lambda e: f"downloading the gradients of {first}.. failed: {e}",
                dict(layer=first, task=f"grads:{first}", step=step.index),
            ):
                faults.point("grads", step=step.index, device=dev.name, layer=first)
                host_grads.value = {k: dev.to_host(g) for k, g in acc.value.items()}

        grads_stream = streams["d2h_grads"]
        grads_stream.wait_event(streams["compute"].record_event())
        grads_stream.submit(download, (f"grads:{first}", "download"))
        downloaded = grads_stream.record_event()
        added = step.on_grads(layers, host_grads, count, downloaded)
        self._draining.append((downloaded, added, acc, f"grads:{layers}"))

    def drop(self, keep: int) -> None:
        """Free the device accumulators of every flushed stage but the last ``keep``: the host waits
        for each download (so compute does not), then compute frees it. With ``keep`` 1 the host
        also waits until the host thread has added it (back-pressure: a slow optimizer thread holds
        at most two stages' downloaded gradients per device, not every one the device makes)."""
        compute, dev = self.streams["compute"], self.device
        while len(self._draining) > keep:
            downloaded, added, acc, what = self._draining.pop(0)
            downloaded.synchronize()
            if keep and added is not None:
                while not added.wait(0.05):
                    if self.setup.backend.aborted:
                        raise AbortedWait(f"abandoned waiting for the host to add {what}")
            compute.wait_event(downloaded)

            def free(acc=acc, what=what):
                grads, acc.value = acc.value, None
                dev.ledger.release(list(grads.values()), what, "grads")
                del grads

            compute.submit(free, name=f"release {what}")


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
