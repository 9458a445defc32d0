"""Batch validation and the microbatch split: the first thing ``forward_backward`` does.

Runs on the caller's thread, before any worker starts, so a bad batch is reported as an
``InputError`` that says what to change and nothing has been issued to a device yet.

A batch arrives padded to its longest sample; each microbatch is then cut to its own longest one
(:func:`trailing_padding`), so a microbatch of short samples costs what its tokens cost. That is
exact: a causal model's position ``t`` reads only positions up to ``t``, so columns after the last
real token change no output, and those columns carry no token (``attention_mask`` 0, which also
keeps them out of a router's statistics) and no label (-100) in any row of the microbatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roundpipe.errors import InputError
from roundpipe.models.base import MicrobatchInputs, loss_positions


def split_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    *,
    vocab_size: int,
    microbatch_count: Callable[[int], int],
) -> tuple[list[MicrobatchInputs], int]:
    """Check a batch and cut it into microbatches by sample.

    Args:
        input_ids: integer token ids, ``[batch, seq]``.
        labels: targets of the same shape (``-100`` where there is none); shifted inside the loss.
        attention_mask: ``[batch, seq]`` or None.
        position_ids: ``[batch or 1, seq]`` or None.
        vocab_size: the model's vocabulary size; ids and labels must lie below it.
        microbatch_count: how many microbatches a batch of this many samples is cut into (called
            once the shapes are known to be right).

    Returns:
        The microbatches (contiguous CPU tensors, ``int64`` ids and labels, with the positions of
        their label tokens) and the number of label tokens of the **whole** batch: every
        microbatch's loss sum is divided by it, so the loss does not depend on the split.

    Raises:
        InputError: wrong types or shapes, ids or labels outside the vocabulary, more microbatches
            than samples, or no label token at all.
    """
    if (
        not torch.is_tensor(input_ids)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.int64, torch.int32)
    ):
        raise InputError(
            f"input_ids must be an integer tensor of shape [batch, seq], got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)} {getattr(input_ids, 'dtype', '')}"
        )
    batch, seq = input_ids.shape
    if batch == 0 or seq == 0:
        raise InputError(
            f"input_ids is empty (shape {tuple(input_ids.shape)}): a batch needs at least one sample "
            "of at least two tokens"
        )
    if labels is None:
        raise InputError("labels are required for training (use -100 for positions without a target)")
    for name, t in (("labels", labels), ("attention_mask", attention_mask)):
        if t is not None and (not torch.is_tensor(t) or tuple(t.shape) != (batch, seq)):
            raise InputError(
                f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(getattr(t, 'shape', ()))}"
            )
    if position_ids is not None and (
        not torch.is_tensor(position_ids)
        or position_ids.dim() != 2
        or position_ids.shape[1] != seq
        or position_ids.shape[0] not in (1, batch)
    ):
        raise InputError(
            f"position_ids must be a tensor of shape [batch or 1, {seq}], got "
            f"{tuple(getattr(position_ids, 'shape', ())) or type(position_ids).__name__}"
        )
    for name, t in (
        ("input_ids", input_ids),
        ("labels", labels),
        ("attention_mask", attention_mask),
        ("position_ids", position_ids),
    ):
        if t is not None and t.is_meta:
            raise InputError(f"{name} is a meta tensor, which holds no values: pass a tensor with data")
    m = microbatch_count(batch)
    if m > batch:
        raise InputError(
            f"num_microbatches={m} is larger than the batch ({batch} samples); "
            "use a larger batch or fewer microbatches"
        )
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise InputError(f"input_ids must lie in [0, {vocab_size}) (the model's vocab_size)")
    labels = labels.long()
    total = int((labels[:, 1:] != -100).sum())
    if total == 0:
        raise InputError(
            "every label is -100 (after the shift), so there is nothing to learn from this batch"
        )
    bad = labels[(labels != -100)]
    if bad.numel() and (int(bad.min()) < 0 or int(bad.max()) >= vocab_size):
        raise InputError(f"labels must be -100 or lie in [0, {vocab_size})")
    input_ids = input_ids.long()
    out = []
    for idx in torch.arange(batch).tensor_split(m):
        sl = slice(int(idx[0]), int(idx[-1]) + 1)
        mask = None if attention_mask is None else attention_mask[sl]
        cols = slice(0, seq - trailing_padding(mask, labels[sl]))
        pos = None
        if position_ids is not None:
            pos = (position_ids if position_ids.shape[0] == 1 else position_ids[sl])[:, cols]
        mb_labels = labels[sl, cols].contiguous()
        out.append(
            MicrobatchInputs(
                input_ids[sl, cols].contiguous(),
                None if mask is None else mask[:, cols].contiguous(),
                None if pos is None else pos.long().contiguous(),
                mb_labels,
                loss_positions(mb_labels),
            )
        )
    return out, total


def trailing_padding(attention_mask: torch.Tensor | None, labels: torch.Tensor) -> int:
    """How many columns at the end of a microbatch hold padding only: ``attention_mask`` 0 and
    label -100 in every row (0 without a mask: then every column is a token). At least one column
    is kept, so a microbatch of padding alone keeps its shape valid."""
    if attention_mask is None:
        return 0
    used = ((attention_mask != 0) | (labels != -100)).any(dim=0)
    last = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
    return int(labels.shape[1]) - last


def mean_tokens(microbatches: list[MicrobatchInputs]) -> float:
    """Tokens per microbatch as the workers ran them: each microbatch is cut to its own longest
    sample (``split_batch``), so this is what the measured layer times belong to."""
    return sum(mb.input_ids.numel() for mb in microbatches) / len(microbatches)
