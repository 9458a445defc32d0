"""Finding a causal LM's parts and the facts the layers need, from the model itself.

:func:`discover_layout` reads, for any HF ``*ForCausalLM``:

- **where the parts are**: the base model (``base_model_prefix``), the embedding
  (``get_input_embeddings``), the decoder layers (the base model's ``ModuleList`` of
  ``num_hidden_layers`` modules), the final norm (a child with one of :data:`NORM_NAMES`), the rotary
  module (:data:`ROTARY_NAMES`, if any) and the LM head (``get_output_embeddings``);
- **which attention mask each decoder layer gets**: by running the base model's own forward once
  on eight tokens with its layers replaced by recorders, under a copy of the config whose sliding
  window (if any) is shorter than the probe, and matching each recorded mask against HF's causal
  and sliding-window masks for the same input. What HF passes is what the layer gets, whatever the
  config's names say;
- **what the family does between the parts** (``views.py``): whether the embedding and the logits
  are plain or need the model's own forward;
- **layer types it cannot run**: recurrent, state-space and linear-attention layers (named in the
  config's ``layer_types`` / ``layers_block_type``) are refused with their type.

No real weight is read (stand-ins take their place), so a model on the meta device is discovered
the same way. Whatever discovery misses, the wrap-time check (``verify.py``) catches.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.errors import UnsupportedModel
from roundpipe.models.views import Silent, _ProbeEmbedding, embedding_is_plain, logits_are_plain, module_view

FULL = "full_attention"
SLIDING = "sliding_attention"
NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")
ROTARY_NAMES = ("rotary_emb", "rotary_embedding", "rotary_embeddings")
ATTENTION_TYPES = (FULL, SLIDING)
# Layer types (as configs name them) whose layers carry a recurrent state or are not attention:
# the layer-by-layer run has no state to hand between microbatch chunks, so they are refused.
_RECURRENT_HINTS = (
    "mamba",
    "linear",
    "recurrent",
    "rwkv",
    "ssm",
    "conv",
    "retention",
    "lstm",
    "delta",
    "hybrid",
)


@dataclass(frozen=True)
class ModelLayout:
    """Where a causal LM keeps its parts and how its layers are run (module docstring).

    ``base``: the causal LM's attribute holding the base model; ``embed``, ``layers``, ``norm``,
    ``rotary`` (None: no shared rotary module): the base model's children; ``head``: the causal LM's
    LM head attribute. ``attention_types[i]``: the mask decoder layer ``i`` gets (``FULL`` or
    ``SLIDING``). ``embedding``: ``"plain"`` (layer 0 gets ``embed(ids)``) or ``"view"``.
    ``logits``: ``"plain"``, ``"softcap"`` or ``"custom"`` (``views.logits_are_plain``).
    """

    base: str
    embed: str
    layers: str
    norm: str
    rotary: str | None
    head: str
    attention_types: tuple[str, ...]
    rotary_per_layer_type: bool
    embedding: str
    logits: str

    def names(self) -> dict[str, str | None]:
        return {"embed": self.embed, "layers": self.layers, "norm": self.norm, "rotary": self.rotary}


def text_config(config: Any) -> Any:
    """The config that sizes the decoder (``get_text_config()`` of a multimodal config)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _child_name(parent: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((n for n, m in parent.named_children() if m is target), None)


def find_parts(causal_lm: nn.Module) -> tuple[str, str, str, str, str | None, str]:
    """(base, embed, layers, norm, rotary, head) attribute names, or UnsupportedModel naming what
    is missing."""
    kind = type(causal_lm).__name__
    config = text_config(causal_lm.config)
    base_name = getattr(causal_lm, "base_model_prefix", "") or "model"
    base = getattr(causal_lm, base_name, None)
    if not isinstance(base, nn.Module) or base is causal_lm:
        raise UnsupportedModel(
            f"{kind} has no base model under {base_name!r} (its base_model_prefix): roundpipe trains "
            f"causal LMs made of a base model (embedding, decoder layers, final norm) and an LM head"
        )
    embed = _child_name(base, causal_lm.get_input_embeddings())
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    norm = next((n for n in NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    rotary = next((n for n in ROTARY_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    head = _child_name(causal_lm, causal_lm.get_output_embeddings())
    missing = [
        what
        for what, found in (
            ("an input embedding that is a child of the base model", embed),
            (f"one ModuleList of num_hidden_layers={n_layers} decoder layers", len(lists) == 1),
            (f"a final norm named one of {', '.join(NORM_NAMES)}", norm),
            ("an output embedding (LM head) that is a child of the model", head),
        )
        if not found
    ]
    if missing:
        raise UnsupportedModel(
            f"{kind} ({type(base).__name__}) lacks {'; '.join(missing)}, so roundpipe cannot cut it into "
            f"embed -> decoder layers -> norm -> head layers. {how_to_add()}"
        )
    return base_name, embed, lists[0], norm, rotary, head


def refuse_layer_types(config: Any, kind: str) -> None:
    """UnsupportedModel when the config names a decoder layer type that is not attention."""
    for attr in ("layer_types", "layers_block_type", "block_types", "hybrid_layer_types"):
        types = getattr(config, attr, None)
        if not isinstance(types, (list, tuple)):
            continue
        odd = sorted({str(t) for t in types if str(t) not in ATTENTION_TYPES and str(t) != "attention"})
        if odd:
            recurrent = [t for t in odd if any(h in t.lower() for h in _RECURRENT_HINTS)]
            what = "recurrent / state-space / linear-attention" if recurrent else "non-attention"
            raise UnsupportedModel(
                f"{kind}: config.{attr} has {what} layer types {odd}; roundpipe runs attention decoder "
                f"layers (full or sliding-window) only, so this family is not supported"
            )


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` in a probe of the base forward: records the keyword
    arguments HF passes and returns the hidden states unchanged. Plain attributes of the real layer
    (``attention_type``, ``layer_idx``, ...) read through, since base forwards consult them."""

    def __init__(self, layer: nn.Module, seen: list[dict]):
        super().__init__()
        self.__dict__["_layer_attrs"] = {
            k: v
            for k, v in layer.__dict__.items()
            if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor))
        }
        self.__dict__["_seen"] = seen

    def __getattr__(self, name: str):
        attrs = self.__dict__.get("_layer_attrs", {})
        if name in attrs:
            return attrs[name]
        return super().__getattr__(name)

    def forward(self, hidden_states, *args, **kwargs):
        self._seen.append(kwargs)
        return hidden_states


def probe_layer_kwargs(base: nn.Module, names: dict[str, str | None], config: Any, hidden: int) -> list[dict]:
    """What the base model's forward passes to each decoder layer for eight tokens (module
    docstring), under ``config`` (a copy the caller may have changed)."""
    layers = getattr(base, names["layers"])
    seen: list[dict] = []
    replace = {
        names["layers"]: nn.ModuleList([_Recorder(layer, seen) for layer in layers]),
        names["norm"]: nn.Identity(),
        names["embed"]: _ProbeEmbedding(hidden),
    }
    view = module_view(base, replace)
    view.__dict__["config"] = config
    was = base.training
    view.eval()
    try:
        with torch.no_grad():
            view(input_ids=torch.arange(1, 9)[None], use_cache=False)
    finally:
        view.train(was)
    return seen


def discover_attention_types(
    base: nn.Module, names: dict[str, str | None], config: Any, kind: str
) -> tuple[str, ...]:
    """Per decoder layer, ``FULL`` or ``SLIDING``: the mask HF's own forward hands it."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    probe_config = copy.deepcopy(config)
    probe_config._attn_implementation = "eager"  # masks as tensors (sdpa may pass None for causal)
    if getattr(probe_config, "sliding_window", None) is not None:
        probe_config.sliding_window = 3  # shorter than the probe, so the two masks differ
    hidden = int(config.hidden_size)
    try:
        seen = probe_layer_kwargs(base, names, probe_config, hidden)
    except UnsupportedModel:
        raise
    except Exception as err:
        raise UnsupportedModel(
            f"{kind}: running its base model's forward with the decoder layers stood in for failed "
            f"({type(err).__name__}: {err}); its forward does not follow embed -> layers -> norm. {how_to_add()}"
        ) from err
    n_layers = len(getattr(base, names["layers"]))
    if len(seen) != n_layers:
        raise UnsupportedModel(
            f"{kind}: its base model's forward called {len(seen)} of its {n_layers} decoder layers once "
            f"each; roundpipe runs every layer once, in order. {how_to_add()}"
        )
    dummy = torch.empty(1, 8, 0)
    kw = dict(config=probe_config, inputs_embeds=dummy, attention_mask=None, past_key_values=None,
              position_ids=torch.arange(8)[None])  # fmt: skip
    candidates = {FULL: create_causal_mask(**kw)}
    if getattr(probe_config, "sliding_window", None) is not None:
        candidates[SLIDING] = create_sliding_window_causal_mask(**kw)
    types = []
    for i, kwargs in enumerate(seen):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):  # a mapping by type, as some bases pass it
            raise UnsupportedModel(f"{kind}: decoder layer {i} gets a mapping of masks; {how_to_add()}")
        found = next((t for t, c in candidates.items() if _same_mask(mask, c)), None)
        if found is None:
            raise UnsupportedModel(
                f"{kind}: decoder layer {i} gets an attention mask that is neither HF's causal nor its "
                f"sliding-window mask (chunked, bidirectional or custom attention); not supported"
            )
        types.append(found)
    return tuple(types)


def _same_mask(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.equal(a, b)
    )


def discover_layout(causal_lm: nn.Module) -> ModelLayout:
    """The :class:`ModelLayout` of ``causal_lm`` (module docstring); UnsupportedModel with the reason
    when it cannot be cut into layers."""
    kind = type(causal_lm).__name__
    config = text_config(causal_lm.config)
    refuse_layer_types(config, kind)
    base_name, embed, layers, norm, rotary, head = find_parts(causal_lm)
    base = getattr(causal_lm, base_name)
    names = {"embed": embed, "layers": layers, "norm": norm, "rotary": rotary}
    hidden = int(config.hidden_size)
    types = discover_attention_types(base, names, base.config, kind)
    per_type = False
    if rotary is not None:
        per_type = "layer_type" in inspect.signature(getattr(base, rotary).forward).parameters
    return ModelLayout(
        base=base_name,
        embed=embed,
        layers=layers,
        norm=norm,
        rotary=rotary,
        head=head,
        attention_types=types,
        rotary_per_layer_type=per_type,
        embedding="plain" if embedding_is_plain(base, names, hidden) else "view",
        logits=logits_are_plain(causal_lm, base_name, head, hidden),
    )


def how_to_add() -> str:
    return (
        "roundpipe wraps decoder-only causal LMs whose base model runs embed -> decoder layers "
        "(attention + MLP) -> final norm and whose causal LM applies an LM head; a family that "
        "differs can say how with roundpipe.models.register_family (see roundpipe/models/families.py)"
    )


__all__ = [
    "FULL",
    "SLIDING",
    "ModelLayout",
    "Silent",
    "discover_layout",
    "find_parts",
    "how_to_add",
    "text_config",
]
