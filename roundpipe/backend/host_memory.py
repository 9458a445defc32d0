"""Host memory for the model state and the hand-offs, without the pinned allocator's rounding.

PyTorch's CUDA caching host allocator (what ``Tensor.pin_memory()`` and ``pin_memory=True`` use)
rounds every block up to the next power of two, so pinning tensor by tensor can reserve up to
twice the bytes asked for (pytorch issue #150517). Here host memory comes instead from a few large
plain allocations, page-locked in place with ``Backend.register_host`` (``cudaHostRegister`` on
CUDA, exact size) and carved into tensors.

Three modes (``RunConfig.host_memory``), one allocator class each:

- ``"arena"``: static tensors (the parameter store's compute copies) are planned first and carved
  from one exactly-sized block (one per ``block_bytes``); pool buffers are carved from chunks of at
  least ``chunk_bytes``. Reserved = the sizes of those blocks.
- ``"pinned"``: one ``Backend.pin`` per tensor (the behaviour before arenas). Reserved is what the
  CUDA caching host allocator reserves: the real figure where the backend can report it (an optional
  ``pinned_host_reserved_bytes()`` method), else the model of it: each request rounded up to a power
  of two.
- ``"pageable"``: nothing is pinned (asynchronous copies are staged by the driver); reserved =
  requested.

``HostMemory`` bundles the allocator of a mode with a ``HostBufferPool`` (dynamic buffers for the
hand-offs) and reports both in ``stats()``. No CUDA call is made here: page-locking goes through the
backend's hooks.

The pool keeps page-locked buffers in size classes (16 per power of two, so a buffer is at most
1/16 larger than asked), serves a request from a free buffer of its class or one up to 1.25x
larger, and keeps what it has reserved within ``headroom`` (1.25) times the most it ever had in use
by giving back the least recently used free buffers before it makes a new one. In use means held by
an owner or by a copy that may still read or write it: a buffer given back with an event is reused
only once the event has happened, and giving one back while a copy into or out of it may still be
pending is a ``StreamProtocolError`` where the backend can tell (the cpu backend).
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from roundpipe.backend.base import Backend, Event, tensor_bytes
from roundpipe.errors import ConfigError, StreamProtocolError

HOST_MEMORY_MODES = ("arena", "pinned", "pageable")
ALIGNMENT = 64  # bytes; every carved tensor starts on a cache line (and any dtype's element size)
BLOCK_BYTES = 4 << 30  # at most this much per static arena block (unless one tensor is larger)
CLASS_BITS = 4  # 2**4 = 16 pool size classes per power of two: a buffer is at most 1/16 over its request
REUSE_LARGER = 1.25  # a request may take a free pool buffer up to this much larger than its class
HEADROOM = 1.25  # the pool's reserved bytes stay within this much of its peak in use

Spec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a tensor to allocate


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def pow2_ceil(nbytes: int) -> int:
    """What the CUDA caching host allocator reserves for a request of ``nbytes``."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def size_class(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """The pool buffer size for a request of ``nbytes``: a multiple of ``alignment`` up to 16 of them,
    then one of 16 steps of its power of two (at most 1/16 over)."""
    n = align_up(max(nbytes, 1), alignment)
    if n <= alignment << CLASS_BITS:
        return n
    step = 1 << (n.bit_length() - 1 - CLASS_BITS)
    return -(-n // step) * step


def spec_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def carve(block: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that lives at byte ``offset`` of a uint8 ``block``."""
    n = spec_bytes(shape, dtype)
    return block[offset : offset + n].view(dtype).view(tuple(shape))


def _check_alignment(alignment: int) -> None:
    if alignment < 16 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 16 bytes, got {alignment}")


def _unregister_all(backend: Backend, raw: list[torch.Tensor]) -> None:
    while raw:
        backend.unregister_host(raw.pop())


