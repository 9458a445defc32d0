"""How long a sequence a model's position encoding is configured for.

A transformers config says it in ``max_position_embeddings``; rotary models go further only with
rope scaling in the config (``rope_scaling``, or ``rope_parameters`` from transformers 5), whose
``factor`` stretches the positions the model was trained on (``original_max_position_embeddings``,
else ``max_position_embeddings``): YaRN, linear, dynamic NTK, LongRoPE, Llama 3's. Beyond the
configured length the rotary angles leave the range the model learned, and transformers does not
refuse it, so a plan does: :func:`check_positions` names the limit and the scaling that would lift
it. :func:`with_rope_scaling` is that scaling, for a plan made before the config is edited
(``roundpipe plan --rope-scaling yarn:2``).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from roundpipe.errors import ConfigError

NO_SCALING = (None, "default")
SCALING_TYPES = ("yarn", "linear", "dynamic", "longrope", "llama3")


def rope_scaling(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The config's rope scaling (either key), or None when it has none or the default type."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) not in NO_SCALING:
            return rope
    return None


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The longest sequence the config is set up for, or None when it states no limit."""
    native = config.get("max_position_embeddings")
    rope = rope_scaling(config)
    if rope is None:
        return int(native) if native else None
    original = rope.get("original_max_position_embeddings") or native
    factor = float(rope.get("factor") or 1.0)
    if not original:
        return None
    return max(int(native or 0), int(original * factor))


def scaling_needed(config: Mapping[str, Any], seq_len: int) -> str:
    """What rope scaling would let the config take ``seq_len`` tokens, in words."""
    native = config.get("max_position_embeddings")
    if not native:
        return "a config with max_position_embeddings"
    factor = math.ceil(seq_len / native * 4) / 4  # quarter steps, as configs give them
    return (
        f"rope scaling of at least factor {factor:g} over its {int(native):,} positions (for example "
        f'"rope_scaling": {{"rope_type": "yarn", "factor": {factor:g}, '
        f'"original_max_position_embeddings": {int(native)}}} in its config.json, or '
        f"--rope-scaling yarn:{factor:g} to plan before editing it)"
    )


def check_positions(config: Mapping[str, Any], seq_len: int, name: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``seq_len`` is longer than the config's positions reach
    (``name``: the model's, for the message)."""
    limit = position_limit(config)
    if limit is not None and seq_len > limit:
        name = name or config.get("_name_or_path") or config.get("model_type") or "the model"
        raise ConfigError(
            f"{seq_len:,} tokens is longer than {name} is configured for ({limit:,} positions); "
            f"use at most {limit:,} tokens, or give it {scaling_needed(config, seq_len)}"
        )


def with_rope_scaling(config: Mapping[str, Any], spec: str) -> dict[str, Any]:
    """``config`` with the rope scaling ``TYPE:FACTOR`` (e.g. ``yarn:2``) over its
    ``max_position_embeddings``; ConfigError for a bad spec or a config without positions."""
    kind, _, factor_text = spec.partition(":")
    try:
        factor = float(factor_text)
    except ValueError:
        factor = 0.0
    if kind not in SCALING_TYPES or not factor > 1.0:
        raise ConfigError(
            f"--rope-scaling takes TYPE:FACTOR with TYPE one of {', '.join(SCALING_TYPES)} and a "
            f"FACTOR above 1, e.g. yarn:2; got {spec!r}"
        )
    native = config.get("max_position_embeddings")
    if not native:
        raise ConfigError("--rope-scaling needs a model config with max_position_embeddings")
    rope = {"rope_type": kind, "factor": factor, "original_max_position_embeddings": int(native)}
    return {**config, "rope_scaling": rope}


__all__ = ["check_positions", "position_limit", "rope_scaling", "scaling_needed", "with_rope_scaling"]
