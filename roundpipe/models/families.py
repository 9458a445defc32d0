"""Which HF causal LMs the generic adapter supports, and the few ways they differ.

All supported families share one skeleton (``model.model.embed_tokens`` -> ``model.model.layers``
-> ``model.model.norm`` -> ``model.lm_head``, rotary tables from ``model.model.rotary_emb``); what
differs is small and declared here, one ``FamilySpec`` per HF ``config.model_type``:

- which attention mask each decoder layer gets (``mask_layout``),
- whether the rotary embedding has one table per attention type (gemma3),
- whether the logits are softcapped before the loss (gemma2, gemma3),
- which config settings change HF's forward in ways the layers cannot reproduce (``check_config``).

To support a new family, read its ``modeling_*.py``: if its base model's forward is the skeleton
above (embed, position ids, masks, rotary, ``layer(hidden, attention_mask=..., position_embeddings=...,
position_ids=..., ...)`` returning a tensor, norm, lm_head, ``ForCausalLMLoss``), add a ``FamilySpec``
with ``register_family`` (or to ``_BUILTIN`` below) and a tiny config to ``tests/tiny_models.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

FULL = "full_attention"
SLIDING = "sliding_attention"

MaskLayout = Literal["causal", "sliding_if_set", "layer_types"]


@dataclass(frozen=True)
class FamilySpec:
    """How one HF model family maps onto the generic decoder-only adapter.

    Attributes:
        model_type: the HF ``config.model_type`` (e.g. ``"llama"``, ``"gemma3_text"``).
        causal_lm_class: the name of the ``transformers`` class the model must be an instance of
            (e.g. ``"LlamaForCausalLM"``); looked up lazily so importing roundpipe stays cheap.
        mask_layout: ``"causal"``: every layer gets ``create_causal_mask`` (llama).
            ``"sliding_if_set"``: every layer gets the sliding-window mask iff ``config.sliding_window``
            is not None, else the causal one (mistral, phi3, qwen3_moe).
            ``"layer_types"``: layer ``i`` gets the mask of ``config.layer_types[i]`` (qwen2, qwen3,
            gemma2, gemma3).
        rotary_per_layer_type: the rotary module is called as ``rotary_emb(x, position_ids,
            layer_type)`` once per attention type (gemma3) instead of once for all layers.
        logit_softcapping: apply ``config.final_logit_softcapping`` (when set) to the logits.
        check_config: returns a message naming the setting to change when the config asks for
            behaviour the layer-by-layer run would not reproduce exactly, else None.
    """

    model_type: str
    causal_lm_class: str
    mask_layout: MaskLayout = "causal"
    rotary_per_layer_type: bool = False
    logit_softcapping: bool = False
    check_config: Callable[[Any], str | None] | None = None

    def mask_type(self, config: Any, layer_index: int) -> str:
        """The attention type (key of ``LayerContext.masks``) decoder layer ``layer_index`` uses."""
        if self.mask_layout == "layer_types":
            return config.layer_types[layer_index]
        if self.mask_layout == "sliding_if_set" and getattr(config, "sliding_window", None) is not None:
            return SLIDING
        return FULL


def _check_qwen3_moe(config: Any) -> str | None:
    if getattr(config, "output_router_logits", False):
        return (
            "config.output_router_logits=True adds the router load-balancing loss to the LM loss, which "
            "the pipelined head does not compute; set model.config.output_router_logits = False"
        )
    return None


def _check_gemma3(config: Any) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return (
            "config.use_bidirectional_attention=True (an encoder-style Gemma3) is not supported; "
            "use a causal Gemma3 (use_bidirectional_attention=False)"
        )
    return None


_BUILTIN = (
    FamilySpec("llama", "LlamaForCausalLM", mask_layout="causal"),
    FamilySpec("qwen2", "Qwen2ForCausalLM", mask_layout="layer_types"),
    FamilySpec("qwen3", "Qwen3ForCausalLM", mask_layout="layer_types"),
    FamilySpec(
        "qwen3_moe", "Qwen3MoeForCausalLM", mask_layout="sliding_if_set", check_config=_check_qwen3_moe
    ),
    FamilySpec("mistral", "MistralForCausalLM", mask_layout="sliding_if_set"),
    FamilySpec("phi3", "Phi3ForCausalLM", mask_layout="sliding_if_set"),
    FamilySpec("gemma2", "Gemma2ForCausalLM", mask_layout="layer_types", logit_softcapping=True),
    FamilySpec(
        "gemma3_text",
        "Gemma3ForCausalLM",
        mask_layout="layer_types",
        rotary_per_layer_type=True,
        logit_softcapping=True,
        check_config=_check_gemma3,
    ),
)

FAMILIES: dict[str, FamilySpec] = {spec.model_type: spec for spec in _BUILTIN}


def register_family(spec: FamilySpec) -> None:
    """Add (or replace) the spec of ``spec.model_type``; see the module docstring for when it fits."""
    FAMILIES[spec.model_type] = spec


def supported_families() -> tuple[str, ...]:
    """The ``config.model_type`` values the adapter accepts, in registration order."""
    return tuple(FAMILIES)
