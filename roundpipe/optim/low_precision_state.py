"""AdamW with its two moments kept in fewer bytes on the host (``OptimizerConfig.state_dtype``).

For full fine-tuning the AdamW state is most of the host RAM: an fp32 master and two fp32 moments
are 12 bytes per parameter (384 GB for a 32B model). ``state_dtype`` keeps the moments as

- ``"bf16"``: each moment rounded to bf16 (round to nearest even) after every step: 4 bytes per
  parameter instead of 8;
- ``"int8"``: bitsandbytes' 8-bit blockwise state (Dettmers et al. 2022): blocks of 256 values,
  each scaled by its absmax into [-1, 1] and stored as the index of the nearest value of the
  dynamic map (signed for the first moment, unsigned for the second) plus the block's fp32
  absmax: 2.03 bytes per parameter.

The master stays fp32. Each step decodes a parameter's moments to fp32, runs torch's fused AdamW
kernel on them exactly as ``torch.optim.AdamW(fused=True)`` does, and encodes the result; so the
only difference from fp32 state is the rounding of the stored moments, once per step. The
numerical contract (``tests/test_optimizer_state.py``): after 20 steps on a tiny model the weights
are within 1% (bf16) and 5% (int8) of the distance the fp32-state run moved them, and a run saved
and resumed from a checkpoint continues bit for bit (the stored codes are saved as they are). The
planner counts the moments' bytes (``partition/quant_layout.py`` ``moment_bytes_per_param``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from roundpipe.number_codes import blockwise, dynamic_map, nearest
from roundpipe.partition.quant_layout import STATE_BLOCK, STATE_DTYPES

__all__ = ["STATE_BLOCK", "STATE_DTYPES", "LowPrecisionStateAdamW"]

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state key, signed)


CHUNK = 1 << 20  # values per pass: the fp32 moments of one chunk stay in cache, reused


def _new_state(p: torch.Tensor, state_dtype: str) -> dict[str, torch.Tensor]:
    """Zero moments in ``state_dtype`` for parameter ``p`` (flat), by state key."""
    out = {}
    for key, _ in MOMENTS:
        if state_dtype == "bf16":
            out[key] = torch.zeros(p.numel(), dtype=torch.bfloat16, device=p.device)
        else:  # the zero code and an absmax of 0 decode to 0 whatever the map
            out[key] = torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
            out[f"{key}_absmax"] = torch.zeros(-(-p.numel() // STATE_BLOCK), device=p.device)
    return out


def _decode(state: dict, key: str, state_dtype: str, signed: bool, a: int, b: int, out: torch.Tensor) -> None:
    """Values ``[a, b)`` of a moment into ``out`` (fp32; ``a`` on a block boundary)."""
    stored = state[key][a:b]
    if state_dtype == "bf16" or stored.is_meta:
        out.copy_(stored)
        return
    torch.index_select(dynamic_map(signed), 0, stored.to(torch.int32), out=out)
    absmax = state[f"{key}_absmax"][a // STATE_BLOCK : -(-b // STATE_BLOCK)]
    full = (b - a) - (b - a) % STATE_BLOCK
    out[:full].view(-1, STATE_BLOCK).mul_(absmax[: full // STATE_BLOCK].unsqueeze(1))
    if full < b - a:
        out[full:].mul_(absmax[-1])


def _encode(
    value: torch.Tensor, state: dict, key: str, state_dtype: str, signed: bool, a: int, b: int
) -> None:
    """Store fp32 ``value`` as values ``[a, b)`` of a moment."""
    if state_dtype == "bf16" or value.is_meta:
        state[key][a:b].copy_(value)
        return
    scaled, absmax = blockwise(value, STATE_BLOCK)
    state[key][a:b].copy_(nearest(scaled, dynamic_map(signed)))
    state[f"{key}_absmax"][a // STATE_BLOCK : -(-b // STATE_BLOCK)].copy_(absmax)


def stepped(optimizer: torch.optim.Optimizer, new_state) -> Iterator[tuple[dict, torch.Tensor, dict]]:
    """``(group, parameter, state)`` of each parameter with a gradient, as torch's AdamW steps them;
    a parameter's first state is ``step`` 0 and ``new_state(parameter)``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state.update(new_state(p))
            yield group, p, state


def fused_adamw(params, grads, avgs, sqs, steps, group: dict, grad_scale) -> None:
    """torch's fused AdamW kernel, as ``torch.optim.AdamW(fused=True)`` runs it, on tensors whose
    ``steps`` were already counted, with the options of parameter group ``group``."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        params, grads, avgs, sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
        weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
        grad_scale=grad_scale,
    )  # fmt: skip


class LowPrecisionStateAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with the moments stored in ``state_dtype`` (module
    docstring), stepped in chunks of :data:`CHUNK` values so that the fp32 moments of a chunk stay
    in cache. State keys: ``step`` and, per moment, ``exp_avg`` / ``exp_avg_sq`` (flat: the bf16
    values or the int8 codes) and, for int8, ``exp_avg_absmax`` / ``exp_avg_sq_absmax``."""

    def __init__(self, params, *, state_dtype: str, **kwargs):
        kwargs.pop("fused", None)
        super().__init__(params, foreach=False, **kwargs)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group, p, state in stepped(self, lambda p: _new_state(p, self.state_dtype)):
            state["step"] += 1
            assert p.grad is not None  # stepped() yields parameters with a gradient only
            flat, grad, n = p.view(-1), p.grad.view(-1), p.numel()
            m = torch.empty(min(n, CHUNK), device=p.device)
            v = torch.empty_like(m)
            scale = getattr(self, "grad_scale", None)
            for a in range(0, n, CHUNK):
                b = min(n, a + CHUNK)
                mc, vc = m[: b - a], v[: b - a]
                _decode(state, "exp_avg", self.state_dtype, True, a, b, mc)
                _decode(state, "exp_avg_sq", self.state_dtype, False, a, b, vc)
                fused_adamw([flat[a:b]], [grad[a:b]], [mc], [vc], [state["step"]], group, scale)
                _encode(mc, state, "exp_avg", self.state_dtype, True, a, b)
                _encode(vc, state, "exp_avg_sq", self.state_dtype, False, a, b)
