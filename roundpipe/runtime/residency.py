"""Which layers' weights a device holds, and the uploads and releases that keep it so.

A layer's weights are allocated on the ``compute`` stream (as every device allocation is), uploaded
on the device's ``h2d_weights`` stream in chunks of ``copy_chunk_bytes``, and released in
``compute``-stream order after the last task that used them. The chunks of a prefetched layer are
not issued at once: a copy engine runs copies in issue order whatever the streams' priorities, so
they are paced over the tasks before the one that needs them (``paced_copies.py``), each task's
share after its activation uploads; the layers a task needs are issued in full before it. The
resident set is the current task's layers plus, with prefetch, the next task's; weight-bound
tables also keep layers the device runs again within the weight cache budget (Belady: the one
needed furthest ahead goes first). Residency thus follows from the table and a budget, with no
per-policy rule. Runs on the worker thread; the closures run on the streams (docs/design.md §4-5).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from roundpipe.backend import Device, Event, tensor_bytes
from roundpipe.runtime.exchange import Slot
from roundpipe.runtime.paced_copies import Chunk, CopyGroup, PacedCopies
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.worker_setup import WorkerSetup


@dataclass
class Resident:
    """One layer on the device: ``slot.value`` maps piece (entry key, rows) -> device Parameter
    once the allocation closure has run; ``event`` fires when every chunk has been copied (None
    until the last chunk of ``upload`` has been issued)."""

    slot: Slot
    upload: CopyGroup
    event: Event | None = None

    @property
    def copied(self) -> Event:
        """The event after the last chunk (once ``WeightResidency.ensure`` has issued them all)."""
        assert self.event is not None, "internal: waited for a layer whose upload is not issued in full"
        return self.event


class WeightResidency:
    """The weights one device holds. Not thread-safe: only its worker thread calls it."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.layers: dict[int, Resident] = {}
        self._next: dict[int, Resident] = {}  # the next call's first layers (``prefetch_next_call``)
        self.copies = PacedCopies(device.streams["h2d_weights"])
        self.read = 0  # the compute copy this call's uploads read (``StepRun.read_buffer``)

    def ensure(
        self, need: range, upcoming: range | None, remaining: list[TaskFlow], weight_bound: bool
    ) -> list[Resident]:
        """Make ``need`` resident, deciding first which resident layers to release.

        Always kept: ``need`` and, with prefetch, ``upcoming`` (the next task's layers). Streaming
        tables (roundpipe) release everything else; weight-bound tables (``weight_bound``, the
        step's table's) keep layers this device runs again later in the step as long as
        ``weight_cache_bytes`` allows.
        """
        keep = set(need) | (set(upcoming) if upcoming is not None else set())
        evict = [i for i in self.layers if i not in keep]
        if weight_bound and evict:
            evict = self._beyond_budget(keep, evict, remaining)
        for i in evict:
            self._release(i)
        for i in need:
            if i not in self.layers:
                self.layers[i] = self._upload(i, self.read)
        for i in need:
            self.copies.finish(self.layers[i].upload)
        return [self.layers[i] for i in need]

    def prefetch(self, layers: range) -> None:
        """Allocate ``layers`` and queue their chunks; ``pace`` and ``ensure`` issue them."""
        for i in layers:
            if i not in self.layers:
                self.layers[i] = self._upload(i, self.read)

    def prefetch_next_call(self, layers: range, read: int) -> None:
        """During a call's last stage: allocate the next call's first ``layers``, read from its
        compute copy ``read``, and queue their chunks (``pace`` issues them). A layer held now is
        kept for it when ``read`` is this call's copy, else uploaded again beside this one."""
        for i in layers:
            if i in self._next:
                continue
            if read != self.read or i not in self.layers:
                self._next[i] = self._upload(i, read)
            else:
                self._next[i] = self.layers[i]  # this stage's tasks go on using it

    def end_call(self) -> None:
        """The end of a call: release every layer but those kept for the next call, whose first
        layers then take their place."""
        for i, r in list(self.layers.items()):
            if self._next.get(i) is not r:
                self._release(i)
        self.layers, self._next = self._next, {}

    def pace(self, remaining: list[TaskFlow]) -> None:
        """Between tasks, after the task's own uploads: issue this task's share of the queued weight
        chunks, spread over the tasks left before the first one that needs any of them."""
        queued = {i for i, r in self.layers.items() if not r.upload.done}
        if queued or any(not r.upload.done for r in self._next.values()):
            first = next(
                (n for n, f in enumerate(remaining) if queued.intersection(f.layers)), len(remaining)
            )
            self.copies.pace(first + 1)

    def release_all(self) -> None:
        """Release every layer (with those uploaded for the next call)."""
        self.end_call()
        for i in list(self.layers):
            self._release(i)

    def reset(self) -> None:
        """Forget every layer after a failed step (the backend has been drained and reset). The
        slots are emptied too: the failed step's closures, kept by its traceback, still hold them."""
        for r in [*self.layers.values(), *self._next.values()]:
            r.slot.value = None
        self.layers.clear()
        self._next.clear()
        self.copies.clear()

    def _beyond_budget(self, keep: set[int], evict: list[int], remaining: list[TaskFlow]) -> list[int]:
        """Of the release candidates, those the weight cache cannot keep for a later task."""
        next_use: dict[int, int] = {}
        for pos, f in enumerate(remaining):
            for i in f.layers:
                next_use.setdefault(i, pos)
        layer_bytes = self.setup.store.layer_bytes
        held = [i for i in evict if i in next_use]
        total = sum(layer_bytes[i] for i in keep) + sum(layer_bytes[i] for i in held)
        budget = self.setup.weight_cache_bytes
        held.sort(key=lambda i: next_use[i], reverse=True)
        while held and budget is not None and total > budget:
            total -= layer_bytes[held.pop(0)]
        return [i for i in evict if i not in held]

    def _upload(self, layer: int, read: int) -> Resident:
        store, dev = self.setup.store, self.device
        pieces = store.layer_pieces(layer)  # whole entries, or only the rows the layer uses
        name = self.setup.adapter.layers[layer].name
        slot = Slot()
        compute = dev.streams["compute"]

        def allocate():
            tensors = {}
            for piece in pieces:
                src = store.piece_source(piece, read)
                trainable = store.entries[piece[0]].trainable
                tensors[piece] = nn.Parameter(dev.empty(src.shape, src.dtype), requires_grad=trainable)
            dev.ledger.reserve(list(tensors.values()), f"weights:{name}", "weights")
            slot.value = tensors

        # Allocated on compute, as every device allocation but a hand-off's is (one caching-allocator
        # pool, freed and reused in compute order): the copies start once compute has reached the
        # allocation, so after the tasks that used the memory the released layers gave back.
        compute.submit(allocate, name=f"weights:{name}")
        allocated = compute.record_event()
        chunk = self.setup.config.copy_chunk_bytes
        chunks: list[Chunk] = []
        for piece in pieces:
            src = store.piece_source(piece, read)  # for its shape; each copy reads it when it runs
            rows = src.shape[0] if src.dim() else 1
            row_bytes = max(1, tensor_bytes(src) // max(rows, 1))
            step = max(1, chunk // row_bytes)
            for a in range(0, rows, step):
                b = min(rows, a + step)

                def copy(piece=piece, a=a, b=b):
                    data = slot.value[piece].data
                    src = store.piece_source(piece, read)
                    if data.dim() == 0:
                        dev.copy_in(data, src)
                    else:
                        dev.copy_in(data[a:b], src[a:b])

                chunks.append((copy, (f"W:{name}", "upload")))

        def uploaded(event: Event) -> None:
            resident.event = event

        resident = Resident(slot, self.copies.add([allocated], chunks, uploaded))
        return resident

    def _release(self, layer: int) -> None:
        r = self.layers.pop(layer)  # (``_next``'s are moved to ``layers`` first)
        self.copies.finish(r.upload)  # the free waits for every chunk issued to its memory
        dev, name = self.device, self.setup.adapter.layers[layer].name

        def free():
            tensors = list(r.slot.value.values())
            r.slot.value = None
            dev.ledger.release(tensors, f"weights:{name}", "weights")

        # A prefetched layer can be released before any task used it (under ``order="ready"`` the
        # task that runs next need not be the one prefetched for): its upload may still be queued
        # on the weights stream, so the release waits for it. A no-op when compute used the layer.
        compute = dev.streams["compute"]
        compute.wait_event(r.copied)
        compute.submit(free, name=f"release weights:{name}")
