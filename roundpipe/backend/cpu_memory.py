"""What the cpu backend reports of memory: device memory as CUDA's caching allocator would report
it (``AllocatorMemory``), and the host bytes it has handed out as page-locked (``PINNED``)."""

from __future__ import annotations

import threading
import weakref

import torch

from roundpipe.backend.base import DeviceMemory
from roundpipe.backend.cpu_allocator import CachingAllocator


class PinnedBytes:
    """Host bytes the cpu backend has handed out as page-locked (what CUDA would pin: ``pin``, a
    download buffer, a ``register_host``-ed block) that are still alive, process-wide.

    Measured, not kept by hand: a pinned tensor counts until it is garbage (a weak reference's
    finalizer), a registered block until ``unregister_host``. ``alive`` after every pipeline is
    closed is what a leak would leave (``tests/test_faults.py``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._tracked = 0
        self._registered: dict[int, int] = {}  # data_ptr -> bytes

    @property
    def alive(self) -> int:
        with self._lock:
            return self._tracked + sum(self._registered.values())

    def track(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        with self._lock:
            self._tracked += n
        weakref.finalize(t, self._untrack, n)

    def _untrack(self, n: int) -> None:
        with self._lock:
            self._tracked -= n

    def register(self, t: torch.Tensor) -> None:
        with self._lock:
            self._registered[t.data_ptr()] = t.numel() * t.element_size()

    def unregister(self, t: torch.Tensor) -> None:
        with self._lock:
            self._registered.pop(t.data_ptr(), None)


PINNED = PinnedBytes()


class AllocatorMemory(DeviceMemory):
    """A virtual device's memory as CUDA reports it: allocated (``in_use``, ``peak``) and reserved
    bytes of its caching allocator (``cpu_allocator.py``)."""

    measured = True

    def __init__(self, allocator: CachingAllocator):
        self.allocator = allocator

    @property
    def capacity(self) -> int | None:
        return self.allocator.capacity

    @property
    def in_use(self) -> int:
        return self.allocator.allocated

    @property
    def peak(self) -> int:
        return self.allocator.peak_allocated

    @property
    def reserved(self) -> int:
        return self.allocator.reserved

    @property
    def reserved_peak(self) -> int:
        return self.allocator.peak_reserved

    def stats(self) -> dict:
        return self.allocator.stats()

    def reset_peak(self) -> None:
        self.allocator.reset_peaks()
