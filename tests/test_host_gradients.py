"""The host's fp32 gradient buffers (``runtime/store.py`` ``Entry``): the first gradient of a step
is copied in, a spent one is not zeroed after the update but reads as zero, and pieces (a
download's row chunks, a vocabulary shard's rows) land in their rows."""

from __future__ import annotations

import torch

from roundpipe.backend.virtual import HostWork
from roundpipe.presets import load_hardware
from roundpipe.runtime.store import Entry

torch.set_num_threads(1)


def _entry(rows: int = 4, cols: int = 3, device: str = "cpu") -> Entry:
    t = torch.zeros(rows, cols, device=device)
    return Entry(0, "w", t, True, False, [t], grad_buffer=torch.zeros(rows, cols, device=device))


def test_a_spent_gradient_reads_as_zero_and_the_next_is_copied_in():
    e = _entry()
    g1, g2, g3 = (torch.randn(4, 3) for _ in range(3))
    e.add_grads([(None, g1)])
    e.add_grads([(None, g2)])
    assert e.has_grad and torch.equal(e.grad, g1 + g2)
    e.discard_grad()  # after the update: nothing is written ...
    assert torch.equal(e.grad_buffer, g1 + g2)
    assert not e.has_grad and torch.equal(e.grad, torch.zeros(4, 3))  # ... yet it reads as zero
    e.discard_grad()
    e.add_grads([((0, 1), g3[:1]), ((1, 4), g3[1:])])  # a whole gradient in chunks: copied
    assert torch.equal(e.grad, g3)


def test_a_shards_rows_after_the_update_leave_the_others_zero():
    e = _entry()
    e.add_grads([(None, torch.randn(4, 3))])
    e.discard_grad()
    piece = torch.randn(2, 3)
    e.add_grads([((1, 3), piece)])  # one vocabulary shard's rows: the rest of the buffer is zero
    want = torch.zeros(4, 3)
    want[1:3] = piece
    assert torch.equal(e.grad, want)
    other = torch.randn(1, 3)
    e.add_grads([((3, 4), other)])  # another shard's, added
    want[3:] = other
    assert torch.equal(e.grad, want)


def test_a_steps_first_gradient_moves_eight_bytes_a_value_and_no_pass_zeroes_it():
    """Priced as the virtual server prices host work: copying the first download reads it and
    writes the buffer (8 bytes per fp32 value), adding a second reads both (12), discarding
    moves nothing."""
    e = _entry(1024, 256, device="meta")
    n = 1024 * 256
    moved = []
    for _ in range(2):
        with HostWork(load_hardware("rtx4090")) as work:
            e.add_grads(
                [
                    ((0, 512), torch.empty(512, 256, device="meta")),
                    ((512, 1024), torch.empty(512, 256, device="meta")),
                ]
            )
            e.add_grads([(None, torch.empty(1024, 256, device="meta"))])
            e.discard_grad()
        moved.append(work.moved_bytes)
    assert moved == [(8 + 12) * n] * 2
