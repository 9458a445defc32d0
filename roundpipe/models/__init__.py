"""HF causal LM -> list of layers (``embed``, ``layers.i``, ``head``) for the pipeline runtime.

``adapt_model(model)`` accepts any HF causal LM whose base model runs embed -> attention decoder
layers -> norm (optionally inside a peft wrapper): ``discover.py`` finds its parts and facts,
``views.py`` runs its own code between them, ``verify.py`` proves the layers against the model's
forward at wrap time. ``adapt_model(model, head_shards=k)`` cuts the head + loss into ``k``
vocabulary shards ``head.0 .. head.{k-1}`` (exact; see ``head_shards.py``). ``base.py`` is the
contract; ``families.py`` what discovery cannot know; ``docs/models.md`` the families covered.
"""

from __future__ import annotations

from roundpipe.models.adapter import DecoderOnlyAdapter, adapt_model
from roundpipe.models.base import Layer, LayerContext, MicrobatchInputs, ModelAdapter
from roundpipe.models.families import FamilySpec, register_family, supported_families
from roundpipe.models.head import chunked_lm_loss
from roundpipe.models.head_shards import vocab_ranges

__all__ = [
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
