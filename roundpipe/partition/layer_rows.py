"""The cost model's numbers per layer, as ``roundpipe costs`` prints them, and their calibration.

:func:`layer_rows` gives, for every layer of a model (named as the runtime names them: ``embed``,
``layers.i``, ``head`` or ``head.0`` .. ``head.{k-1}``) and one microbatch on one GPU, forward
seconds, backward seconds without the recompute forward, FLOPs and bytes; :func:`totals` sums them
over the model. :func:`calibration` sets every measured layer time of
``presets/measured_layers.json`` next to the cost model's prediction in the same setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import LayerCost, layer_time, model_costs
from roundpipe.presets import load_hardware, load_measured_layers, load_model_config

QUANTITIES = ("fwd", "bwd", "head_fwd", "head_bwd")


@dataclass(frozen=True)
class LayerRow:
    """One layer for one microbatch: seconds (backward without recompute), FLOPs and bytes."""

    name: str
    kind: str
    forward_s: float
    backward_s: float
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    act_in_bytes: int
    saved_bytes: int
    transient_bytes: int


def _row(cost: LayerCost, hw, fp16_accumulation: bool) -> LayerRow:
    return LayerRow(
        name=cost.name,
        kind=cost.kind,
        forward_s=layer_time(cost, hw, phase="forward", fp16_accumulate=fp16_accumulation),
        backward_s=layer_time(cost, hw, phase="backward", fp16_accumulate=fp16_accumulation),
        fwd_flops=cost.fwd_flops,
        bwd_flops=cost.bwd_flops,
        param_bytes=cost.param_bytes,
        act_in_bytes=cost.act_in_bytes,
        saved_bytes=cost.saved_bytes,
        transient_bytes=cost.transient_bytes,
    )


def layer_rows(
    model: str,
    hardware: str = "rtx4090",
    *,
    seq_len: int,
    microbatch_size: int = 1,
    dtype: str = "bf16",
    fp16_accumulation: bool = False,
    lora_rank: int | None = None,
    head_shards: int = 1,
    label_fraction: float = 1.0,
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
) -> list[LayerRow]:
    """The cost model's numbers for every layer of ``model`` on one GPU of ``hardware``.

    This is what ``roundpipe costs`` prints; ``times`` of one microbatch of ``microbatch_size``
    sequences of ``seq_len`` tokens. Raises :class:`ConfigError` naming the setting to change.
    """
    if isinstance(head_shards, bool) or not isinstance(head_shards, int) or head_shards < 1:
        raise ConfigError(f"head shards must be a positive int (--head-shards K), got {head_shards!r}")
    hw = load_hardware(hardware)
    config = load_model_config(model)
    costs = model_costs(
        config,
        seq_len,
        microbatch_size,
        dtype=dtype,
        lora_rank=lora_rank,
        head_shards=head_shards,
        label_fraction=label_fraction,
        fp16_accumulation=fp16_accumulation,
        mlp_chunk_tokens=mlp_chunk_tokens,
        quantization=quantization,
    )
    return [_row(c, hw, fp16_accumulation) for c in costs]


def totals(rows: list[LayerRow]) -> dict[str, float]:
    """Whole-model sums for one microbatch; ``backward_stage_s`` adds the blocks' recompute forward."""
    fwd = math.fsum(r.forward_s for r in rows)
    bwd = math.fsum(r.backward_s for r in rows)
    recompute = math.fsum(r.forward_s for r in rows if r.kind != "head")
    flops = math.fsum(r.fwd_flops + r.bwd_flops for r in rows)
    return {
        "forward_s": fwd,
        "backward_s": bwd,
        "backward_stage_s": bwd + recompute,
        "fwd_flops": math.fsum(r.fwd_flops for r in rows),
        "bwd_flops": math.fsum(r.bwd_flops for r in rows),
        "tflops_per_s": flops / (fwd + bwd) / 1e12 if fwd + bwd > 0 else 0.0,
        "param_bytes": sum(r.param_bytes for r in rows),
        "saved_bytes": sum(r.saved_bytes for r in rows),
    }


@dataclass(frozen=True)
class CalibrationRow:
    """One measured time of ``presets/measured_layers.json`` and the cost model's prediction."""

    model: str
    quantity: str  # fwd | bwd (one decoder layer, mean over the model's layers) | head_fwd | head_bwd
    lora_rank: int | None
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: ``predicted / measured - 1``."""
        return self.predicted_s / self.measured_s - 1.0


def calibration() -> list[CalibrationRow]:
    """Every measured time next to what :func:`layer_rows` predicts in the same setting.

    A decoder layer's measured figure is compared with the mean over the model's decoder layers
    (gpt-oss alternates sliding-window and full-attention layers); the head with the unsharded head.
    """
    data = load_measured_layers()
    s = data["setting"]
    out = []
    for model, m in data["models"].items():
        rows = layer_rows(
            model,
            s["hardware"],
            seq_len=s["seq_len"],
            microbatch_size=s["microbatch_size"],
            dtype=s["dtype"],
            fp16_accumulation=s["fp16_accumulation"],
            lora_rank=m["lora_rank"],
        )
        blocks = [r for r in rows if r.kind == "block"]
        head = next(r for r in rows if r.kind == "head")
        predicted = {
            "fwd": math.fsum(r.forward_s for r in blocks) / len(blocks),
            "bwd": math.fsum(r.backward_s for r in blocks) / len(blocks),
            "head_fwd": head.forward_s,
            "head_bwd": head.backward_s,
        }
        for q in QUANTITIES:
            out.append(CalibrationRow(model, q, m["lora_rank"], m[q] / 1e3, predicted[q]))
    return out
