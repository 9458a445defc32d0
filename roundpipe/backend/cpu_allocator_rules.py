"""The caching allocator's size rules (``AllocatorRules``: CUDA's constants, or scaled down for a
small virtual device) and the device capacity a test sizes to a plan (``capacity_for``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AllocatorRules:
    """The caching allocator's size rules (``c10/cuda/CUDACachingAllocator.cpp``'s constants)."""

    min_block: int = 512  # every request is rounded up to a multiple of this
    small_request: int = 1 << 20  # requests up to this come from the small pool
    small_segment: int = 2 << 20  # the size of a small-pool segment
    large_segment: int = 20 << 20  # a large request below min_large_alloc gets a segment this size
    min_large_alloc: int = 10 << 20
    round_large: int = 2 << 20  # larger requests get a segment of their size rounded up to this
    # ``expandable_segments:True``: each pool is one segment that grows (and shrinks) by whole pages
    # of its segment size, so freed space anywhere in it serves any later request that fits; what
    # roundpipe sets on CUDA (``cuda.py``). False: a new segment per growth, as PyTorch's default.
    expandable: bool = True

    def round(self, nbytes: int) -> int:
        """The block size a request of ``nbytes`` gets."""
        m = self.min_block
        return m if nbytes < m else -(-nbytes // m) * m

    def is_small(self, size: int) -> bool:
        return size <= self.small_request

    def segment_size(self, size: int) -> int:
        """The segment the allocator asks the device for when no cached block fits ``size``."""
        if self.is_small(size):
            return self.small_segment
        if size < self.min_large_alloc:
            return self.large_segment
        r = self.round_large
        return -(-size // r) * r

    def splits(self, small: bool, remaining: int) -> bool:
        """A free block of which ``remaining`` bytes are left over is split (else handed out whole)."""
        return remaining >= self.min_block if small else remaining > self.small_request

    def page(self, small: bool) -> int:
        """How much an expandable pool grows by at a time."""
        return self.small_segment if small else self.large_segment

    def overhead(self, streams: int) -> int:
        """Reserved bytes a device can hold beyond what is allocated, from the segment rules alone: per
        allocating stream, a partly used small segment and a partly used large one (what a planner adds
        to a device's bytes so that the reserved peak stays within the plan)."""
        return streams * (self.small_segment + self.large_segment)

    @staticmethod
    def for_capacity(capacity: int | None) -> AllocatorRules:
        """The rules of a device of ``capacity`` bytes: CUDA's own for a GPU of ``REFERENCE_BYTES``
        (24 GiB) or more (and for an unbounded virtual device); for a smaller virtual device, CUDA's
        segment sizes scaled down with it (a small request at least one 512-byte block), so that a
        tiny test model on a device sized to it meets segments in proportion, not 2 MiB ones it can
        never fill."""
        if capacity is None or capacity >= REFERENCE_BYTES:
            return CUDA_RULES
        m = CUDA_RULES.min_block
        small = max(m, round(CUDA_RULES.small_request * capacity / REFERENCE_BYTES / m) * m)
        return AllocatorRules(m, small, 2 * small, 20 * small, 10 * small, 2 * small, CUDA_RULES.expandable)


def capacity_for(need: int, streams: int) -> int:
    """The smallest virtual device capacity whose free bytes (capacity less its allocator's slack for
    ``streams`` allocating streams) hold ``need`` bytes: what a test sizes a device to a plan with."""
    capacity = need
    for _ in range(8):  # the slack grows with the capacity; a few rounds settle it
        capacity = need + AllocatorRules.for_capacity(capacity).overhead(streams)
    return capacity


CUDA_RULES = AllocatorRules()
UNBOUNDED_RANGE = 256 << 30  # the address range of an expandable pool on a device without a capacity
REFERENCE_BYTES = 24 << 30  # CUDA's constants at full size from this device size on (an RTX 4090)