class HostArena:
    """Tensors carved from a few large page-locked host allocations, sized exactly to a plan.

    ``specs`` lists every tensor, ``(shape, dtype)``; each one starts ``alignment`` bytes aligned
    and the next starts right after it (rounded up to the alignment). Tensors are packed in order
    into blocks of at most ``block_bytes`` (a tensor larger than that gets a block of its own); every
    block is sized to what it holds, so the only bytes reserved beyond the requested ones are the
    alignment gaps. Blocks rather than one allocation: each ``cudaHostRegister`` faults in and locks
    every page of its range, so a multi-hundred-GB single call blocks for minutes with no progress
    and fails all-or-nothing; a few-GiB block bounds each call and names where it failed, at no cost
    in bytes. Zero-size tensors hold no bytes and are ordinary empty tensors.

    ``tensors[i]`` is the (uninitialised) tensor of ``specs[i]``. ``close()`` unregisters the blocks;
    the carved tensors stay valid (as pageable memory) while referenced. An arena dropped without
    ``close()`` unregisters when it is garbage collected.
    """

    def __init__(
        self,
        backend: Backend,
        specs: Sequence[Spec],
        *,
        alignment: int = ALIGNMENT,
        block_bytes: int = BLOCK_BYTES,
    ):
        _check_alignment(alignment)
        self.alignment = alignment
        self.requested_bytes = 0
        places: list[tuple[int, int] | None] = []  # (block, byte offset) per spec; None: zero-size
        sizes: list[int] = []  # bytes used in each block (its end; no trailing gap)
        for shape, dtype in specs:
            n = spec_bytes(shape, dtype)
            self.requested_bytes += n
            if n == 0:
                places.append(None)
                continue
            offset = align_up(sizes[-1], alignment) if sizes else 0
            if not sizes or (offset + n > block_bytes and sizes[-1] > 0):
                sizes.append(0)
                offset = 0
            places.append((len(sizes) - 1, offset))
            sizes[-1] = offset + n
        self._raw: list[torch.Tensor] = []  # the allocations made
        self._registered: list[torch.Tensor] = []  # those still registered
        self._finalizer = weakref.finalize(self, _unregister_all, backend, self._registered)
        self._finalizer.atexit = False  # at interpreter exit the driver may already be gone
        blocks = []
        try:
            for size in sizes:
                blocks.append(self._new_block(backend, size))
        except BaseException:
            self.close()
            raise
        self.blocks = blocks  # uint8, one per block, each starting ``alignment`` aligned
        self.tensors: list[torch.Tensor] = [
            torch.empty(tuple(shape), dtype=dtype) if p is None else carve(blocks[p[0]], p[1], shape, dtype)
            for (shape, dtype), p in zip(specs, places)
        ]

    def _new_block(self, backend: Backend, size: int) -> torch.Tensor:
        # The CPU allocator aligns to 64 bytes; a larger alignment over-allocates and shifts.
        extra = max(0, self.alignment - 64)
        raw = torch.empty(size + extra, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % self.alignment
        backend.register_host(raw)
        self._raw.append(raw)
        self._registered.append(raw)
        return raw[shift : shift + size]

    @property
    def reserved_bytes(self) -> int:
        """Bytes actually allocated: the sum of the blocks' allocation sizes."""
        return sum(tensor_bytes(r) for r in self._raw)

    @property
    def allocations(self) -> int:
        return len(self._raw)

    def close(self) -> None:
        """Unregister the blocks (call after every asynchronous copy from or to them has finished)."""
        self._finalizer()


class HostAllocator(ABC):
    """Where one mode's host memory comes from: ``tensors`` for a static plan (all at once) and
    ``buffer`` for one raw pool buffer. Keeps what it allocated, and reports reserved bytes from it."""

    mode: str
    keeps_model_tensors = False  # the store may use a model's own CPU tensor as is (no copy)
    reserved_source = "allocations"

    def __init__(self, backend: Backend, *, alignment: int = ALIGNMENT):
        _check_alignment(alignment)
        self.backend = backend
        self.alignment = alignment
        self.static_requested_bytes = 0
        self.static_tensors = 0
        self._lock = threading.Lock()

    @abstractmethod
    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        """Fresh, uninitialised host tensors for ``specs`` (in order), ready for async copies."""

    @abstractmethod
    def buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 host buffer of ``nbytes`` (a multiple of the alignment), aligned, that is a
        whole allocation of its own (``free_buffer`` gives it back)."""

    @abstractmethod
    def free_buffer(self, t: torch.Tensor) -> None:
        """Give back a ``buffer`` (after every asynchronous copy from or to it has finished)."""

    @abstractmethod
    def static_reserved_bytes(self) -> int: ...

    @abstractmethod
    def dynamic_reserved_bytes(self) -> int: ...

    @abstractmethod
    def dynamic_allocations(self) -> int: ...

    def _count(self, specs: Sequence[Spec]) -> None:
        with self._lock:
            self.static_requested_bytes += sum(spec_bytes(s, d) for s, d in specs)
            self.static_tensors += len(specs)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Give back page-locking (after every asynchronous copy has finished)."""


class ArenaAllocator(HostAllocator):
    """Static plans are ``HostArena``s; each pool buffer is an exactly sized arena of its own,
    page-locked when it is made and unlocked when the pool gives it back."""

    mode = "arena"

    def __init__(
        self,
        backend: Backend,
        *,
        alignment: int = ALIGNMENT,
        block_bytes: int = BLOCK_BYTES,
    ):
        super().__init__(backend, alignment=alignment)
        self.block_bytes = block_bytes
        self.arenas: list[HostArena] = []
        self.buffers: dict[int, HostArena] = {}  # data_ptr of a pool buffer -> its arena

    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        arena = HostArena(self.backend, specs, alignment=self.alignment, block_bytes=self.block_bytes)
        with self._lock:
            self.arenas.append(arena)
        self._count(specs)
        return arena.tensors

    def buffer(self, nbytes: int) -> torch.Tensor:
        nbytes = align_up(nbytes, self.alignment)
        arena = HostArena(
            self.backend, [((nbytes,), torch.uint8)], alignment=self.alignment, block_bytes=nbytes
        )
        block = arena.blocks[0]
        with self._lock:
            self.buffers[block.data_ptr()] = arena
        return block

    def free_buffer(self, t: torch.Tensor) -> None:
        with self._lock:
            arena = self.buffers.pop(t.data_ptr(), None)
        if arena is not None:
            arena.close()

    def static_reserved_bytes(self) -> int:
        return sum(a.reserved_bytes for a in self.arenas)

    def dynamic_reserved_bytes(self) -> int:
        with self._lock:
            return sum(a.reserved_bytes for a in self.buffers.values())

    def dynamic_allocations(self) -> int:
        return len(self.buffers)

    def close(self) -> None:
        with self._lock:
            for arena in self.arenas:
                arena.close()
            for arena in self.buffers.values():
                arena.close()


class _PerTensorAllocator(HostAllocator):
    """One allocation per tensor and per pool buffer."""

    def __init__(self, backend: Backend, *, alignment: int = ALIGNMENT):
        super().__init__(backend, alignment=alignment)
        self.static: list[torch.Tensor] = []
        self.dynamic: dict[int, torch.Tensor] = {}  # data_ptr -> pool buffer

    def _make(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        out = [self._make(shape, dtype) for shape, dtype in specs]
        with self._lock:
            self.static.extend(out)
        self._count(specs)
        return out

    def buffer(self, nbytes: int) -> torch.Tensor:
        t = self._make((align_up(nbytes, self.alignment),), torch.uint8)
        with self._lock:
            self.dynamic[t.data_ptr()] = t
        return t

    def free_buffer(self, t: torch.Tensor) -> None:
        with self._lock:
            self.dynamic.pop(t.data_ptr(), None)

    def _reserved(self, ts: list[torch.Tensor]) -> int:
        return sum(tensor_bytes(t) for t in ts)

    def static_reserved_bytes(self) -> int:
        return self._reserved(self.static)

    def dynamic_reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved(list(self.dynamic.values()))

    def dynamic_allocations(self) -> int:
        return len(self.dynamic)


class PageableAllocator(_PerTensorAllocator):
    """Ordinary pageable tensors; the store keeps a frozen model tensor already in the run dtype as is."""

    mode = "pageable"
    keeps_model_tensors = True


class PinnedAllocator(_PerTensorAllocator):
    """One ``Backend.pin`` per tensor (PyTorch's caching host allocator on CUDA).

    Reserved bytes: where the backend has ``pinned_host_reserved_bytes()`` (the caching host
    allocator's real ``torch.cuda.host_memory_stats()`` figure, process-wide), the static figure is
    its growth across the static allocation; otherwise, and always for the pool (whose growth
    interleaves with other pinned allocations), the power-of-two model of it.
    """

    mode = "pinned"

    def __init__(self, backend: Backend, *, alignment: int = ALIGNMENT):
        super().__init__(backend, alignment=alignment)
        self._probe = getattr(backend, "pinned_host_reserved_bytes", None)
        self._measured_static: int | None = None
        self.reserved_source = "torch.cuda.host_memory_stats" if self._probe else "power-of-two model"

    def _make(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype)
        return t if t.numel() == 0 else self.backend.pin(t)

    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        before = self._probe() if self._probe else 0
        out = super().tensors(specs)
        if self._probe:
            self._measured_static = (self._measured_static or 0) + self._probe() - before
        return out

    def _reserved(self, ts: list[torch.Tensor]) -> int:
        return sum(pow2_ceil(tensor_bytes(t)) for t in ts)

    def modelled_static_reserved_bytes(self) -> int:
        return self._reserved(self.static)

    def static_reserved_bytes(self) -> int:
        if self._measured_static is not None:
            return self._measured_static
        return self.modelled_static_reserved_bytes()


def make_allocator(backend: Backend, mode: str = "arena", **options) -> HostAllocator:
    """The allocator of ``mode`` (one of ``HOST_MEMORY_MODES``); ``options``: ``alignment`` and,
    for ``"arena"``, ``block_bytes``."""
    if mode == "arena":
        return ArenaAllocator(backend, **options)
    options.pop("block_bytes", None)
    if mode == "pinned":
        return PinnedAllocator(backend, **options)
    if mode == "pageable":
        return PageableAllocator(backend, **options)
    raise ConfigError(f"unknown host_memory {mode!r}; choose one of {', '.join(HOST_MEMORY_MODES)}")


class _Buffer:
    """One pool buffer: its bytes, its size class, and who uses it now."""

    __slots__ = ("tensor", "size", "key", "nbytes", "event", "accesses", "used")

    def __init__(self, tensor: torch.Tensor, size: int):
        self.tensor, self.size = tensor, size
        self.key = tensor.untyped_storage().data_ptr()  # what the tensors carved from it share
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
        self.peak_held_bytes = 0  # the most ever held by owners
        self.reserved_bytes = 0  # the sizes of every buffer that exists
        self.peak_reserved_bytes = 0

    # ------------------------------------------------------------------ acquire
    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` and ``dtype`` that only the caller holds."""
        shape = tuple(shape)
        n = spec_bytes(shape, dtype)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        size = size_class(n, self.allocator.alignment)
        with self._lock:
            if self._closed:
                raise RuntimeError("HostBufferPool.acquire after close()")
            self._collect()
            buf = self._take(size)
            if buf is None:
                evicted = self._make_room(size, n)
                self.reserved_bytes += size  # booked now; made below, outside the lock
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
                raise
            buf = _Buffer(tensor, size)
            with self._lock:
                self.records[buf.key] = buf
                self.buffers += 1
                self._hand_out(buf, n)
        return carve(buf.tensor, 0, shape, dtype)

    def _hand_out(self, buf: _Buffer, n: int) -> None:
        self._tick += 1
        buf.nbytes, buf.used, buf.accesses = n, self._tick, []
        self._live[buf.key] = buf
        self.acquires += 1
        self.in_use_bytes += n
        self.peak_held_bytes = max(self.peak_held_bytes, self.in_use_bytes)
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes + self.pending_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

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

    def _make_room(self, size: int, n: int) -> list[_Buffer]:
        """Take out the least recently used free buffers until a new one of ``size`` keeps the pool
        within its headroom; returns them (freed outside the lock)."""
        peak = max(self.peak_in_use_bytes, self.in_use_bytes + self.pending_bytes + n)
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
            buf = self._live.get(t.untyped_storage().data_ptr())
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
            evicted = self._make_room(0, 0)
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
            self.in_use_bytes = self.pending_bytes = 0


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


class HostMemory:
    """The host memory of one run: static tensors (``allocate``) and the hand-off ``pool``.

    ``stats()`` -> ``{"mode", "requested_bytes", "reserved_bytes", "static_*", "pool_*",
    "reserved_source"}``; requested = the tensors' bytes (for the pool: its peak in use), reserved =
    the allocations made (see the allocator of each mode).
    """

    def __init__(self, backend: Backend, mode: str = "arena", **options):
        self.allocator = make_allocator(backend, mode, **options)
        self.pool = HostBufferPool(self.allocator)
        self._closed = False

    @property
    def mode(self) -> str:
        return self.allocator.mode

    @property
    def keeps_model_tensors(self) -> bool:
        return self.allocator.keeps_model_tensors

    def allocate(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        """Fresh, uninitialised host tensors for a whole plan of ``(shape, dtype)`` (allocated at once)."""
        return self.allocator.tensors(specs)

    def stats(self) -> dict:
        a, p = self.allocator, self.pool
        static_req, static_res = a.static_requested_bytes, a.static_reserved_bytes()
        pool_req, pool_res = p.peak_held_bytes, a.dynamic_reserved_bytes()
        return {
            "mode": a.mode,
            "requested_bytes": static_req + pool_req,
            "reserved_bytes": static_res + pool_res,
            "static_tensors": a.static_tensors,
            "static_requested_bytes": static_req,
            "static_reserved_bytes": static_res,
            "pool_requested_bytes": pool_req,  # peak bytes held by acquired buffers
            "pool_in_use_bytes": p.in_use_bytes,  # held by owners now
            "pool_pending_bytes": p.pending_bytes,  # given back, a copy may still use them
            "pool_peak_in_use_bytes": p.peak_in_use_bytes,  # peak of held + pending
            "pool_reserved_bytes": pool_res,
            "pool_peak_reserved_bytes": p.peak_reserved_bytes,
            "pool_allocations": a.dynamic_allocations(),
            "pool_buffers": p.buffers,
            "pool_freed": p.freed,
            "pool_acquires": p.acquires,
            "pool_reuses": p.reuses,
            "reserved_source": a.reserved_source,
        }

    def close(self) -> None:
        """Release the pool and unregister everything (after all asynchronous copies have finished).
        Tensors still referenced stay valid as pageable memory."""
        if self._closed:
            return
        self._closed = True
        self.pool.close()
        self.allocator.close()
