"""Host tensors carved from a few large page-locked allocations: the arena and its layout rules.

PyTorch's CUDA caching host allocator (what ``Tensor.pin_memory()`` and ``pin_memory=True`` use)
rounds every block up to the next power of two, so pinning tensor by tensor can reserve up to
twice the bytes asked for (pytorch issue #150517). Here host memory comes instead from a few large
plain allocations, page-locked in place with ``Backend.register_host`` (``cudaHostRegister`` on
CUDA, exact size) and carved into tensors. No CUDA call is made here: page-locking goes through the
backend's hooks.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from roundpipe.backend.base import Backend, tensor_bytes

ALIGNMENT = 64  # bytes; every carved tensor starts on a cache line (and any dtype's element size)
BLOCK_BYTES = 4 << 30  # at most this much per static arena block (unless one tensor is larger)

Spec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a tensor to allocate


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def spec_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def carve(block: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that lives at byte ``offset`` of a uint8 ``block``."""
    n = spec_bytes(shape, dtype)
    return block[offset : offset + n].view(dtype).view(tuple(shape))


def check_alignment(alignment: int) -> None:
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
        check_alignment(alignment)
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
            torch.empty(tuple(shape), dtype=dtype, device=backend.host_device)
            if p is None
            else carve(blocks[p[0]], p[1], shape, dtype)
            for (shape, dtype), p in zip(specs, places)
        ]

    def _new_block(self, backend: Backend, size: int) -> torch.Tensor:
        # The CPU allocator aligns to 64 bytes; a larger alignment over-allocates and shifts.
        extra = max(0, self.alignment - 64)
        raw = torch.empty(size + extra, dtype=torch.uint8, device=backend.host_device)
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
