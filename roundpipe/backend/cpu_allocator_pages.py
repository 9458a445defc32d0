"""Which pages of an expandable segment have no memory behind them (the caching-allocator model).

With ``expandable_segments:True`` a pool is one address range that CUDA backs with physical pages
as it grows. Its retry path (and ``empty_cache``) gives back the pages of every free block, the
ones between allocated blocks included, not only a free tail: the range keeps its addresses, the
pages go back to the device, and a later block placed over them maps them again. So a pool full of
free holes between a few live blocks does not run the device out of memory when the holes' pages
are given back, as a pool of fixed segments would.

:class:`UnmappedPages` is the set of unmapped page ranges of one segment, as sorted, disjoint,
page-aligned ``[start, end)`` byte offsets. ``reserved`` bytes of the segment are its size less the
unmapped ones.
"""

from __future__ import annotations

import bisect


class UnmappedPages:
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    @property
    def total(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def within(self, start: int, end: int) -> int:
        """Unmapped bytes in ``[start, end)``."""
        n = 0
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._starts) and self._starts[i] < end:
            n += max(0, min(end, self._ends[i]) - max(start, self._starts[i]))
            i += 1
        return n

    def map(self, start: int, end: int) -> int:
        """Back ``[start, end)`` with memory again; returns the bytes newly mapped."""
        n = self.within(start, end)
        if not n:
            return 0
        starts, ends = [], []
        for s, e in zip(self._starts, self._ends):
            if e <= start or s >= end:
                starts.append(s)
                ends.append(e)
                continue
            if s < start:
                starts.append(s)
                ends.append(start)
            if e > end:
                starts.append(end)
                ends.append(e)
        self._starts, self._ends = starts, ends
        return n

    def unmap(self, start: int, end: int) -> int:
        """Give back the pages of ``[start, end)``; returns the bytes newly unmapped."""
        if end <= start:
            return 0
        n = (end - start) - self.within(start, end)
        if not n:
            return 0
        starts, ends = [], []
        for s, e in zip(self._starts, self._ends):
            if e < start or s > end:
                starts.append(s)
                ends.append(e)
            else:  # overlapping or touching: merge into the new range
                start, end = min(start, s), max(end, e)
        i = bisect.bisect_left(starts, start)
        starts.insert(i, start)
        ends.insert(i, end)
        self._starts, self._ends = starts, ends
        return n

    def truncate(self, size: int) -> int:
        """The segment ends at ``size`` now: forget the ranges past it; returns their bytes."""
        n = self.within(size, max([size, *self._ends]))
        self.map(size, max([size, *self._ends]))
        return n


def page_interior(offset: int, size: int, page: int) -> tuple[int, int]:
    """The whole pages inside ``[offset, offset + size)`` (an empty range when there are none)."""
    start = -(-offset // page) * page
    end = (offset + size) // page * page
    return start, max(start, end)


def page_cover(offset: int, size: int, page: int) -> tuple[int, int]:
    """The pages that ``[offset, offset + size)`` touches."""
    return offset // page * page, -(-(offset + size) // page) * page
