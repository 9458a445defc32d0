"""torch's grouped matrix multiply (``aten._grouped_mm``, transformers' default experts for a
mixture of experts) on CUDA's clock, for the issue mode (``cpu_clock.py``).

On CUDA torch runs it without reading the group offsets only on its fast path: bf16 inputs and
output on compute capability 9.x or 10.x. Everywhere else its fallback copies the offsets to the
host and loops over the groups: a host sync in every expert projection of every MoE layer pass
(fp16 or fp32 on any GPU, and every dtype on an RTX 4090, 3090 or A800). The cpu backend and the
virtual server count that sync. torch's meta kernel takes bf16 only; the shapes of the outputs do
not depend on the dtype, so other dtypes get them from bf16 stand-ins.
"""

from __future__ import annotations

import torch

GROUPED_MM = torch.ops.aten._grouped_mm.default
FAST_PATH_MAJORS = (9, 10)  # compute capabilities whose bf16 grouped kernel reads no offsets


def fast_path_on(compute_capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of ``compute_capability`` has the fast path (None: no particular GPU)."""
    return compute_capability is not None and compute_capability[0] in FAST_PATH_MAJORS


def _out_dtype(args, kwargs) -> torch.dtype:
    out = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    return out if out is not None else args[0].dtype


def _bf16_throughout(args, kwargs) -> bool:
    """Both inputs and the output are bf16 (the fast path's dtype, and the meta kernel's)."""
    return args[0].dtype == args[1].dtype == _out_dtype(args, kwargs) == torch.bfloat16


def reads_offsets(args, kwargs, fast_path: bool) -> bool:
    """Whether this call copies its group offsets to the host (a host sync on CUDA)."""
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if offs is None:
        return False
    return not (fast_path and _bf16_throughout(args, kwargs))


def meta_stand_ins(args, kwargs) -> tuple[tuple, dict, torch.dtype | None]:
    """Meta arguments the meta kernel accepts, and the dtype the outputs really have (None: as
    the meta kernel says)."""
    if _bf16_throughout(args, kwargs):
        return tuple(args), dict(kwargs), None
    real = _out_dtype(args, kwargs)
    bf16 = [a.to(torch.bfloat16) if i in (0, 1, 3) and a is not None else a for i, a in enumerate(args)]
    if len(bf16) > 4:
        bf16[4] = None
    return tuple(bf16), {k: v for k, v in kwargs.items() if k != "out_dtype"}, real
