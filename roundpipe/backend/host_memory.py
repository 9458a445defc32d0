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
"""

from __future__ import annotations

import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from roundpipe.backend.base import Backend, Event, tensor_bytes
from roundpipe.errors import ConfigError

HOST_MEMORY_MODES = ("arena", "pinned", "pageable")
ALIGNMENT = 64  # bytes; every carved tensor starts on a cache line (and any dtype's element size)
BLOCK_BYTES = 4 << 30  # at most this much per static arena block (unless one tensor is larger)
CHUNK_BYTES = 64 << 20  # the pool grows by chunks of at least this much

Spec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a tensor to allocate


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def pow2_ceil(nbytes: int) -> int:
    """What the CUDA caching host allocator reserves for a request of ``nbytes``."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


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
        """A fresh uint8 host buffer of ``nbytes`` (a multiple of the alignment), aligned."""

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
    """Static plans are ``HostArena``s; pool buffers are carved from chunk arenas of at least
    ``chunk_bytes`` (first fit over the chunks, never freed before ``close``)."""

    mode = "arena"

    def __init__(
        self,
        backend: Backend,
        *,
        alignment: int = ALIGNMENT,
        block_bytes: int = BLOCK_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        super().__init__(backend, alignment=alignment)
        self.block_bytes = block_bytes
        self.chunk_bytes = chunk_bytes
        self.arenas: list[HostArena] = []
        self.chunks: list[list] = []  # [arena, block, used bytes]

    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        arena = HostArena(self.backend, specs, alignment=self.alignment, block_bytes=self.block_bytes)
        with self._lock:
            self.arenas.append(arena)
        self._count(specs)
        return arena.tensors

    def buffer(self, nbytes: int) -> torch.Tensor:
        nbytes = align_up(nbytes, self.alignment)
        with self._lock:
            for chunk in self.chunks:
                arena, block, used = chunk
                if used + nbytes <= block.numel():
                    chunk[2] = used + nbytes
                    return block[used : used + nbytes]
            size = max(self.chunk_bytes, nbytes)
            arena = HostArena(
                self.backend, [((size,), torch.uint8)], alignment=self.alignment, block_bytes=size
            )
            block = arena.blocks[0]
            self.chunks.append([arena, block, nbytes])
            return block[:nbytes]

    def static_reserved_bytes(self) -> int:
        return sum(a.reserved_bytes for a in self.arenas)

    def dynamic_reserved_bytes(self) -> int:
        return sum(c[0].reserved_bytes for c in self.chunks)

    def dynamic_allocations(self) -> int:
        return len(self.chunks)

    def close(self) -> None:
        with self._lock:
            for arena in self.arenas:
                arena.close()
            for chunk in self.chunks:
                chunk[0].close()


class _PerTensorAllocator(HostAllocator):
    """One allocation per tensor and per pool buffer."""

    def __init__(self, backend: Backend, *, alignment: int = ALIGNMENT):
        super().__init__(backend, alignment=alignment)
        self.static: list[torch.Tensor] = []
        self.dynamic: list[torch.Tensor] = []

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
            self.dynamic.append(t)
        return t

    def _reserved(self, ts: list[torch.Tensor]) -> int:
        return sum(tensor_bytes(t) for t in ts)

    def static_reserved_bytes(self) -> int:
        return self._reserved(self.static)

    def dynamic_reserved_bytes(self) -> int:
        return self._reserved(self.dynamic)

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
    for ``"arena"``, ``block_bytes`` and ``chunk_bytes``."""
    if mode == "arena":
        return ArenaAllocator(backend, **options)
    options.pop("block_bytes", None)
    options.pop("chunk_bytes", None)
    if mode == "pinned":
        return PinnedAllocator(backend, **options)
    if mode == "pageable":
        return PageableAllocator(backend, **options)
    raise ConfigError(f"unknown host_memory {mode!r}; choose one of {', '.join(HOST_MEMORY_MODES)}")


class HostBufferPool:
    """Reusable host buffers for the hand-offs (downloaded activations and gradients, pinned inputs).

    ``acquire(shape, dtype)`` returns a tensor nobody else holds. ``release(t, event)`` gives it
    back; it is handed out again (to an acquire of the same byte size, rounded up to the alignment)
    only once ``event.query()`` is true -- pass the event recorded after the last asynchronous copy
    that reads or writes it (None: reusable at once). New buffers come from the allocator (carved
    from registered chunks in ``"arena"`` mode); nothing is freed before ``close()``. Thread-safe.
    """

    def __init__(self, allocator: HostAllocator):
        self.allocator = allocator
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, Event | None]]] = {}  # size -> (buffer, event)
        self._live: dict[int, tuple[torch.Tensor, int]] = {}  # data_ptr -> (buffer, bytes handed out)
        self._closed = False
        self.buffers = 0  # distinct buffers made
        self.acquires = 0
        self.reuses = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` and ``dtype`` that only the caller holds."""
        shape = tuple(shape)
        n = spec_bytes(shape, dtype)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        size = align_up(n, self.allocator.alignment)
        with self._lock:
            if self._closed:
                raise RuntimeError("HostBufferPool.acquire after close()")
            buf = self._take_ready(size)
            if buf is None:
                buf = self.allocator.buffer(size)
                self.buffers += 1
            else:
                self.reuses += 1
            self.acquires += 1
            self._live[buf.data_ptr()] = (buf, n)
            self.in_use_bytes += n
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return carve(buf, 0, shape, dtype)

    def _take_ready(self, size: int) -> torch.Tensor | None:
        waiting = self._free.get(size)
        if not waiting:
            return None
        for i, (buf, event) in enumerate(waiting):
            if event is None or event.query():
                del waiting[i]
                return buf
        return None

    def release(self, t: torch.Tensor, event: Event | None = None) -> None:
        """Give back a tensor from ``acquire`` (the whole tensor, once); reusable once ``event`` has
        happened."""
        n = tensor_bytes(t)
        if n == 0:
            return
        with self._lock:
            if self._closed:
                return
            rec = self._live.get(t.data_ptr())
            if rec is None or rec[1] != n:
                raise ValueError(
                    "release() of a tensor this pool did not hand out (or already released): pass the "
                    "tensor acquire() returned, once"
                )
            del self._live[t.data_ptr()]
            buf = rec[0]
            self.in_use_bytes -= n
            self._free.setdefault(buf.numel(), []).append((buf, event))

    def close(self) -> None:
        """Forget every buffer (the allocator gives back the memory)."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._live.clear()
            self.in_use_bytes = 0


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
        pool_req, pool_res = p.peak_in_use_bytes, a.dynamic_reserved_bytes()
        return {
            "mode": a.mode,
            "requested_bytes": static_req + pool_req,
            "reserved_bytes": static_res + pool_res,
            "static_tensors": a.static_tensors,
            "static_requested_bytes": static_req,
            "static_reserved_bytes": static_res,
            "pool_requested_bytes": pool_req,  # peak bytes held by acquired buffers
            "pool_in_use_bytes": p.in_use_bytes,
            "pool_reserved_bytes": pool_res,
            "pool_allocations": a.dynamic_allocations(),
            "pool_buffers": p.buffers,
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
