"""A worker's copies between the host and its device: uploads, and each task's output downloads.

An upload allocates on compute (one caching-allocator pool, freed and reused in compute order) and
copies on ``h2d`` once compute has reached the allocation, except a hand-off's: allocated on compute,
its copy could start only once the task before had finished, however long ago its data reached the
host, so it is allocated and copied on ``h2d`` and freed there too, once the compute that read it has
finished (``free_uploads``; docs/design.md §5). A task's outputs are allocated by its compute,
downloaded on ``d2h`` after it and freed on compute once the download is done. The worker thread
only issues these closures; on CUDA each one runs when it is issued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from roundpipe.backend import Device, Event
from roundpipe.runtime.exchange import HandOff, Slot
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.router_totals import router_pairs
from roundpipe.runtime.task_errors import failing_as_task
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.schedule.flow import hand_off_first
from roundpipe.testing import faults

if TYPE_CHECKING:
    from roundpipe.runtime.compute import TaskSlots
    from roundpipe.runtime.step import StepRun


def upload(
    device: Device,
    sources: list,
    what: str,
    tag: str,
    *,
    after=None,
    label=None,
    task=None,
    single=False,
    on_h2d=False,
) -> Slot:
    """Copy host tensors (None: skipped) onto ``device``; returns the slot of the device tensors
    (a list in order, or the one tensor when ``single``) that compute may read from here on.

    The copies run on ``h2d`` after compute has reached the allocation (and after ``after``, the
    event of the download that fills the host tensors), and compute waits for them before it goes
    on. ``on_h2d``: allocated on ``h2d`` instead, so the copy does not wait for compute; the caller
    frees the tensors with ``free_uploads``, not on compute. ``what``/``tag``: how the memory ledger
    books them; ``label``: the copy's span. ``task``: the step, task and microbatch of a hand-off
    upload (its ``upload`` fault point; a failure names the task)."""
    dev, streams = device, device.streams
    compute, h2d = streams["compute"], streams["h2d"]
    slot = Slot()

    def allocate():
        made = [None if t is None else dev.empty(t.shape, t.dtype) for t in sources]
        dev.ledger.reserve(made, what, tag)
        slot.value = made[0] if single else made

    if on_h2d:
        h2d.submit(allocate, name=f"allocate {what}")
    else:
        compute.submit(allocate, name=f"allocate {what}")
        h2d.wait_event(compute.record_event())
    if after is not None:
        h2d.wait_event(after)

    def copy():
        if task is not None:
            step, name, mb = task
            with failing_as_task(
                dev,
                lambda e: f"upload of {what} for {name} failed: {e}",
                dict(task=name, microbatch=mb, step=step),
            ):
                faults.point("upload", step=step, device=dev.name)
        for dst, src in zip((slot.value,) if single else slot.value, sources):
            if src is not None:
                dev.copy_in(dst, src)

    h2d.submit(copy, label, name=what)
    compute.wait_event(h2d.record_event())
    return slot


def free_uploads(device: Device, uploads: list[tuple[Slot, str]], read: Event, tag: str) -> None:
    """Free tensors ``upload(on_h2d=True)`` made, given as (slot, what the ledger booked): on ``h2d``
    once ``read`` (the event after the compute that read them) has happened, so that the block goes
    back to ``h2d``'s pool in ``h2d``'s order, behind the reads (no ``record_stream``, no pending
    free for the allocator to wait on)."""
    h2d = device.streams["h2d"]

    def free():
        for slot, what in uploads:
            value, slot.value = slot.value, None
            if value is not None:
                device.ledger.release(value, what, tag)
            del value

    h2d.wait_event(read)
    h2d.submit(free, name="free uploads")


class TaskOutputs:
    """One device's task outputs on their way down: hand-offs, losses, router statistics and
    finiteness flags, downloaded after each compute and freed on compute after the download.
    Only the device's worker thread calls it."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.waiting: list = []  # (downloaded, [(slot, what)]) of the tasks whose outputs are kept

    def start(self) -> None:
        """A new step: nothing is waiting to be freed."""
        self.waiting = []

    def download(self, step: StepRun, flow: TaskFlow, label: str, slots: TaskSlots):
        """Download what the compute produced (on ``d2h``, after it) into host hand-offs and put
        them in the exchange, and its finiteness flags for the host to read; returns the event that
        fires when the downloads are done."""
        dev, streams = self.device, self.streams
        backend = self.setup.backend
        host_out = {
            key: HandOff(
                step.flow_plan.consumers[key],
                self.setup.host_memory,
                f"{key[0]}[{key[1]}].{key[2]}",
                backend.host_release,
            )
            for key in slots.produced
        }
        host_loss, host_stats, host_checks = Slot(), Slot(), Slot()  # filled by the download

        mb = flow.task.microbatch
        # (device slot, what the ledger books it as, where its host copy goes), in two downloads:
        # the hand-offs the next compute waits for first, then what waits longer (saved stage
        # inputs, the loss, statistics and flags); one download when nothing waits longer
        bounds = step.flow_plan.forward_bounds
        first = [key for key in slots.produced if hand_off_first(key, bounds)]
        later = [key for key in slots.produced if key not in first]

        def hand_offs(keys) -> list[tuple[Slot, str, Callable[[Any], None]]]:
            return [(slots.produced[k], f"{k[0]}[{k[1]}].{k[2]}", host_out[k].fill) for k in keys]

        rest: list[tuple[Slot, str, Callable[[Any], None]]] = [
            (slots.stats, f"router.{mb}", host_stats.fill),
            (slots.loss, f"loss.{mb}", host_loss.fill),
            (slots.checks_flags, f"checks.{mb}", host_checks.fill),
        ]
        groups = [hand_offs(first), hand_offs(later) + rest] if later else [hand_offs(first) + rest]
        events = []
        for k, outputs in enumerate(groups):

            def download(outputs=outputs, fault=k == 0):
                with failing_as_task(
                    dev,
                    lambda e: f"download after {label} failed: {e}",
                    dict(task=label, microbatch=flow.task.microbatch, step=step.index),
                ):
                    if fault:
                        faults.point("download", step=step.index, device=dev.name)
                    for slot, _, fill in outputs:
                        if slot.value is not None:
                            fill(dev.to_host(slot.value))

            streams["d2h"].submit(download, (f"out:{label}", "download"))
            events.append(streams["d2h"].record_event())
        done = events[-1]  # the stream's order: every download of the task is done
        # The device outputs stay until compute has waited for this download (``drop``): freed in
        # compute order, their memory is reused by compute with no record_stream.
        self.waiting.append((done, [(slot, what) for outputs in groups for slot, what, _ in outputs]))
        # The host reads the task's flags (and adds its loss) in queue order, before any update
        # that could carry a non-finite value: queued before the outputs reach another device.
        if flow.layers_bwd and flow.layers_bwd.stop == self.setup.num_layers:
            step.on_loss(host_loss, done)
        step.on_checks(slots.checks, host_checks, done)
        if step.router is not None and (pairs := router_pairs(self.setup.adapter, flow)):
            step.router.put(pairs, host_stats, done)
        for key, s in host_out.items():
            step.exchange.put(key, s, events[0] if key in first else done, step.flow_plan.consumers[key])
        return done

    def drop(self, keep: int) -> None:
        """Free the device outputs of every downloaded task but the last ``keep``, on compute after
        their downloads (a compute-stream free: reusable by compute's next allocation at once)."""
        while len(self.waiting) > keep:
            done, slots = self.waiting.pop(0)
            self.streams["compute"].wait_event(done)
            self.release(slots)

    def release(self, slots) -> None:
        """Free these output slots' device tensors in a compute closure (the caller has ordered
        compute after every stream that still reads them)."""
        dev = self.device

        def free():
            for slot, what in slots:
                if slot.value is not None:
                    v, slot.value = slot.value, None
                    dev.ledger.release(v, what, "activations")
                    del v

        self.streams["compute"].submit(free, name="release outputs")
