"""The CUDA caching allocator, modelled for the cpu backend's virtual devices (docs/design.md §5).

On CUDA, PyTorch's caching allocator decides what a device holds, not the tensors the program keeps:

- a request is rounded up (512 bytes) and served from a *segment* the allocator got from the driver:
  requests up to 1 MiB from 2 MiB segments (the small pool), larger ones from 20 MiB segments, or a
  segment of their own size rounded up to 2 MiB from 10 MiB on; a free block is split;
- pools are **per stream**: a block freed on the host goes back to the pool of the stream that
  allocated it, reusable by that stream's next allocation at once (its later kernels run after the
  earlier ones), never by another stream;
- a block that was ``record_stream``-ed to other streams (``Device.hand_over``) is reusable only once
  every one of those streams has passed the point where the block was freed (an event per stream);
- ``memory_reserved`` is the sum of the segments; ``memory_allocated`` the blocks handed out;
  *active* bytes add the freed blocks still waiting for their events;
- when no segment can be added within the device's memory, the allocator synchronizes the device
  (waits for every pending event: a host sync), gives back every segment nothing is allocated in,
  and retries (``num_alloc_retries``); failing again is an out-of-memory error.

:class:`CachingAllocator` does all of this with real host memory: a segment is one ``uint8`` host
allocation, kept while cached, so the cpu backend pays the kernel for fresh pages once per segment,
not once per buffer. A block becomes a tensor through a storage that does not own its bytes
(``torch._C._construct_storage_from_data_pointer``): when the program drops the last reference the
storage dies and the block is freed, at that moment (on CUDA's clock: when a closure is *issued*),
while kernels still queued on the streams read and write the same bytes through their own views of
the segment (``cpu_kernels.KernelRef``). Reuse is therefore real: a block reused while a stream that
was not ordered before the reuse may still use it is corrupted; the stream sanitizer names such a
block when it is freed (``Sanitizer.check_free``).

The rules are a dataclass (:class:`AllocatorRules`, CUDA's constants by default), so the virtual
server models a GPU's reserved bytes at full size and the cpu backend's tests see the same figures.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import threading
import weakref
from collections.abc import Callable

import torch

from roundpipe.backend.cpu_allocator_pages import UnmappedPages, page_cover, page_interior
from roundpipe.backend.cpu_allocator_rules import (  # noqa: F401 (re-exported: where they were)
    CUDA_RULES,
    REFERENCE_BYTES,
    UNBOUNDED_RANGE,
    AllocatorRules,
    capacity_for,
)

_CPU = torch.device("cpu")
_construct_storage = torch._C._construct_storage_from_data_pointer


class AllocatorOutOfMemory(torch.OutOfMemoryError):
    """The model's out-of-memory error (a ``torch.OutOfMemoryError``, as CUDA's is), with the request."""

    def __init__(self, message: str, nbytes: int, what: str):
        super().__init__(message)
        self.nbytes, self.what = nbytes, what


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's: no memory behind the range until touched
RANGE_PER_CAPACITY = 4
_NOBODY: frozenset = frozenset()  # the streams a fresh block was handed over to


class Segment:
    """One allocation from the device: ``memory`` (uint8, host bytes here) carved into blocks. An
    expandable segment's ``memory`` is a whole reserved address range of which the first ``size``
    bytes are in use (mapped); the rest is grown into (``mapping``: the ``mmap`` behind it)."""

    __slots__ = ("memory", "ptr", "size", "stream", "small", "head", "tail", "mapping", "unmapped", "_typed")

    def __init__(self, memory: torch.Tensor, size: int, stream, small: bool, mapping=None):
        self.memory = memory
        self.ptr = memory.data_ptr()
        self.size = size
        self.stream = stream
        self.small = small
        self.mapping = mapping
        self.unmapped = (
            UnmappedPages()
        )  # an expandable segment's free pages given back (cpu_allocator_pages.py)
        self.head: Block | None = None  # the first block; blocks link to their neighbours
        self.tail: Block | None = None  # the last block
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def blocks(self) -> list[Block]:
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The segment's bytes seen as ``dtype`` elements (what kernel views are cut from)."""
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self.memory.view(dtype)
        return t


