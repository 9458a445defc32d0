"""What a backend that models the time of layers (the virtual server) needs of a wrapped model."""

from __future__ import annotations

from torch import nn

from roundpipe.config import RunConfig


def cost_settings(model: nn.Module, config: RunConfig) -> tuple[dict, dict]:
    """The wrapped model's HF config (as a dict) and the run settings the cost model times its layers
    by (``Backend.attach``: the virtual server models time from them)."""
    base = getattr(model, "config", None) or getattr(getattr(model, "base_model", None), "config", None)
    peft_config = getattr(model, "peft_config", None)
    active = peft_config.get(getattr(model, "active_adapter", None)) if peft_config else None
    settings = dict(
        dtype=config.dtype,
        lora_rank=getattr(active, "r", None),
        head_shards=config.head_shards,
        head_chunk_tokens=config.head_chunk_tokens,
        fp16_accumulation=config.fp16_accumulation,
        mlp_chunk_tokens=config.mlp_chunk_tokens,
        quantization=config.quantization,
    )
    return (base.to_dict() if base is not None else {}), settings
