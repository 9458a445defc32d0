"""Host memory for the model state and the hand-offs, without the pinned allocator's rounding.

PyTorch's CUDA caching host allocator (what ``Tensor.pin_memory()`` and ``pin_memory=True`` use)
rounds every block up to the next power of two, so pinning tensor by tensor can reserve up to
twice the bytes asked for (pytorch issue #150517). Here host memory comes instead from a few large
plain allocations, page-locked in place with ``Backend.register_host`` (``cudaHostRegister`` on
CUDA, exact size) and carved into tensors.

Three modes (``RunConfig.host_memory``): ``"arena"``, ``"pinned"`` and ``"pageable"``, one allocator
class each (``host_allocators.py``).

``HostMemory`` bundles the allocator of a mode with a ``HostBufferPool`` (dynamic buffers for the
hand-offs) and reports both in ``stats()``. No CUDA call is made here: page-locking goes through the
backend's hooks.

The parts: ``host_arena.py`` (the arena and its layout rules), ``host_allocators.py`` (one allocator
per mode) and ``host_buffer_pool.py`` (the pool of page-locked buffers for the hand-offs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roundpipe.backend.base import Backend
from roundpipe.backend.host_allocators import make_allocator
from roundpipe.backend.host_arena import Spec
from roundpipe.backend.host_buffer_pool import HostBufferPool


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
            "pool_peak_in_use_buffer_bytes": p.peak_in_use_buffer_bytes,  # their buffers' sizes
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