class Block:
    """A run of a segment's bytes: free, allocated (a tensor's storage) or waiting for events.

    The sanitizer's facts about the tensor that holds it live here too (who made it, which streams it
    was handed over to, its last write and reads, whether the memory ledger reserves it).
    """

    __slots__ = ("segment", "offset", "size", "ptr", "allocated", "pending", "requested")
    __slots__ += ("what", "tag", "shape", "dtype", "handed", "write", "reads", "reserved", "generation")
    __slots__ += ("ref", "stream", "device", "serial", "prev", "next")

    def __init__(self, segment: Segment, offset: int, size: int):
        self.segment, self.offset, self.size = segment, offset, size
        self.ptr = segment.ptr + offset
        self.stream = segment.stream
        self.allocated = False
        self.prev: Block | None = None  # the neighbours in the segment
        self.next: Block | None = None
        self.pending: list = []  # events of the streams it was handed to, recorded when it was freed
        self.requested = 0
        self.serial = 0  # which tenant: bumped every time the block is handed out

    # ------------------------------------------------------------------ sanitizer view
    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        made = "" if self.tag == self.what else f" (made by {self.what!r})"
        return f"tensor {self.tag!r} {list(self.shape)} {dtype} of {self.device.name}{made}"

    @property
    def nbytes(self) -> int:
        return self.size

    @property
    def alive(self) -> bool:
        return self.allocated


