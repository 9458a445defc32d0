"""The few numbers of a model config the cost model uses, read once into a :class:`ModelShape`.

Field names follow transformers, so a preset (``roundpipe.presets.load_model_config``) and a local
``config.json`` are read alike. Families differ in a few ways the cost model must know:

- MoE (Qwen3-MoE, gpt-oss): ``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size`` (gpt-oss: ``intermediate_size``); a layer ``i`` is MoE unless listed
  in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``.
- gpt-oss (``model_type`` ``gpt_oss``) keeps its experts as fused 3-D parameters (``gate_up_proj``
  ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``) with biases, a router with a bias, one attention
  sink per head, and biases on every attention projection.
- Sliding-window attention: the layers that ``layer_types`` marks ``sliding_attention``; without
  ``layer_types``, every layer when ``sliding_window`` is set for the families whose every layer
  then slides (mistral, phi3, qwen3_moe; see ``models/families.py``), and gpt-oss's default of
  alternate layers (0, 2, 4, ...).
- Qwen3 families have per-head q/k norms.

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import ConfigError

SLIDING = "sliding_attention"
_SLIDE_EVERY_LAYER = ("mistral", "phi3", "qwen3_moe")  # mask_layout "sliding_if_set" in models/families.py
_FUSED_EXPERTS = ("gpt_oss",)


@dataclass(frozen=True)
class ModelShape:
    """The few config numbers the cost model uses, read from a transformers-style config dict."""

    model_type: str
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int | None
    vocab: int
    tied: bool
    qk_norm: bool
    attention_bias: bool
    mlp_bias: bool
    num_experts: int
    experts_per_tok: int
    moe_intermediate: int | None
    moe_layers: frozenset[int]
    fused_experts: bool = False  # experts as 3-D parameters indexed per expert (gpt-oss)
    expert_bias: bool = False
    router_bias: bool = False
    attention_sinks: bool = False  # one learned logit per head (gpt-oss)
    sliding_window: int | None = None
    sliding_layers: frozenset[int] = frozenset()

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def dense_width(self) -> int:
        """The dense MLP's intermediate size (:func:`model_shape` has checked it for dense layers)."""
        if self.intermediate is None:
            raise ConfigError("model config lacks 'intermediate_size' for its dense MLP layers")
        return int(self.intermediate)

    @property
    def expert_width(self) -> int:
        """An expert's intermediate size (:func:`model_shape` has checked it for MoE layers)."""
        if self.moe_intermediate is None:
            raise ConfigError(_NO_EXPERT_WIDTH)
        return int(self.moe_intermediate)

    def window(self, layer: int) -> int | None:
        """Keys a query of layer ``layer`` may see (itself included), or None for full causal attention."""
        return self.sliding_window if layer in self.sliding_layers else None


_NO_EXPERT_WIDTH = "MoE model config lacks 'moe_intermediate_size' (or 'intermediate_size') for its experts"


class ConfigView(Mapping):
    """A transformers config object read as the dict :func:`model_shape` takes: each key by
    attribute, so that a config's own aliases apply (gpt2's ``n_embd`` answers ``hidden_size``)."""

    def __init__(self, config: Any):
        self._config = config

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self._config, key)
        except AttributeError:
            raise KeyError(key) from None

    def __iter__(self):
        return iter(self._config.to_dict())

    def __len__(self) -> int:
        return len(self._config.to_dict())


def _need(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConfigError(
            f"model config lacks {key!r}; the cost model needs it (source: {config.get('_source')})"
        )
    return config[key]


def _sliding_layers(config: Mapping[str, Any], model_type: str, layers: int) -> frozenset[int]:
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:  # Qwen2/Qwen3 configs carry a window they do not use
        window = None
    types = config.get("layer_types")
    if isinstance(types, list | tuple):
        if len(types) != layers:
            raise ConfigError(
                f"model config has {len(types)} layer_types for {layers} layers; give one per layer"
            )
        sliding = frozenset(i for i, t in enumerate(types) if t == SLIDING) if window else frozenset()
    elif not window:
        sliding = frozenset()
    elif model_type == "gpt_oss":
        sliding = frozenset(range(0, layers, 2))  # transformers' GptOssConfig default
    elif model_type in _SLIDE_EVERY_LAYER:
        sliding = frozenset(range(layers))
    else:
        sliding = frozenset()
    return sliding


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Read a transformers-style config (``hidden_size``, ``num_hidden_layers``, ...); see the module
    docstring for how MoE, gpt-oss and sliding windows are recognised."""
    hidden = int(_need(config, "hidden_size"))
    layers = int(_need(config, "num_hidden_layers"))
    heads = int(_need(config, "num_attention_heads"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    model_type = str(config.get("model_type", ""))
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    moe_layers: frozenset[int] = frozenset()
    if experts:
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = frozenset(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    fused = model_type in _FUSED_EXPERTS
    sliding = _sliding_layers(config, model_type, layers)
    shape = ModelShape(
        model_type=model_type,
        hidden=hidden,
        num_layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=config.get("intermediate_size"),
        vocab=int(_need(config, "vocab_size")),
        tied=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        num_experts=experts,
        experts_per_tok=int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 0),
        moe_intermediate=config.get("moe_intermediate_size") or config.get("intermediate_size"),
        moe_layers=moe_layers,
        fused_experts=fused,
        expert_bias=fused,
        router_bias=fused,
        attention_sinks=fused,
        sliding_window=int(config["sliding_window"]) if sliding else None,
        sliding_layers=sliding,
    )
    if experts and not shape.experts_per_tok:
        raise ConfigError("MoE config has num_experts but no num_experts_per_tok")
    if experts and shape.experts_per_tok > experts:
        raise ConfigError(
            f"MoE config routes each token to {shape.experts_per_tok} experts but has only {experts}; "
            f"num_experts_per_tok must be <= the number of experts"
        )
    if len(moe_layers) < layers and not shape.intermediate:
        raise ConfigError("model config lacks 'intermediate_size' for its dense MLP layers")
    if moe_layers and not shape.moe_intermediate:
        raise ConfigError(_NO_EXPERT_WIDTH)
    return shape


__all__ = ["ConfigView", "ModelShape", "model_shape"]
