"""The wrap-time probe both proofs run: two sequences of eight tokens, one left-padded, some
labels -100; and the round-off rule they compare by."""

from __future__ import annotations

import math

import torch
from torch import nn

PROBE_TOKENS = 8
PAD = 2  # left padding of the first probe sequence


def same_within(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(whether ``a`` matches ``b`` beyond round-off of ``dtype``, max abs difference, tolerance):
    the tolerance scales with ``b``'s magnitude and the dtype's epsilon."""
    if a.shape != b.shape:
        return False, math.inf, 0.0
    a, b = a.double(), b.double()
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    tol = 64 * eps * (float(b.abs().max()) + 1.0)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff <= tol, diff, tol


def probe_batch(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, max(2, vocab - 1), (2, PROBE_TOKENS), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    labels = ids.clone()
    labels[0, :PAD] = -100
    labels[1, 3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def param_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
