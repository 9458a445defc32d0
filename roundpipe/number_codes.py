"""The value tables of 4- and 8-bit codes, and the blockwise coding both compressed weights
(``runtime/quantized.py``) and low-precision optimizer moments (``optim/low_precision_state.py``)
use: one definition of NF4, of bitsandbytes' dynamic maps, of nearest-code search.
"""

from __future__ import annotations

from functools import cache

import torch

# The 16 values of 4-bit NormalFloat (QLoRA, Dettmers et al. 2023, appendix E), sorted.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@cache
def dynamic_values(signed: bool = True) -> tuple[float, ...]:
    """bitsandbytes' 8-bit dynamic map (``create_dynamic_map(signed)``; Dettmers 2015): for each of
    7 decades ``10**(j - 6)``, the midpoints of ``2**j + 1`` (unsigned: ``2**(j+1) + 1``) evenly
    spaced points in [0.1, 1] scaled by it, with both signs when signed; then 0 and 1; sorted.
    Computed in fp32, as bitsandbytes does."""
    values: list[float] = []
    for j in range(7):
        points = torch.linspace(0.1, 1, 2 ** (j if signed else j + 1) + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        values += ((10 ** (j - 6)) * mids).tolist()
        if signed:
            values += (-(10 ** (j - 6)) * mids).tolist()
    values += [0.0, 1.0]
    return tuple(sorted(values))


@cache
def dynamic_map(signed: bool = True) -> torch.Tensor:
    """:func:`dynamic_values` as an fp32 CPU tensor (made once; read, never written)."""
    return torch.tensor(dynamic_values(signed), dtype=torch.float32)


def nearest(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted ``values`` to each of ``x`` (ties to the upper one)."""
    return torch.bucketize(x, (values[:-1] + values[1:]) / 2, out_int32=True).to(torch.uint8)


def blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat fp32) scaled into [-1, 1] per block of ``block`` values, and each block's absmax."""
    n = x.numel()
    pad = -n % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1).reshape(-1)[:n]
    return scaled, absmax
