"""HF causal LM -> list of layers (``embed``, ``layers.i``, ``head``) for the pipeline runtime.

``adapt_model(model, head_shards=k)`` cuts the head + loss into ``k`` vocabulary shards
``head.0 .. head.{k-1}`` instead (exact; see ``head_shards.py``). ``adapt_model(model)`` accepts a supported ``*ForCausalLM`` (optionally inside a peft wrapper) and
returns a ``ModelAdapter``; see ``base.py`` for the contract and ``families.py`` for what is
supported and how to add a family.
"""

from __future__ import annotations

from roundpipe.models.adapter import DecoderOnlyAdapter, adapt_model
from roundpipe.models.base import Layer, LayerContext, MicrobatchInputs, ModelAdapter
from roundpipe.models.families import FamilySpec, register_family, supported_families
from roundpipe.models.head import chunked_lm_loss
from roundpipe.models.head_shards import vocab_ranges

SUPPORTED_FAMILIES: tuple[str, ...] = supported_families()

__all__ = [
    "SUPPORTED_FAMILIES",
    "DecoderOnlyAdapter",
    "FamilySpec",
    "Layer",
    "LayerContext",
    "MicrobatchInputs",
    "ModelAdapter",
    "adapt_model",
    "chunked_lm_loss",
    "register_family",
    "supported_families",
    "vocab_ranges",
]
