"""Finding a causal LM's parts and the facts the layers need, from the model itself.

:func:`discover_layout` reads, for any HF ``*ForCausalLM``:

- **where the parts are**: the base model (``base_model_prefix``), the embedding
  (``get_input_embeddings``), the decoder layers (the base model's ``ModuleList`` of
  ``num_hidden_layers`` modules), the final norm (a child with one of :data:`NORM_NAMES`), the rotary
  module (:data:`ROTARY_NAMES`, if any) and the LM head (``get_output_embeddings``);
- **what each decoder layer is handed**: the base model's own forward is run on eight tokens with
  its layers replaced by recorders (``views.context_view``, what the runtime runs per microbatch
  too). Refused: arguments computed from the hidden states (the view runs on zeros) and cache or
  state objects (they would be shared between microbatches). For the cost model, each layer's
  mask is matched against HF's causal and sliding-window masks under a copy of the config whose
  window is shorter than the probe (``attention_types``);
- **what the family does between the parts** (``views.py``): whether the embedding and the logits
  are plain or need the model's own forward;
- **layers of any type**: attention, sliding-window, linear-attention or state-space layers all
  run whole sequences in training (no state crosses a microbatch), so none is refused by its type;
  what a family cannot do is refused by what it passes its layers, and by the wrap-time probe.

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
from roundpipe.models.views import Silent, context_view, embedding_is_plain, logits_are_plain

FULL = "full_attention"
SLIDING = "sliding_attention"
NORM_NAMES = (
    "norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm", "layer_norm", "layernorm",
    "embedding_norm",  # LFM2 names its final norm so
)  # fmt: skip
ROTARY_NAMES = ("rotary_emb", "rotary_embedding", "rotary_embeddings")


@dataclass(frozen=True)
class ModelLayout:
    """Where a causal LM keeps its parts and how its layers are run (module docstring).

    ``base``: the path from the causal LM to the module holding the decoder (``"model"``, or
    ``"model.decoder"`` for a wrapped decoder); ``embed``, ``layers``, ``norm`` (None: no final
    norm), ``rotary`` (None: no shared rotary module): that module's children; ``head``: the causal LM's
    LM head attribute. ``attention_types[i]``: the mask decoder layer ``i`` gets (``FULL`` or
    ``SLIDING``). ``embedding``: ``"plain"`` (layer 0 gets ``embed(ids)``) or ``"view"``.
    ``logits``: ``"plain"``, ``"softcap"`` or ``"custom"`` (``views.logits_are_plain``).
    """

    base: str
    embed: str
    layers: str
    norm: str | None
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


def find_parts(causal_lm: nn.Module) -> tuple[str, str, str, str | None, str | None, str]:
    """(base, embed, layers, norm, rotary, head) attribute names (``base`` a dotted path from the
    causal LM; ``norm`` None when the base has no final norm), or UnsupportedModel naming what is
    missing."""
    kind = type(causal_lm).__name__
    config = text_config(causal_lm.config)
    base_name = getattr(causal_lm, "base_model_prefix", "") or "model"
    if not isinstance(getattr(causal_lm, base_name, None), nn.Module):  # a text model of a multimodal
        base_name = "model"  # family (Llama 4, Mllama) keeps its prefix but holds its base here
    base = getattr(causal_lm, base_name, None)
    if not isinstance(base, nn.Module) or base is causal_lm:
        raise UnsupportedModel(
            f"{kind} has no base model under {base_name!r} (its base_model_prefix): roundpipe trains "
            f"causal LMs made of a base model (embedding, decoder layers, final norm) and an LM head"
        )
    embedding = causal_lm.get_input_embeddings()
    # A decoder wrapped once more (OPT's model.decoder, BART-style decoder wrappers): descend.
    if _child_name(base, embedding) is None:
        inner = next(
            ((n, m) for n, m in base.named_children() if _child_name(m, embedding) is not None), None
        )
        if inner is not None:
            base_name, base = f"{base_name}.{inner[0]}", inner[1]
    embed = _child_name(base, embedding)
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    # No final norm under a known name: none (the wrap-time probe catches one under another name).
    norm = next((n for n in NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    rotary = next((n for n in ROTARY_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    head = _child_name(causal_lm, causal_lm.get_output_embeddings())
    missing = [
        what
        for what, found in (
            ("an input embedding that is a child of the base model", embed),
            (f"one ModuleList of num_hidden_layers={n_layers} decoder layers", len(lists) == 1),
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


def _probe_inputs(hidden: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0  # left padding, so padding-aware arguments show
    return torch.zeros(2, 8, hidden, dtype=dtype), mask


def _run_context(base: nn.Module, names: dict[str, str | None], config: Any, embeds, mask) -> list:
    view = context_view(base, names)
    view.view.__dict__["config"] = config
    was = base.training
    view.eval()
    try:
        with torch.no_grad():
            return view(embeds, mask, None)
    finally:
        view.train(was)


def _flat(value, path: str):
    """(path, leaf) for every leaf of nested tuples, lists and dicts."""
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _flat(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, value


def check_layer_inputs(base: nn.Module, names: dict[str, str | None], config: Any, kind: str) -> list:
    """What the base forward passes each decoder layer, checked: only tensors and plain values (a
    cache or state object would be shared between microbatches), and none computed from the hidden
    states (the context view runs on zeros). Returns the recorded arguments."""
    hidden = int(config.hidden_size)
    embeds, mask = _probe_inputs(hidden)
    try:
        first = _run_context(base, names, config, embeds, mask)
        second = _run_context(
            base, names, config, torch.randn(embeds.shape, generator=torch.Generator().manual_seed(0)), mask
        )
    except UnsupportedModel:
        raise
    except Exception as err:
        raise UnsupportedModel(
            f"{kind}: running its base model's forward with the decoder layers stood in for failed "
            f"({type(err).__name__}: {err}); its forward does not follow embed -> layers -> norm. {how_to_add()}"
        ) from err
    n_layers = len(getattr(base, names["layers"]))
    if any(x is None for x in first):
        called = sum(x is not None for x in first)
        raise UnsupportedModel(
            f"{kind}: its base model's forward called {called} of its {n_layers} decoder layers; "
            f"roundpipe runs every layer once, in order. {how_to_add()}"
        )
    for i, (a, b) in enumerate(zip(first, second)):
        for (path, x), (_, y) in zip(_flat(a, ""), _flat(b, "")):
            where = f"decoder layer {i}'s argument {path or 'args'}"
            if isinstance(x, torch.Tensor):
                if isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y):
                    continue
                raise UnsupportedModel(
                    f"{kind}: its forward computes {where} from the hidden states; the layers can only "
                    f"be handed arguments that depend on the tokens' positions and mask. Not supported"
                )
            if x is not None and not isinstance(x, (bool, int, float, str)):
                raise UnsupportedModel(
                    f"{kind}: its forward passes {where}, a {type(x).__name__} (a cache or state object "
                    f"even with use_cache=False), which the layer-by-layer run would share between "
                    f"microbatches. Not supported"
                )
    return first


def discover_attention_types(base: nn.Module, names: dict[str, str | None], config: Any) -> tuple[str, ...]:
    """Per decoder layer, ``FULL``, ``SLIDING`` or ``"other"``: the mask HF's own forward hands it,
    found under a copy of the config with eager masks and (if any) a window of 3 tokens."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    probe_config = copy.deepcopy(config)
    probe_config._attn_implementation = "eager"  # masks as tensors (sdpa may pass None for causal)
    if getattr(probe_config, "sliding_window", None) is not None:
        probe_config.sliding_window = 3  # shorter than the probe, so the two masks differ
    embeds = torch.zeros(1, 8, int(config.hidden_size))
    try:
        seen = _run_context(base, names, probe_config, embeds, None)
    except Exception:  # the family refuses the eager probe: nothing to say about its masks
        return tuple("other" for _ in getattr(base, names["layers"]))
    kw = dict(config=probe_config, inputs_embeds=embeds[..., :0], attention_mask=None, past_key_values=None,
              position_ids=torch.arange(8)[None])  # fmt: skip
    candidates = {FULL: create_causal_mask(**kw)}
    if getattr(probe_config, "sliding_window", None) is not None:
        candidates[SLIDING] = create_sliding_window_causal_mask(**kw)
    types = []
    for recorded in seen:
        mask = None if recorded is None else recorded[1].get("attention_mask")
        types.append(next((t for t, c in candidates.items() if _same_mask(mask, c)), "other"))
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
    base_name, embed, layers, norm, rotary, head = find_parts(causal_lm)
    base = causal_lm.get_submodule(base_name)
    names = {"embed": embed, "layers": layers, "norm": norm, "rotary": rotary}
    hidden = int(config.hidden_size)
    check_layer_inputs(base, names, base.config, kind)
    types = discover_attention_types(base, names, base.config)
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
