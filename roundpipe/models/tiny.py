"""Shrink any Hugging Face causal-LM config into a tiny config of the same class.

Why: roundpipe checks a huge model's code path at wrap time on a tiny model of the same config class,
and ``benchmarks/model_coverage.py`` walks every causal-LM family of the installed transformers. Both
need a config that builds a model of well under 5M parameters which runs forward + backward on a CPU
in milliseconds, yet keeps what makes the family what it is: its config class, its kinds of layer
(sliding / full attention, dense / MoE, attention / SSM, per-layer overrides), grouped-query
attention, MLA, shared experts, partial rotary embeddings.

How: ``config.to_dict()`` is shrunk level by level (the config, each nested text / vision / audio
config, each per-layer override) by rules keyed on attribute *names*, after HF's ``attribute_map``
has turned a family's own names (``n_embd``, ``n_head``, ``d_model`` ...) into the canonical ones.
The result is rebuilt with ``type(config).from_dict`` so the family's ``__post_init__`` and
validators run: they re-derive whatever depends on the shrunk sizes (read-only properties such as
Mamba's ``layer_types`` are computed from the fields, never set) and reject an inconsistent result
early, which surfaces as :class:`~roundpipe.errors.ConfigError`.

Layers are not simply truncated: each original layer has features (its entry in every per-layer
list, its membership in every list of layer indices, its side of a leading dense block, its
per-layer override) and the layers kept are picked to show as many distinct features as possible,
so a tiny Gemma-3 keeps one sliding and one full layer and a tiny DeepSeek-V3 one dense and one MoE
layer. The few families whose structure no name rule can read are in ``tiny_fixes._QUIRKS``, each
with why. transformers is imported lazily, so importing this module stays cheap.

This module walks the config tree and runs the whole-config passes (token ids, pad token, rebuild);
a level's sizes and the layers kept are read in ``tiny_level.py``, each field is shrunk by the rules
of ``tiny_rules.py``, and the fields that must agree are made to in ``tiny_fixes.py``.
"""

from __future__ import annotations

import re
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.models.tiny_fixes import FIXES
from roundpipe.models.tiny_level import (
    Level,
    Sizes,
    as_int,
    is_config,
    make_level,
    overrides_by_layer,
    read_attr,
)
from roundpipe.models.tiny_rules import shrink_list, shrink_scalar

__all__ = ["tiny_config"]


def tiny_config(config, *, hidden=64, layers=2, heads=4, kv_heads=2, experts=4, vocab=512):
    """A shrunk deep copy of ``config`` (any causal-LM family): same class, a model of well under 5M
    parameters. ``config`` itself is never modified.

    Raises :class:`~roundpipe.errors.ConfigError` when the sizes asked for are inconsistent, when
    ``config`` is not a ``PreTrainedConfig`` or has no size to shrink, or when the family rejects the
    shrunk values.
    """
    sizes = _check_sizes(hidden, layers, heads, kv_heads, experts, vocab)
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise ConfigError(
            f"tiny_config needs a transformers PretrainedConfig, got {type(config).__name__}; pass "
            f"model.config or AutoConfig.from_pretrained(...)."
        )
    if not _has_sizes(config):
        raise ConfigError(
            f"tiny_config found no hidden size or layer count in {type(config).__name__} (model_type "
            f"{config.model_type!r}), so there is nothing to shrink; give a causal-LM config."
        )
    shrunk = _shrink_level(config.to_dict(), config, sizes, _tree_hiddens(config))
    _remap_token_ids(shrunk, sizes.vocab)
    _add_pad_token(shrunk, config)
    return _rebuild(type(config), shrunk, config)


