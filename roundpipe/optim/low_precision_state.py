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

import torch

from roundpipe.number_codes import blockwise, dynamic_values, nearest
from roundpipe.partition.quant_layout import STATE_BLOCK, STATE_DTYPES

__all__ = ["STATE_BLOCK", "STATE_DTYPES", "LowPrecisionStateAdamW"]

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state key, signed)


def _encode(x: torch.Tensor, state_dtype: str, signed: bool) -> dict[str, torch.Tensor]:
    if state_dtype == "bf16":
        return {"": x.to(torch.bfloat16)}
    if x.is_meta:  # a virtual run: shapes only
        blocks = -(-x.numel() // STATE_BLOCK)
        return {"": torch.empty(x.shape, dtype=torch.uint8, device="meta"), "_absmax": x.new_empty(blocks)}
    scaled, absmax = blockwise(x.reshape(-1), STATE_BLOCK)
    codes = nearest(scaled, torch.tensor(dynamic_values(signed), dtype=torch.float32))
    return {"": codes.view(x.shape), "_absmax": absmax}


def _decode(state: dict, key: str, state_dtype: str, signed: bool, like: torch.Tensor) -> torch.Tensor:
    stored = state[key]
    if state_dtype == "bf16":
        return stored.to(torch.float32)
    if stored.is_meta:
        return torch.empty_like(like)
    table = torch.tensor(dynamic_values(signed), dtype=torch.float32)
    values = torch.index_select(table, 0, stored.reshape(-1).to(torch.int32))
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, -n % STATE_BLOCK)).view(-1, STATE_BLOCK)
    return (padded * state[f"{key}_absmax"].unsqueeze(1)).reshape(-1)[:n].view(like.shape)


class LowPrecisionStateAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with the moments stored in ``state_dtype`` (module
    docstring). State keys: ``step`` and, per moment, ``exp_avg`` / ``exp_avg_sq`` (the bf16
    values or the int8 codes) and, for int8, ``exp_avg_absmax`` / ``exp_avg_sq_absmax``."""

    def __init__(self, params, *, state_dtype: str, **kwargs):
        kwargs.pop("fused", None)
        super().__init__(params, foreach=False, **kwargs)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for key, signed in MOMENTS:
                        for suffix, t in _encode(torch.zeros_like(p), self.state_dtype, signed).items():
                            state[key + suffix] = t
                moments = [_decode(state, key, self.state_dtype, signed, p) for key, signed in MOMENTS]
                state["step"] += 1
                torch._fused_adamw_(
                    [p], [p.grad], [moments[0]], [moments[1]], [], [state["step"]], lr=group["lr"],
                    beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    amsgrad=False, maximize=False, grad_scale=getattr(self, "grad_scale", None),
                )  # fmt: skip
                for (key, signed), value in zip(MOMENTS, moments):
                    for suffix, t in _encode(value, self.state_dtype, signed).items():
                        state[key + suffix] = t
