"""Where host memory comes from: three modes (``RunConfig.host_memory``), one allocator class each.

- ``"arena"``: static tensors (the parameter store's compute copies) are planned first and carved
  from one exactly-sized block (one per ``block_bytes``); each pool buffer is an exactly sized
  block of its own. Reserved = the sizes of those blocks.
- ``"pinned"``: one ``Backend.pin`` per tensor (the behaviour before arenas). Reserved is what the
  CUDA caching host allocator reserves: the real figure where the backend can report it (an optional
  ``pinned_host_reserved_bytes()`` method), else the model of it: each request rounded up to a power
  of two.
- ``"pageable"``: nothing is pinned (asynchronous copies are staged by the driver); reserved =
  requested.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from roundpipe.backend.base import Backend, storage_key, tensor_bytes
from roundpipe.backend.host_arena import (
    ALIGNMENT,
    BLOCK_BYTES,
    HostArena,
    Spec,
    align_up,
    check_alignment,
    spec_bytes,
)
from roundpipe.errors import ConfigError

HOST_MEMORY_MODES = ("arena", "pinned", "pageable")


def pow2_ceil(nbytes: int) -> int:
    """What the CUDA caching host allocator reserves for a request of ``nbytes``."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


class HostAllocator(ABC):
    """Where one mode's host memory comes from: ``tensors`` for a static plan (all at once) and
    ``buffer`` for one raw pool buffer. Keeps what it allocated, and reports reserved bytes from it."""

    mode: str
    keeps_model_tensors = False  # the store may use a model's own CPU tensor as is (no copy)
    reserved_source = "allocations"

    def __init__(self, backend: Backend, *, alignment: int = ALIGNMENT):
        check_alignment(alignment)
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
            self.buffers[storage_key(block)] = arena
        return block

    def free_buffer(self, t: torch.Tensor) -> None:
        with self._lock:
            arena = self.buffers.pop(storage_key(t), None)
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
        return torch.empty(tuple(shape), dtype=dtype, device=self.backend.host_device)

    def tensors(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        out = [self._make(shape, dtype) for shape, dtype in specs]
        with self._lock:
            self.static.extend(out)
        self._count(specs)
        return out

    def buffer(self, nbytes: int) -> torch.Tensor:
        t = self._make((align_up(nbytes, self.alignment),), torch.uint8)
        with self._lock:
            self.dynamic[storage_key(t)] = t
        return t

    def free_buffer(self, t: torch.Tensor) -> None:
        with self._lock:
            self.dynamic.pop(storage_key(t), None)

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
        t = torch.empty(tuple(shape), dtype=dtype, device=self.backend.host_device)
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
