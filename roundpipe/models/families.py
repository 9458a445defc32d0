"""What discovery cannot find out from a model: the few registered facts, and the settings refused.

Any HF causal LM is discovered (``discover.py``): its parts, the mask each layer gets, whether its
embedding and logits need the model's own forward. The wrap-time check (``verify.py``) then proves
the layers reproduce the model's forward. What is left for this module:

- :data:`GENERIC_CHECKS`: config settings that change HF's training forward in a way the layers do
  not reproduce, for every family (bidirectional attention; the MoE router loss is reproduced,
  ``router_loss.py``);
- :func:`packing_refusal`: why a model cannot train on packed rows (samples concatenated, attention
  kept within each by position ids that restart), or None;
- :class:`FamilySpec`: per ``config.model_type``, a check of its own and an ``adjust`` of the
  discovered layout, registered with :func:`register_family` where a family's behaviour differs
  from what discovery reads. None is built in today: discovery covers every family the coverage
  report (``docs/models.md``) lists as supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from roundpipe.models.discover import FULL, SLIDING, ModelLayout

__all__ = [
    "FAMILIES",
    "FULL",
    "GENERIC_CHECKS",
    "SLIDING",
    "FamilySpec",
    "packing_refusal",
    "register_family",
    "supported_families",
]


def _bidirectional(config: Any) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return (
            "config.use_bidirectional_attention=True (an encoder-style model) is not supported; use a "
            "causal model (use_bidirectional_attention=False)"
        )
    return None


GENERIC_CHECKS: tuple[Callable[[Any], str | None], ...] = (_bidirectional,)


def packing_refusal(family: str, layout: ModelLayout, config: Any) -> str | None:
    """Why ``family`` cannot train on packed rows, or None when it can.

    A packed row goes to the model without an attention mask and with position ids that restart at
    every sample; transformers' causal and sliding-window mask builders then keep attention within
    each sample (``masking_utils.find_packed_sequence_indices``). Only layers that get one of those
    masks (discovery's ``FULL`` and ``SLIDING``) are known to do so: any other mask, and any layer
    that is not attention (linear attention, a state-space or convolution layer: ``layer_types``),
    could carry one sample into the next.
    """
    kinds = [k for k in getattr(config, "layer_types", None) or () if k not in (FULL, SLIDING)]
    others = [i for i, t in enumerate(layout.attention_types) if t not in (FULL, SLIDING)]
    if not kinds and not others:
        return None
    why = (
        f"layer_types holds {sorted(set(kinds))}, layers whose state runs on across the samples of a row"
        if kinds
        else f"decoder layers {others} get a mask other than transformers' causal or sliding-window mask, "
        "so nothing shows that they keep attention within each packed sample"
    )
    return (
        f"{family} cannot train on packed rows: {why}. Set data.packing: false (each sample its own "
        f"row; group_by_length keeps the padding small)"
    )


@dataclass(frozen=True)
class FamilySpec:
    """What to add to discovery for one HF family.

    Attributes:
        model_type: the HF ``config.model_type`` (e.g. ``"llama"``, ``"gemma3_text"``).
        check_config: returns a message naming the setting to change when the config asks for
            behaviour the layers would not reproduce exactly, else None.
        attention_types: per decoder layer, the mask type to use instead of the discovered one
            (a function of the config), or None to keep discovery's.
        logits: ``"plain"``, ``"softcap"`` or ``"custom"`` instead of the discovered kind, or None.
    """

    model_type: str
    check_config: Callable[[Any], str | None] | None = None
    attention_types: Callable[[Any], tuple[str, ...]] | None = None
    logits: str | None = None

    def adjust(self, layout: ModelLayout, config: Any = None) -> ModelLayout:
        """``layout`` with this spec's overrides applied."""
        changes: dict[str, Any] = {}
        if self.attention_types is not None and config is not None:
            changes["attention_types"] = tuple(self.attention_types(config))
        if self.logits is not None:
            changes["logits"] = self.logits
        return replace(layout, **changes) if changes else layout


FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> None:
    """Add (or replace) the spec of ``spec.model_type``."""
    FAMILIES[spec.model_type] = spec


def supported_families() -> tuple[str, ...]:
    """The ``config.model_type`` values with a registered spec (any other discovers itself)."""
    return tuple(FAMILIES)


def _ctrl_stores_its_position_table(config: Any) -> str:
    return (
        "its forward assigns the position table back to the model in every call "
        "(self.pos_encoding = self.pos_encoding.to(...)), and the pipeline then finds the embedding "
        "layer's device weights still referenced after its task (a StreamProtocolError on the cpu "
        "backend); roundpipe does not run it yet (found by benchmarks/family_tester_coverage.py)"
    )


register_family(FamilySpec("ctrl", check_config=_ctrl_stores_its_position_table))
