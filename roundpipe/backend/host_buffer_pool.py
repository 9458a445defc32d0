"""The pool of page-locked host buffers for the hand-offs (downloaded activations and gradients,
staged inputs).

The pool keeps page-locked buffers in size classes (16 per power of two, so a buffer is at most
1/16 larger than asked), serves a request from a free buffer of its class or one up to 1.25x
larger, and keeps what it has reserved within ``headroom`` (1.25) times the most it ever had in use
by giving back the least recently used free buffers before it makes a new one. In use means held by
an owner or by a copy that may still read or write it, and is counted in the bytes of the buffers so
held (a request's own bytes plus its rounding): a bound the pool can always keep, since giving back
every free buffer leaves exactly those. (Counted in requested bytes it could not: the rounding of
buffers held when a new one must be made may alone pass 1.25x, and nothing free is left to give.)
 a buffer given back with an event is reused
only once the event has happened, and giving one back while a copy into or out of it may still be
pending is a ``StreamProtocolError`` where the backend can tell (the cpu backend).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

import torch

from roundpipe.backend.base import Event, storage_key, tensor_bytes
from roundpipe.backend.host_allocators import HostAllocator
from roundpipe.backend.host_arena import ALIGNMENT, align_up, carve, spec_bytes
from roundpipe.errors import StreamProtocolError

CLASS_BITS = 4  # 2**4 = 16 pool size classes per power of two: a buffer is at most 1/16 over its request
REUSE_LARGER = 1.25  # a request may take a free pool buffer up to this much larger than its class
HEADROOM = 1.25  # the pool's reserved bytes stay within this much of its peak in use


def size_class(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """The pool buffer size for a request of ``nbytes``: a multiple of ``alignment`` up to 16 of them,
    then one of 16 steps of its power of two (at most 1/16 over)."""
    n = align_up(max(nbytes, 1), alignment)
    if n <= alignment << CLASS_BITS:
        return n
    step = 1 << (n.bit_length() - 1 - CLASS_BITS)
    return -(-n // step) * step


class _Buffer:
    """One pool buffer: its bytes, its size class, and who uses it now."""

    __slots__ = ("tensor", "size", "key", "nbytes", "event", "accesses", "used")

    def __init__(self, tensor: torch.Tensor, size: int):
        self.tensor, self.size = tensor, size
        self.key = storage_key(tensor)  # what the tensors carved from it share
        self.nbytes = 0  # bytes handed out (0: free)
        self.event: Event | None = None  # released before this happened (a copy may still run)
        self.accesses: list = []  # (stream, clock) of the device copies into or out of it (cpu backend)
        self.used = 0  # when it was last handed out (least recently used goes first)


class HostBufferPool:
    """Reusable page-locked host buffers for the hand-offs (downloaded activations and gradients,
    staged inputs): see the module docstring. Thread-safe.

    ``acquire(shape, dtype)`` returns a tensor nobody else holds. ``release(t, event)`` gives it
    back; it is handed out again only once ``event.query()`` is true -- pass the event recorded after
    the last asynchronous copy that reads or writes it (None: reusable at once; the caller says every
    copy is done). ``records`` maps a buffer's storage to its record, so that a backend that sees the
    copies (the cpu backend) notes each in ``accesses``; then a release whose event (or, with None,
    whose thread's knowledge) does not cover every one is a ``StreamProtocolError``.
    """

    def __init__(self, allocator: HostAllocator, headroom: float = HEADROOM):
        self.allocator = allocator
        self.headroom = headroom
        self._lock = threading.Lock()
        self._ready: dict[int, list[_Buffer]] = {}  # size class -> free buffers whose copies are done
        self._sizes: list[int] = []  # sorted size classes of _ready
        self._pending: list[_Buffer] = []  # given back with an event that had not happened yet
        self._live: dict[int, _Buffer] = {}  # key -> buffer handed out
        self.records: dict[int, _Buffer] = {}  # key -> every buffer that exists
        self._closed = False
        self._tick = 0
        self.buffers = 0  # distinct buffers made
        self.freed = 0  # buffers given back to the allocator
        self.acquires = 0
        self.reuses = 0
        self.in_use_bytes = 0  # held by owners (the bytes they asked for)
        self.pending_bytes = 0  # given back, a copy may still read or write them
        self.peak_in_use_bytes = 0  # the most ever held by owners or pending copies
        self.in_use_buffer_bytes = 0  # the sizes of the buffers held by owners or pending copies
        self.peak_in_use_buffer_bytes = 0  # the most of those ever (what ``headroom`` scales)
        self.peak_held_bytes = 0  # the most ever held by owners
        self.reserved_bytes = 0  # the sizes of every buffer that exists
        self.peak_reserved_bytes = 0

    # ------------------------------------------------------------------ acquire
    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` and ``dtype`` that only the caller holds."""
        shape = tuple(shape)
        n = spec_bytes(shape, dtype)
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=self.allocator.backend.host_device)
        size = size_class(n, self.allocator.alignment)
        with self._lock:
            if self._closed:
                raise RuntimeError("HostBufferPool.acquire after close()")
            self._collect()
            buf = self._take(size)
            if buf is None:
                evicted = self._make_room(size)
                self._book(size)  # booked now; made below, outside the lock
            else:
                evicted = []
                self.reuses += 1
                self._hand_out(buf, n)
        self._free_all(evicted)
        if buf is None:
            try:
                tensor = self.allocator.buffer(size)  # page-locking is slow: not under the lock
            except BaseException:
                with self._lock:
                    self.reserved_bytes -= size
                    self.in_use_buffer_bytes -= size
                raise
            buf = _Buffer(tensor, size)
            with self._lock:
                self.records[buf.key] = buf
                self.buffers += 1
                self._hand_out(buf, n, booked=True)
        return carve(buf.tensor, 0, shape, dtype)

    def _book(self, size: int) -> None:
        """Count a new buffer of ``size`` reserved and in use."""
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._use(size)

    def _use(self, size: int) -> None:
        self.in_use_buffer_bytes += size
        self.peak_in_use_buffer_bytes = max(self.peak_in_use_buffer_bytes, self.in_use_buffer_bytes)

    def _hand_out(self, buf: _Buffer, n: int, booked: bool = False) -> None:
        if not booked:  # a free buffer taken again: in use once more
            self._use(buf.size)
        self._tick += 1
        buf.nbytes, buf.used, buf.accesses = n, self._tick, []
        self._live[buf.key] = buf
        self.acquires += 1
        self.in_use_bytes += n
        self.peak_held_bytes = max(self.peak_held_bytes, self.in_use_bytes)
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes + self.pending_bytes)

    def _take(self, size: int) -> _Buffer | None:
        """The free buffer of the smallest class from ``size`` up to ``REUSE_LARGER`` times it."""
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes) or self._sizes[i] > size * REUSE_LARGER:
            return None
        found = self._sizes[i]
        bufs = self._ready[found]
        buf = bufs.pop()
        if not bufs:
            del self._ready[found]
            del self._sizes[i]
        return buf

    def _collect(self) -> None:
        """Pending buffers whose event has happened become free."""
        if not self._pending:
            return
        still = []
        for buf in self._pending:
            if buf.event.query():
                buf.event = None
                self.pending_bytes -= buf.nbytes
                self.in_use_buffer_bytes -= buf.size
                buf.nbytes = 0
                self._put_ready(buf)
            else:
                still.append(buf)
        self._pending = still

    def _put_ready(self, buf: _Buffer) -> None:
        bufs = self._ready.get(buf.size)
        if bufs is None:
            self._ready[buf.size] = [buf]
            bisect.insort(self._sizes, buf.size)
        else:
            bufs.append(buf)

    def _make_room(self, size: int) -> list[_Buffer]:
        """Take out the least recently used free buffers until a new one of ``size`` keeps the pool
        within its headroom; returns them (freed outside the lock). Always possible: with every free
        buffer gone, reserved + ``size`` is the buffers in use, at most their peak."""
        peak = max(self.peak_in_use_buffer_bytes, self.in_use_buffer_bytes + size)
        budget = self.headroom * peak
        ready = sorted((b for bufs in self._ready.values() for b in bufs), key=lambda b: b.used)
        evicted = []
        for buf in ready:
            if self.reserved_bytes + size <= budget:
                break
            bufs = self._ready[buf.size]
            bufs.remove(buf)
            if not bufs:
                del self._ready[buf.size]
                del self._sizes[bisect.bisect_left(self._sizes, buf.size)]
            del self.records[buf.key]
            self.reserved_bytes -= buf.size
            evicted.append(buf)
        return evicted

    def _free_all(self, bufs: list[_Buffer]) -> None:
        for buf in bufs:
            self.allocator.free_buffer(buf.tensor)
        self.freed += len(bufs)

    # ------------------------------------------------------------------ release
    def release(self, t: torch.Tensor, event: Event | None = None) -> None:
        """Give back a tensor from ``acquire`` (the whole tensor, once); reusable once ``event`` has
        happened (None: now)."""
        n = tensor_bytes(t)
        if n == 0:
            return
        covered = self.allocator.backend.completed_clock(event)
        with self._lock:
            if self._closed:
                return
            buf = self._live.get(storage_key(t))
            if buf is None or buf.nbytes != n or t.data_ptr() != buf.tensor.data_ptr():
                raise ValueError(
                    "release() of a tensor this pool did not hand out (or already released): pass the "
                    "tensor acquire() returned, once"
                )
            if covered is not None and buf.accesses:
                _check_covered(buf, covered, event, t)
            del self._live[buf.key]
            self.in_use_bytes -= n
            if event is None or event.query():
                buf.nbytes = 0
                self.in_use_buffer_bytes -= buf.size
                self._put_ready(buf)
            else:
                buf.event = event
                self.pending_bytes += n
                self._pending.append(buf)

    def trim(self) -> int:
        """Give back every free buffer beyond the headroom (and the pending ones now done);
        returns the bytes given back."""
        with self._lock:
            self._collect()
            before = self.reserved_bytes
            evicted = self._make_room(0)
        self._free_all(evicted)
        return before - self.reserved_bytes

    def close(self) -> None:
        """Forget every buffer (the allocator gives back the memory)."""
        with self._lock:
            self._closed = True
            self._ready.clear()
            self._sizes.clear()
            self._pending.clear()
            self._live.clear()
            self.records.clear()
            self.in_use_bytes = self.pending_bytes = self.in_use_buffer_bytes = 0


def _check_covered(buf: _Buffer, covered: dict, event, t: torch.Tensor) -> None:
    """Every device copy into or out of ``buf`` must be ordered before ``covered`` (the clock of the
    release's event, or what the releasing thread has seen finish)."""
    for stream, clock in buf.accesses:
        if covered.get(stream, 0) < clock:
            dtype = str(t.dtype).removeprefix("torch.")
            given = (
                "without an event, on a thread that has not seen that copy finish"
                if event is None
                else "with an event that is not recorded after that copy"
            )
            raise StreamProtocolError(
                f"the pinned host buffer {list(t.shape)} {dtype} went back to the pool {given}, while "
                f"a copy into or out of it on {stream.device.name}/{stream.name} may still be pending: "
                "its next owner could read the late copy's bytes or overwrite what it still reads. "
                "Release it with an event recorded after the copy (on the copy's stream, or one that "
                "waited for it), or after synchronizing on one"
            )