class CachingAllocator:
    """One device's caching allocator (see the module docstring). Thread-safe.

    ``capacity``: the device's bytes (None: unbounded); ``registry``: where allocated blocks are
    found by their address (shared by a backend's devices); ``on_sync``: told of the host sync of the
    retry path; ``on_free``: shown each block as it is freed (the sanitizer's reuse rule).
    """

    def __init__(
        self,
        device,
        capacity: int | None,
        rules: AllocatorRules = CUDA_RULES,
        registry: dict | None = None,
        on_sync: Callable[[str], None] | None = None,
        on_free: Callable[[Block], None] | None = None,
    ):
        self.device = device
        self.capacity = capacity
        self.rules = rules
        self.registry = {} if registry is None else registry  # storage data ptr -> Block, process-wide
        self._on_sync = on_sync
        self._on_free = on_free
        self._serials = itertools.count(1)
        self._lock = threading.RLock()
        # Free blocks per pool (stream, small): the sorted distinct sizes, and the blocks of each size.
        self._sizes: dict[tuple, list[int]] = {}
        self._by_size: dict[tuple, dict[int, list[Block]]] = {}
        self._free_blocks: dict[int, Block] = {}  # ptr -> free block
        self._pending: list[Block] = []
        self.segments: list[Segment] = []
        self._expandable: dict[tuple, Segment] = {}  # (stream, small) -> the pool's one segment
        self.allocated = 0  # bytes of the blocks handed out (requests rounded up, as CUDA counts them)
        self.requested = 0  # bytes the tensors asked for
        self.peak_requested = 0
        self.reserved = 0
        self.active = 0  # allocated + freed blocks still waiting for their events
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_active = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.segment_allocations = 0

    # ------------------------------------------------------------------ allocation
    def malloc(self, nbytes: int, stream, what: str, shape, dtype: torch.dtype) -> Block:
        """A block of at least ``nbytes`` for ``stream``; raises ``torch.OutOfMemoryError`` as CUDA
        does when the device cannot hold another segment even after giving back the cached ones."""
        rules = self.rules
        size = rules.round(nbytes)
        small = rules.is_small(size)
        with self._lock:
            self._process_events()
            block = self._cached(stream, small, size)
            if block is None:
                block = self._new_segment(stream, small, size, what)
            self._take(block, size, small)
            block.requested = nbytes
            block.serial = next(self._serials)
            block.allocated = True
            block.pending = []
            block.what = block.tag = what
            block.shape, block.dtype = shape, dtype
            block.handed = _NOBODY
            block.write = (stream, stream.clock.get(stream, 0))
            block.reads = None
            block.reserved = False
            block.device = self.device
            self.allocated += block.size
            self.requested += nbytes
            self.active += block.size
            self.peak_allocated = max(self.peak_allocated, self.allocated)
            self.peak_requested = max(self.peak_requested, self.requested)
            self.peak_active = max(self.peak_active, self.active)
            self.registry[block.ptr] = block
        return block

    def _cached(self, stream, small: bool, size: int) -> Block | None:
        """A free block of the pool for ``size`` bytes, its given-back pages mapped again (running the
        retry path once if they do not fit), or None: the pool must grow."""
        for attempt in (0, 1):
            block = self._best_fit(stream, small, size)
            if block is None and self._coalesce(stream, small):
                block = self._best_fit(stream, small, size)
            if block is None:
                return None
            seg = block.segment
            start, end = page_cover(block.offset, size, self.rules.page(small))
            need = seg.unmapped.within(start, end)
            if not need or self.capacity is None or self.reserved + need <= self.capacity:
                self.reserved += seg.unmapped.map(start, end)
                self.peak_reserved = max(self.peak_reserved, self.reserved)
                return block
            self._insert_free(block)
            if attempt == 0:
                self.num_alloc_retries += 1
                self._release_cached(synchronize=True)
        return None

    def _best_fit(self, stream, small: bool, size: int) -> Block | None:
        """The smallest free block of the pool that holds ``size`` bytes, taken out of the pool."""
        pool = self._by_size.get((stream, small))
        if not pool:
            return None
        blocks = pool.get(size)
        if not blocks:
            sizes = self._sizes[(stream, small)]
            i = bisect.bisect_left(sizes, size)
            if i == len(sizes):
                return None
            blocks = pool[sizes[i]]
        block = blocks.pop()
        if not blocks:
            self._drop_size(stream, small, block.size)
        del self._free_blocks[block.ptr]
        return block

    def _drop_size(self, stream, small: bool, size: int) -> None:
        del self._by_size[(stream, small)][size]
        sizes = self._sizes[(stream, small)]
        del sizes[bisect.bisect_left(sizes, size)]

    def _room_for(self, grow: int, size: int, what: str) -> None:
        """Make ``grow`` more bytes reservable within the capacity (CUDA's retry path first), or
        raise the out-of-memory error."""
        if self.capacity is None or self.reserved + grow <= self.capacity:
            return
        self.num_alloc_retries += 1
        self._release_cached(synchronize=True)
        if self.reserved + grow > self.capacity:
            self.num_ooms += 1
            raise AllocatorOutOfMemory(
                f"{self.device.name}: tried to allocate {size:,} bytes for {what!r} (reserving "
                f"{grow:,} more); {self.capacity:,} bytes in total, {self.reserved:,} reserved, "
                f"{self.allocated:,} allocated",
                size,
                what,
            )

    def _grow(self, stream, small: bool, size: int, what: str) -> Block:
        """An expandable pool takes ``size`` bytes at its end: its free tail grows by whole pages."""
        seg = self._expandable.get((stream, small))
        if seg is None:
            seg = self._expandable[(stream, small)] = self._reserve_range(stream, small)
        retries = self.num_alloc_retries
        free_tail, grow = self._growth(seg, small, size)
        remap = seg.unmapped.within(free_tail.offset, seg.size) if free_tail else 0
        self._room_for(grow + remap, size, what)
        if self.num_alloc_retries != retries:  # the retry path shrank the free tail: measure again
            free_tail, grow = self._growth(seg, small, size)
            remap = seg.unmapped.within(free_tail.offset, seg.size) if free_tail else 0
            self._room_for(grow + remap, size, what)
        if free_tail is not None:
            self.reserved += seg.unmapped.map(free_tail.offset, seg.size)
        tail = seg.tail
        if seg.size + grow > seg.memory.numel():
            self.num_ooms += 1
            raise AllocatorOutOfMemory(
                f"{self.device.name}: the address range of a memory pool is used up ({seg.size:,} bytes) "
                f"placing {size:,} bytes for {what!r}",
                size,
                what,
            )
        if free_tail is not None:
            self._remove_free(free_tail)
            free_tail.size += grow
            block = free_tail
        else:
            block = Block(seg, seg.size, grow)
            block.prev = tail
            if tail is not None:
                tail.next = block
            else:
                seg.head = block
            seg.tail = block
        seg.size += grow
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_allocations += 1
        return block

    def _growth(self, seg: Segment, small: bool, size: int) -> tuple[Block | None, int]:
        """The pool's free tail (None when its last block is in use) and the whole pages it must
        grow by for ``size`` bytes at its end."""
        tail = seg.tail
        free_tail = tail if tail is not None and self._free_blocks.get(tail.ptr) is tail else None
        page = self.rules.page(small)
        return free_tail, -(-(size - (free_tail.size if free_tail else 0)) // page) * page

    def _reserve_range(self, stream, small: bool) -> Segment:
        """An address range for an expandable pool: ``RANGE_PER_CAPACITY`` times the device (or
        ``UNBOUNDED_RANGE``), reserved without memory behind it until pages are touched
        (``MAP_NORESERVE``). Larger than the device, because holes whose pages were given back keep
        their addresses (CUDA opens another range when one is used up)."""
        length = RANGE_PER_CAPACITY * self.capacity if self.capacity else UNBOUNDED_RANGE
        page = self.rules.page(small)
        length = -(-length // page) * page
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        memory = torch.frombuffer(mapping, dtype=torch.uint8)
        seg = Segment(memory, 0, stream, small, mapping)
        self.segments.append(seg)
        return seg

    def _new_segment(self, stream, small: bool, size: int, what: str) -> Block:
        if self.rules.expandable:
            return self._grow(stream, small, size, what)
        seg_size = self.rules.segment_size(size)
        self._room_for(seg_size, size, what)
        memory = torch.empty(seg_size, dtype=torch.uint8)
        segment = Segment(memory, seg_size, stream, small)
        block = Block(segment, 0, seg_size)
        segment.head = segment.tail = block
        self.segments.append(segment)
        self.reserved += seg_size
        self.segment_allocations += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _take(self, block: Block, size: int, small: bool) -> None:
        """Hand out the first ``size`` bytes of the free ``block``, splitting off the rest if the
        rules say so."""
        remaining = block.size - size
        if self.rules.splits(small, remaining):
            seg = block.segment
            rest = Block(seg, block.offset + size, remaining)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            else:
                seg.tail = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)

    def _insert_free(self, block: Block) -> None:
        seg = block.segment
        key = (seg.stream, seg.small)
        pool = self._by_size.get(key)
        if pool is None:
            pool = self._by_size[key] = {}
            self._sizes[key] = []
        blocks = pool.get(block.size)
        if blocks is None:
            pool[block.size] = [block]
            bisect.insort(self._sizes[key], block.size)
        else:
            blocks.append(block)
        self._free_blocks[block.ptr] = block

    def _remove_free(self, block: Block) -> None:
        seg = block.segment
        blocks = self._by_size[(seg.stream, seg.small)][block.size]
        blocks.remove(block)
        if not blocks:
            self._drop_size(seg.stream, seg.small, block.size)
        del self._free_blocks[block.ptr]

    # ------------------------------------------------------------------ the tensors
    def tensor(self, block: Block, shape, stride, dtype: torch.dtype) -> torch.Tensor:
        """The program's tensor on ``block``: its storage does not own the bytes, and its death frees
        the block (at that moment, on the thread that dropped the last reference)."""
        storage = _construct_storage(block.ptr, _CPU, block.size)
        block.ref = weakref.ref(storage, lambda _, b=block: self.free(b))
        return torch.empty((0,), dtype=dtype).set_(storage, 0, shape, stride)

    # ------------------------------------------------------------------ freeing
    def free(self, block: Block) -> None:
        """The block's tensor died (CUDA: ``free`` at issue time). Back to its stream's pool at once,
        or, if it was handed over to other streams, once each has passed this point."""
        with self._lock:
            if not block.allocated:
                return
            if self._on_free is not None:
                self._on_free(block)
            block.allocated = False
            if self.registry.get(block.ptr) is block:
                del self.registry[block.ptr]
            self.allocated -= block.size
            self.requested -= block.requested
            others = [s for s in block.handed if s is not block.stream]
            if others:
                block.pending = [s.record_event() for s in others]
                self._pending.append(block)
            else:
                self._release(block)

    def _release(self, block: Block) -> None:
        """A freed block becomes reusable. Free neighbours are merged lazily (``_coalesce``), before
        the pool would grow: CUDA merges at once, which hands out the same bytes to a request that
        fits the merged block and costs a merge on every free."""
        self.active -= block.size
        block.pending = []
        self._insert_free(block)

    def _coalesce(self, stream, small: bool) -> bool:
        """Merge the adjacent free blocks of one pool; True if any were merged."""
        free = self._free_blocks
        merged = False
        for seg in self.segments:
            if seg.stream is not stream or seg.small is not small:
                continue
            b = seg.head
            while b is not None:
                nxt = b.next
                if nxt is not None and free.get(b.ptr) is b and free.get(nxt.ptr) is nxt:
                    self._remove_free(b)
                    self._remove_free(nxt)
                    b.size += nxt.size
                    b.next = nxt.next
                    if nxt.next is not None:
                        nxt.next.prev = b
                    else:
                        seg.tail = b
                    self._insert_free(b)
                    merged = True
                    continue
                b = nxt
        return merged

    def _process_events(self) -> None:
        if not self._pending:
            return
        still = []
        for block in self._pending:
            if all(ev.query() for ev in block.pending):
                self._release(block)
            else:
                still.append(block)
        self._pending = still

    def _release_cached(self, synchronize: bool) -> None:
        """The retry path: wait for every pending block's events (a host sync), then give back every
        segment that holds no allocated or pending block."""
        if synchronize and self._pending:
            if self._on_sync is not None:
                self._on_sync("the caching allocator's retry (waits for every pending free)")
            for block in self._pending:
                for ev in block.pending:
                    ev.wait()
            self._process_events()
        for stream, small in list(self._by_size):
            self._coalesce(stream, small)
        for seg in self._expandable.values():
            self._shrink(seg)
            self._give_back_holes(seg)
        kept = []
        for seg in self.segments:
            head = seg.head
            if seg.mapping is not None:
                kept.append(seg)
            elif head.next is None and self._free_blocks.get(head.ptr) is head:
                self._remove_free(head)
                self.reserved -= seg.size
            else:
                kept.append(seg)
        self.segments = kept

    def _shrink(self, seg: Segment) -> None:
        """Give back the whole pages of an expandable pool's free tail (``madvise(DONTNEED)``: the
        bytes go back to the system, the range stays reserved)."""
        tail = seg.tail
        if tail is None or self._free_blocks.get(tail.ptr) is not tail:
            return
        page = self.rules.page(seg.small)
        keep = -(-tail.offset // page) * page  # the end of the last page still in use
        if keep >= seg.size:
            return
        self._remove_free(tail)
        start = -(-keep // mmap.PAGESIZE) * mmap.PAGESIZE  # the system's pages from there on
        if start < seg.size:
            seg.mapping.madvise(mmap.MADV_DONTNEED, start, seg.size - start)
        self.reserved -= seg.size - keep - seg.unmapped.truncate(keep)
        seg.size = keep
        if keep > tail.offset:
            tail.size = keep - tail.offset
            self._insert_free(tail)
        else:  # the tail block held only released pages
            seg.tail = tail.prev
            if tail.prev is not None:
                tail.prev.next = None
            else:
                seg.head = None

    def _give_back_holes(self, seg: Segment) -> None:
        """Give back the whole pages inside every free block of an expandable pool (CUDA unmaps
        them; the addresses stay the pool's)."""
        page = self.rules.page(seg.small)
        for b in seg.blocks():
            if self._free_blocks.get(b.ptr) is not b:
                continue
            start, end = page_interior(b.offset, b.size, page)
            n = seg.unmapped.unmap(start, end)
            if n:
                self.reserved -= n
                lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo and seg.mapping is not None:
                    seg.mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def empty_cache(self) -> None:
        """Give back every segment that holds nothing (``torch.cuda.empty_cache``)."""
        with self._lock:
            self._process_events()
            self._release_cached(synchronize=False)

    # ------------------------------------------------------------------ figures
    def live(self, generation: int | None = None) -> list[Block]:
        """Allocated blocks (of ``generation`` when given), largest first."""
        with self._lock:
            blocks = [b for s in self.segments for b in s.blocks() if b.allocated]
        if generation is not None:
            blocks = [b for b in blocks if b.generation == generation]
        return sorted(blocks, key=lambda b: -b.size)

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_allocated = self.allocated
            self.peak_requested = self.requested
            self.peak_reserved = self.reserved
            self.peak_active = self.active

    def stats(self) -> dict:
        """CUDA's figures (``torch.cuda.memory_stats`` names where there is one)."""
        with self._lock:
            return {
                "allocated_bytes": self.allocated,
                "allocated_bytes_peak": self.peak_allocated,
                "requested_bytes": self.requested,
                "requested_bytes_peak": self.peak_requested,
                "reserved_bytes": self.reserved,
                "reserved_bytes_peak": self.peak_reserved,
                "active_bytes": self.active,
                "active_bytes_peak": self.peak_active,
                "segments": len(self.segments),
                "segment_allocations": self.segment_allocations,
                "num_alloc_retries": self.num_alloc_retries,
                "num_ooms": self.num_ooms,
            }