def _check_sizes(hidden, layers, heads, kv_heads, experts, vocab) -> Sizes:
    """Reject target sizes no family could use, before touching the config."""
    for name, value in dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, experts=experts, vocab=vocab
    ).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"tiny_config: {name} must be a positive int, got {value!r}.")
    if hidden % heads or (hidden // heads) % 2:
        raise ConfigError(
            f"tiny_config: hidden ({hidden}) must split into {heads} heads of an even size (rotary "
            f"embeddings rotate pairs); pick hidden as a multiple of 2 * heads."
        )
    if heads % kv_heads:
        raise ConfigError(f"tiny_config: heads ({heads}) must be a multiple of kv_heads ({kv_heads}).")
    if vocab < 64:
        raise ConfigError(
            f"tiny_config: vocab ({vocab}) must be at least 64 to leave room for special tokens."
        )
    return Sizes(hidden, layers, heads, kv_heads, experts, vocab)


def _has_sizes(config) -> bool:
    """Whether any level of the config tree has a hidden size or a layer count to shrink."""
    todo = [config]
    while todo:
        cfg = todo.pop()
        if any(as_int(read_attr(cfg, name)) for name in ("hidden_size", "num_hidden_layers")):
            return True
        todo += [v for v in vars(cfg).values() if is_config(v)]
    return False


def _shrink_level(data: dict, obj, sizes: Sizes, tree_hiddens: frozenset[int]) -> dict:
    """Shrink one config level's dict (``obj`` is the matching config object, for its class and the
    values its properties derive)."""
    level = make_level(data, obj, sizes, tree_hiddens)
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = read_attr(obj, key)
        if isinstance(value, dict) and is_config(sub):
            out[key] = _shrink_level(value, sub, sizes, tree_hiddens)
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = _shrink_overrides(value, obj, level)
        elif key in ("rope_parameters", "rope_scaling"):
            out[key] = value  # once the head sizes are known, in tiny_fixes._fix_rope_dicts
        elif isinstance(value, list):
            out[key] = shrink_list(key, value, level)
        else:
            out[key] = shrink_scalar(key, value, level)
    for fix in FIXES:
        fix(out, level)
    _drop_read_only(out, type(obj))
    return out


def _drop_read_only(out: dict, cls) -> None:
    """A field the class exposes as a property without a setter is derived from other fields; it
    cannot be passed back in (configs saved by older versions sometimes carry one)."""
    for key in list(out):
        prop = getattr(cls, key, None)
        if isinstance(prop, property) and prop.fset is None:
            del out[key]


def _tree_hiddens(config) -> frozenset[int]:
    """The original hidden sizes of a config and all its nested configs: a field of one level that
    holds another level's hidden size (blt's hidden_size_global, a vision tower's output width)
    shrinks to the new hidden size, not by its ratio to its own level's."""
    found, todo = set(), [config]
    while todo:
        cfg = todo.pop()
        if (hidden := as_int(read_attr(cfg, "hidden_size"))) is not None:
            found.add(hidden)
        todo += [v for v in vars(cfg).values() if is_config(v)]
    return frozenset(found)


def _shrink_overrides(per_layer: dict, obj, level: Level) -> dict:
    """Keep the overrides of the kept layers, renumbered. Each is shrunk as the whole level would
    be with the override applied, so that its fields stay consistent with each other (an override
    with as many kv heads as heads stays multi-head, its MLA dims add up)."""
    by_layer = overrides_by_layer(per_layer)
    base = {k: v for k, v in level.values.items() if k != "per_layer_config"}
    out = {}
    for new, old in enumerate(level.kept):
        if old in by_layer:
            shrunk = _shrink_level({**base, **by_layer[old]}, obj, level.sizes, level.tree_hiddens)
            out[str(new)] = {k: shrunk[k] for k in by_layer[old] if k in shrunk}
    return out


# --------------------------------------------------------------------------------------------------
# Whole-config passes and the rebuild.

_TOKEN_KEY = re.compile(r"_token_ids?$|_token_index$|^(begin_)?suppress_tokens$")


def _token_fields(data: dict):
    """Yield (dict, key) for every token-id field in the config tree."""
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("id2label", "label2id"):
            yield from _token_fields(value)
        elif _TOKEN_KEY.search(key):
            yield data, key


def _remap_token_ids(data: dict, vocab: int) -> None:
    """Token ids the shrunk vocabulary cannot hold move to its top, in their original order, the same
    id to the same place everywhere in the tree (a composite config repeats its image token)."""
    big = set()
    for d, key in _token_fields(data):
        for tid in _ids(d[key]):
            if tid >= vocab:
                big.add(tid)
    mapping = {tid: vocab - len(big) + rank for rank, tid in enumerate(sorted(big))}
    for d, key in _token_fields(data):
        value = d[key]
        if isinstance(value, list):
            d[key] = [mapping.get(v, v) if as_int(v) is not None else v for v in value]
        elif as_int(value) is not None:
            d[key] = mapping.get(value, value)


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if as_int(v) is not None]


def _add_pad_token(data: dict, config) -> None:
    """A text config without any ``pad_token_id`` field gets one (some model code reads it); a
    field that is present stays as it is, ``None`` included, since a pad id changes the embedding
    (its row is a frozen padding row)."""
    try:
        text = config.get_text_config(decoder=True)
    except ValueError:
        return
    if text is config:
        target = data
    else:
        target = next(
            (data[k] for k in data if read_attr(config, k) is text and isinstance(data[k], dict)), None
        )
    if (
        target is not None
        and "pad_token_id" not in target
        and read_attr(text, "pad_token_id", "absent") == "absent"
    ):
        eos = target.get("eos_token_id")
        target["pad_token_id"] = eos if isinstance(eos, int) else 0


def _rebuild(cls, data: dict, original):
    """Build the shrunk config through the class itself, so its post-init derives and validates."""
    try:
        tiny = cls.from_dict(data)
    except Exception as exc:  # the family's own validators: report which config and why
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # HF's validation errors introduce the reason on a line of its own ("...validator 'x':").
        why = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
        raise ConfigError(
            f"tiny_config could not shrink {cls.__name__} (model_type {original.model_type!r}): "
            f"{type(exc).__name__}: {why[:300]}"
        ) from exc
    implementation = getattr(original, "_attn_implementation", None)
    if implementation is not None:
        tiny._attn_implementation = implementation
    return tiny
