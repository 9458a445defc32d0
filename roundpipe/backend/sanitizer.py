"""The cpu backend's stream sanitizer: CUDA's stream and memory rules, checked at issue time.

The issue mode (``cpu_clock.py``) sees every aten operation a closure makes, at the moment it is
issued, with the device block (``cpu_allocator.Block``) each tensor lives in. Streams keep vector
clocks of issued closures, and events carry them (``record_event`` at issue, ``wait_event`` merges),
so whether one stream's access is ordered after another's is a comparison, as in PyTorch's CUDA
stream sanitizer (``torch.cuda._sanitizer``). What it enforces, each violation a
``StreamProtocolError`` naming the tensor, the streams and the task:

- **Ordering** (checking on): a cross-stream read must be ordered after the last write by an event,
  and a write after every earlier read and write; a tensor is never used by another device's stream.
- **Reuse** (checking on): when a block is freed, every use of it on a stream other than the one
  that allocated it must either have been handed over to that stream (``Device.hand_over``,
  ``record_stream`` on CUDA: the allocator then waits for that stream before reusing the block) or
  be ordered before the allocating stream's current point (so its next allocation, which may reuse
  the block, runs after that use). Otherwise the caching allocator may give the block to a new
  tensor whose writes race the use.
- **The ledger** (always): at the end of a closure, every device block it made that is still
  allocated must be reserved in the device's ``MemoryLedger``, and every block whose reservation it
  released must be free; after a step a device holds nothing (``check_empty``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import torch

from roundpipe.errors import StreamProtocolError

_local = threading.local()


def stream_name(stream) -> str:
    return f"{stream.device.name}/{stream.name}"


class Sanitizer:
    """The checks of one backend (one lock: closures are issued from several threads)."""

    def __init__(self, checking: bool, blocks: dict):
        self.checking = checking
        self.blocks = blocks  # storage data ptr -> allocated Block, every device of the backend
        self.lock = threading.RLock()
        self.generation = 0  # bumped when a failed step is abandoned
        self.violations: list[StreamProtocolError] = []  # found where raising is impossible (frees)

    def lookup(self, t: torch.Tensor):
        """The allocated block ``t`` lives in, or None (host memory)."""
        if t.device.type != "cpu":
            return None
        return self.blocks.get(t.untyped_storage().data_ptr())

    def hand_over(self, t: torch.Tensor, stream) -> None:
        block = self.lookup(t)
        if block is not None:
            block.handed = block.handed | {stream}

    # -------------------------------------------------------------- the ledger's view
    @contextmanager
    def collecting_releases(self):
        """Blocks whose reservation is released inside (by ``reserved``) are collected for the
        end-of-closure check."""
        released: list[tuple[Any, int]] = []  # (block, serial), as ``reserved`` returns them
        _local.released = released
        try:
            yield released
        finally:
            _local.released = None

    def reserved(self, tensors, reserve: bool, what: str) -> list:
        """Mark the blocks of ``tensors`` reserved as ``what`` (or released); ``(block, serial)`` of
        each (the serial tells the tenant, as a freed block may be handed out again)."""
        out = []
        for t in tensors:
            block = self.lookup(t)
            if block is not None:
                block.reserved = reserve
                block.tag = what
                out.append((block, block.serial))
        released = getattr(_local, "released", None)
        if not reserve and released is not None:
            released.extend(out)
        return out

    def held(self, device) -> list:
        """What ``device`` still holds of the steps since the last abandoned one, largest first."""
        return device.allocator.live(self.generation)

    def abandon(self) -> None:
        """After a failed step: what it left alive (held by the caller's exception, say) still
        counts as memory but no longer as a leak of the steps that follow."""
        with self.lock:
            self.generation += 1
            self.violations.clear()

    # -------------------------------------------------------------- accesses
    def check_accesses(self, touched, stream, task: str) -> None:
        with self.lock:
            for block, is_write in touched:
                if block.allocated:
                    self.check(block, is_write, stream, task)

    def check(self, r, is_write: bool, stream, task: str) -> None:
        """Check (and record) an access to block ``r`` by ``task`` on ``stream`` (lock held)."""
        where = f"by {task!r} on {stream_name(stream)}"
        if r.device is not stream.device:
            raise StreamProtocolError(
                f"{r.describe()} is used {where}, another device: move it with a copy "
                "(to_host on its own device, then to_device), never share device tensors"
            )
        clock = stream.clock
        ws, wt = r.write
        if ws is not stream and clock.get(ws, 0) < wt:
            kind = "written" if is_write else "read"
            raise StreamProtocolError(
                f"{r.describe()} is {kind} {where} without waiting for its last write on "
                f"{stream_name(ws)}: make {stream.name} wait on an event recorded after that write"
            )
        if r.reads is None:
            r.reads = {}
        if is_write:
            for rs, rt in r.reads.items():
                if rs is not stream and clock.get(rs, 0) < rt:
                    raise StreamProtocolError(
                        f"{r.describe()} is overwritten {where} while a read of it on "
                        f"{stream_name(rs)} is not ordered before: wait on an event recorded after that read"
                    )
            r.write = (stream, clock.get(stream, 0))
            r.reads = {}
        else:
            r.reads[stream] = clock.get(stream, 0)

    def check_free(self, block) -> None:
        """A block is being freed (on the thread that dropped its tensor): every use on another stream
        must be handed over or ordered before its allocating stream's current point. A violation is
        kept and raised at the end of the closure (a free happens inside a weak-reference callback,
        where an exception would be lost)."""
        if not self.checking:
            return
        owner = block.stream
        clock = owner.clock
        for other, t in (block.write, *(block.reads or {}).items()):
            if other is owner or other in block.handed or clock.get(other, 0) >= t:
                continue
            self.violations.append(
                StreamProtocolError(
                    f"{block.describe()} was made on {stream_name(owner)} and used on "
                    f"{stream_name(other)}, and its memory was given back while that use is neither "
                    f"handed over nor ordered before {owner.name}: the caching allocator may hand the "
                    f"block to {owner.name}'s next tensor, whose writes race the use. Call "
                    f"device.hand_over(tensor, streams[{other.name!r}]) (record_stream on CUDA) once it "
                    f"exists, or make {owner.name} wait on an event recorded after that use before the "
                    f"tensor is dropped"
                )
            )
            return

    def raise_violations(self) -> None:
        if self.violations:
            with self.lock:
                found, self.violations = self.violations, []
            raise found[0]

    def check_leftovers(self, made: list, released: list, task: str, stream) -> None:
        """End of a closure: what it made and left alive is reserved; what it released is gone."""
        self.raise_violations()
        where = f"{task!r} on {stream_name(stream)}"
        for r, serial in released:
            if r.allocated and r.serial == serial:
                raise StreamProtocolError(
                    f"{r.describe()} was released from the memory ledger by {where} but is still "
                    "alive: something still references it (a cached module shell? a slot?), or it "
                    "was released before its last use; release it in stream order after that use"
                )
        for r, serial in made:
            if r.allocated and r.serial == serial and not r.reserved:
                raise StreamProtocolError(
                    f"{r.describe()} made by {where} outlives it but is not reserved in the memory "
                    "ledger: reserve what a closure leaves on the device, or let it die"
                )
