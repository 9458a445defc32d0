"""The checks of the cost model's settings, each raising :class:`ConfigError` with what to change
(called by ``cost.model_costs``, the simulator's ``Scenario`` and the settings that feed them).

Pure Python: no torch import.
"""

from __future__ import annotations

from roundpipe.errors import ConfigError
from roundpipe.partition.quant_layout import check_quantization


def check_mlp_chunk_tokens(value) -> None:
    """Raise ConfigError unless ``value`` is None or a positive int (tokens per MLP chunk)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"mlp_chunk_tokens must be a positive number of tokens (e.g. 4096) or None (the MLP in one "
            f"piece), got {value!r}"
        )


def check_label_fraction(value) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a share of tokens in ``(0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(
            f"label fraction (label_fraction, --label-fraction) is the share of tokens with a label "
            f"and must lie in (0, 1], got "
            f"{value!r}; use 1 when every token is trained on"
        )


def check_fp16_accumulation(on: bool, dtype: str) -> None:
    """fp16 accumulation is a property of fp16 matmuls only."""
    if on and dtype != "fp16":
        raise ConfigError(
            f"fp16 accumulation needs dtype fp16, not {dtype}; set the dtype to fp16 or drop it"
        )


def check_quantized_lora(quantization, lora_rank) -> None:
    """Compressed weights are frozen ones: a quantization needs a LoRA run."""
    check_quantization(quantization)
    if quantization is not None and lora_rank is None:
        raise ConfigError(
            f"quantization={quantization!r} keeps frozen weights compressed, and full fine-tuning trains "
            f"them all: give a LoRA rank, or leave quantization unset"
        )
