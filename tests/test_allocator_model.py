"""The caching-allocator model (roundpipe/backend/cpu_allocator.py) on its own: what a request gets."""

from __future__ import annotations

import pytest
import torch

from roundpipe.backend.cpu import CpuBackend
from roundpipe.backend.cpu_allocator import CUDA_RULES, AllocatorOutOfMemory

torch.set_num_threads(1)
MIB = 1 << 20


@pytest.fixture
def pool():
    backend = CpuBackend(1, 150 * MIB, sanitize=False, rules=CUDA_RULES)
    dev = backend.devices[0]
    yield dev.allocator, dev.streams["compute"]
    backend.close()


def test_a_request_that_needs_the_retry_path_gets_its_whole_size_or_runs_out(pool):
    # An expandable pool whose free tail the retry path shrinks: the growth measured before the
    # retry no longer reaches the request's end. The model once handed out a block of 110 MiB for a
    # request of 140 MiB (and the tensor on it failed with "Trying to resize storage that is not
    # resizable"); it must hand out 140 MiB or raise the out-of-memory error.
    alloc, stream = pool
    kept = alloc.malloc(30 * MIB, stream, "kept", (30 * MIB,), torch.uint8)
    tail = alloc.malloc(50 * MIB, stream, "tail", (50 * MIB,), torch.uint8)
    alloc.free(tail)
    try:
        block = alloc.malloc(140 * MIB, stream, "big", (140 * MIB,), torch.uint8)
    except AllocatorOutOfMemory:
        assert alloc.reserved <= 150 * MIB
    else:
        assert block.size >= 140 * MIB
        assert alloc.reserved <= 150 * MIB
    assert kept.allocated


def test_the_retry_path_gives_back_the_pages_of_free_holes_between_live_blocks(pool):
    # CUDA's expandable segments unmap the pages of every free block on the retry path, not only a
    # free tail: a pool with a 60 MiB hole between two live blocks then still has room for 80 MiB
    # on a 150 MiB device. The model once gave back only the tail and ran out ("tried to allocate
    # 83,886,080 bytes for 'big' (reserving 83,886,080 more); 157,286,400 bytes in total,
    # 125,829,120 reserved, 62,914,560 allocated").
    alloc, stream = pool
    a = alloc.malloc(40 * MIB, stream, "a", (40 * MIB,), torch.uint8)
    hole = alloc.malloc(60 * MIB, stream, "hole", (60 * MIB,), torch.uint8)
    c = alloc.malloc(20 * MIB, stream, "c", (20 * MIB,), torch.uint8)
    alloc.free(hole)
    big = alloc.malloc(80 * MIB, stream, "big", (80 * MIB,), torch.uint8)
    assert alloc.reserved == 140 * MIB  # 40 + 20 + 80: the hole's pages were given back
    assert alloc.num_alloc_retries == 1
    # The hole's addresses are the pool's still: a block placed there maps its pages again, which
    # the device has no room for now (140 MiB held of 150).
    with pytest.raises(AllocatorOutOfMemory):
        alloc.malloc(50 * MIB, stream, "into the hole", (50 * MIB,), torch.uint8)
    alloc.free(big)
    again = alloc.malloc(50 * MIB, stream, "into the hole", (50 * MIB,), torch.uint8)
    assert again.offset == 40 * MIB and again.size == 50 * MIB
    assert alloc.reserved <= 150 * MIB
    assert a.allocated and c.allocated
