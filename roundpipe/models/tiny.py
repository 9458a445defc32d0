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
layer. The few families whose structure no name rule can read are in ``_QUIRKS``, each with why.
transformers is imported lazily, so importing this module stays cheap.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import ConfigError

__all__ = ["tiny_config"]

# Learned position tables are capped here (but never below 64, so short test batches always fit).
_MAX_POSITIONS = 256
_MIN_POSITIONS = 64
# Sliding windows, attention chunks, SSM scan chunks and sparse-attention top-k shrink to this,
# below a 16-token test sequence, so the windowed / chunked / sparse code path really runs.
_WINDOW = 8
_SSM_STATE = 16


@dataclass(frozen=True)
class _Sizes:
    """The target sizes, and the few derived from them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def intermediate(self) -> int:
        return 2 * self.hidden

    @property
    def expert_intermediate(self) -> int:
        return max(8, self.hidden // 2)

    @property
    def rank(self) -> int:
        """Low-rank bottlenecks (MLA's q/kv LoRA ranks, adapters): half the hidden size."""
        return max(8, self.hidden // 2)

    @property
    def top_k(self) -> int:
        return max(1, self.experts // 2)


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


def _check_sizes(hidden, layers, heads, kv_heads, experts, vocab) -> _Sizes:
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
    return _Sizes(hidden, layers, heads, kv_heads, experts, vocab)


def _has_sizes(config) -> bool:
    """Whether any level of the config tree has a hidden size or a layer count to shrink."""
    todo = [config]
    while todo:
        cfg = todo.pop()
        if any(_as_int(_read(cfg, name)) for name in ("hidden_size", "num_hidden_layers")):
            return True
        todo += [v for v in vars(cfg).values() if _is_config(v)]
    return False


def _read(obj, name: str, default=None):
    """``getattr`` that neither raises for per-layer attributes of heterogeneous configs nor for
    properties that fail on a partially filled config."""
    getter = getattr(obj, "_getattr_without_heterogeneous_validation", None)
    try:
        if getter is not None:
            return getter(name, default)
        return getattr(obj, name, default)
    except Exception:
        return default


# --------------------------------------------------------------------------------------------------
# One level: a config's own fields, then its nested configs and per-layer overrides.


@dataclass
class _Level:
    """What the rules of one config level need: the target sizes, the level's original sizes, the
    original hidden sizes of every level of the tree, and the layers kept."""

    sizes: _Sizes
    canonical: dict[str, str]  # the level's field name -> HF's canonical name
    hidden: int | None
    heads: int | None
    head_dim: int | None
    layers: int | None
    max_positions: int | None
    kept: list[int]  # original indices of the layers kept, in order
    values: dict[str, Any]  # the level's original fields
    tree_hiddens: frozenset[int]

    def name(self, key: str) -> str:
        return self.canonical.get(key, key)


def _shrink_level(data: dict, obj, sizes: _Sizes, tree_hiddens: frozenset[int]) -> dict:
    """Shrink one config level's dict (``obj`` is the matching config object, for its class and the
    values its properties derive)."""
    level = _make_level(data, obj, sizes, tree_hiddens)
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = _read(obj, key)
        if isinstance(value, dict) and _is_config(sub):
            out[key] = _shrink_level(value, sub, sizes, tree_hiddens)
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = _shrink_overrides(value, obj, level)
        elif key in ("rope_parameters", "rope_scaling"):
            out[key] = value  # once the head sizes are known, in _fix_rope_dicts
        elif isinstance(value, list):
            out[key] = _shrink_list(key, value, level)
        else:
            out[key] = _shrink_scalar(key, value, level)
    for fix in _FIXES:
        fix(out, level)
    _drop_read_only(out, type(obj))
    return out


def _is_config(value) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _tree_hiddens(config) -> frozenset[int]:
    """The original hidden sizes of a config and all its nested configs: a field of one level that
    holds another level's hidden size (blt's hidden_size_global, a vision tower's output width)
    shrinks to the new hidden size, not by its ratio to its own level's."""
    found, todo = set(), [config]
    while todo:
        cfg = todo.pop()
        if (hidden := _as_int(_read(cfg, "hidden_size"))) is not None:
            found.add(hidden)
        todo += [v for v in vars(cfg).values() if _is_config(v)]
    return frozenset(found)


def _make_level(data: dict, obj, sizes: _Sizes, tree_hiddens: frozenset[int]) -> _Level:
    """Read the level's original sizes (from ``data`` first: for a per-layer override it differs from
    the object's) and choose which of its layers to keep."""
    attribute_map = type(obj).attribute_map

    def original(name):
        value = data.get(attribute_map.get(name, name))
        return _as_int(value if value is not None else _read(obj, name))

    hidden, heads = original("hidden_size"), original("num_attention_heads")
    head_dim = original("head_dim") or (hidden // heads if hidden and heads else None)
    layers = original("num_hidden_layers") or _layer_count_from_lists(data)
    canonical = {real: canon for canon, real in attribute_map.items()}
    positions = original("max_position_embeddings")
    level = _Level(sizes, canonical, hidden, heads, head_dim, layers, positions, [], data, tree_hiddens)
    level.kept = _choose_layers(data, level) if layers else []
    return level


def _as_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Lists with one entry per layer, whatever their length says (some families derive the layer count
# from them, nemotron_h; others repeat them cyclically, recurrent_gemma's block_types).
_LAYER_KIND_LISTS = re.compile(r"(^|_)(layer_types|layers_block_type|block_types|attn_layers|indexer_types)$")
# Lists of layer indices.
_INDEX_LISTS = re.compile(r"(layers|idxs|indexes|indices|layer_ids)$")


def _layer_count_from_lists(data: dict) -> int | None:
    """The layer count of a family that has no num_hidden_layers field (it derives it from a list)."""
    for key, value in data.items():
        if _LAYER_KIND_LISTS.search(key) and isinstance(value, list) and value:
            return len(value)
    return None


def _per_layer_keys(data: dict, n: int) -> list[str]:
    """The keys of lists with exactly one scalar entry per original layer."""
    keys = []
    for key, value in data.items():
        if not isinstance(value, list) or len(value) != n or not all(_is_scalar(v) for v in value):
            continue
        if _INDEX_LISTS.search(key) and _is_index_list(value, n) and not _LAYER_KIND_LISTS.search(key):
            continue
        if _LAYER_KIND_LISTS.search(key) or re.search(r"layer|block|type|pattern|heads|rope", key) or n >= 8:
            keys.append(key)
    return keys


def _index_list_keys(data: dict, n: int) -> list[str]:
    """The keys of lists of layer indices (mllama's cross_attention_layers, flint's mlp_only_layers)."""
    return [
        key
        for key, value in data.items()
        if _INDEX_LISTS.search(key)
        and not _LAYER_KIND_LISTS.search(key)
        and isinstance(value, list)
        and _is_index_list(value, n)
    ]


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _is_index_list(value: list, n: int) -> bool:
    """Strictly increasing ints below ``n``: a set of layer indices, not a per-layer flag list."""
    ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return len(ints) == len(value) and all(0 <= v < n for v in ints) and ints == sorted(set(ints))


# Fields that count the first layers of some kind (a leading dense block, the layers before the
# sliding-window ones): each layer's side of the boundary is part of its signature.
_LEADING_COUNTS = ("first_k_dense_replace", "num_dense_layers", "n_dense_layers", "max_window_layers")
# Fields that count the last layers of some kind (Gemma-3n's layers reusing earlier layers' KV).
# Not a feature in _choose_layers: a kept KV-sharing layer needs a kept producer of its own kind.
_TRAILING_COUNTS = ("num_kv_shared_layers",)


def _choose_layers(data: dict, level: _Level) -> list[int]:
    """The original indices of the layers to keep, in order.

    Each layer has features: its entry in every per-layer list, its membership in every list of
    layer indices, its side of every leading-block boundary, its per-layer override. Layers are
    picked greedily, each time the one showing the most features not yet shown (the earliest on a
    tie), so two layers cover sliding + full *and* dense + MoE where one layer of each exists.
    """
    n, want = level.layers, level.sizes.layers
    if n <= want:
        return list(range(n))
    lists = [data[k] for k in _per_layer_keys(data, n)]
    index_sets = [set(data[k]) for k in _index_list_keys(data, n)]
    overrides = _overrides_by_layer(data.get("per_layer_config"))
    leading = [v for k in _LEADING_COUNTS if isinstance(v := data.get(k), int) and 0 < v < n]
    features = [
        {("list", j, repr(lst[i])) for j, lst in enumerate(lists)}
        | {("index", j, i in s) for j, s in enumerate(index_sets)}
        | {("leading", j, i < v) for j, v in enumerate(leading)}
        | {("override", repr(sorted(overrides.get(i, {}).items())))}
        for i in range(n)
    ]
    kept: list[int] = []
    shown: set = set()
    while len(kept) < want:
        best = max((i for i in range(n) if i not in kept), key=lambda i: (len(features[i] - shown), -i))
        kept.append(best)
        shown |= features[best]
    return sorted(kept)


def _overrides_by_layer(per_layer) -> dict[int, dict]:
    """A heterogeneous config's ``per_layer_config`` ({"07": {...}}) keyed by int layer index."""
    if not isinstance(per_layer, dict):
        return {}
    return {int(k): v for k, v in per_layer.items() if str(k).isdigit() and isinstance(v, dict)}


def _shrink_overrides(per_layer: dict, obj, level: _Level) -> dict:
    """Keep the overrides of the kept layers, renumbered. Each is shrunk as the whole level would
    be with the override applied, so that its fields stay consistent with each other (an override
    with as many kv heads as heads stays multi-head, its MLA dims add up)."""
    by_layer = _overrides_by_layer(per_layer)
    base = {k: v for k, v in level.values.items() if k != "per_layer_config"}
    out = {}
    for new, old in enumerate(level.kept):
        if old in by_layer:
            shrunk = _shrink_level({**base, **by_layer[old]}, obj, level.sizes, level.tree_hiddens)
            out[str(new)] = {k: shrunk[k] for k in by_layer[old] if k in shrunk}
    return out


def _shrink_list(key: str, value: list, level: _Level):
    """Per-layer lists keep the kept layers' entries, index lists are renumbered, patterns keep one
    of each kind; any other list is left alone (a value list such as ``time_step_limit``)."""
    n = level.layers
    if n and len(value) == n and key in _per_layer_keys(level.values, n):
        picked = [value[i] for i in level.kept] if n > level.sizes.layers else list(value)
        return [_shrink_scalar(_singular(key), v, level) for v in picked]
    if n and key in _index_list_keys(level.values, n):
        return _remap_indices(value, level)
    if _LAYER_KIND_LISTS.search(key) and all(_is_scalar(v) for v in value):
        return _one_of_each(value, level.sizes.layers)
    return value


def _singular(key: str) -> str:
    """The scalar field a per-layer list holds (``num_attention_heads_per_layer`` -> ``..._heads``)."""
    return re.sub(r"_per_layer$", "", key)


def _remap_indices(value: list, level: _Level) -> list[int]:
    """Renumber a list of layer indices onto the kept layers; keep at least one entry when the
    original had any, so that the listed kind of layer still occurs."""
    wanted = set(value)
    out = [new for new, old in enumerate(level.kept) if old in wanted]
    if value and not out:
        out = [len(level.kept) - 1]
    return out


def _one_of_each(pattern: list, size: int) -> list:
    """A cyclic pattern (or a per-layer list of its own length) cut to ``size`` entries: the first
    of each distinct entry, then the earliest others, in their original order."""
    firsts = [i for i, v in enumerate(pattern) if v not in pattern[:i]][:size]
    firsts += [i for i in range(len(pattern)) if i not in firsts][: size - len(firsts)]
    return [pattern[i] for i in sorted(firsts)]


# --------------------------------------------------------------------------------------------------
# Scalar rules: (pattern on the canonical name, rule). The first match wins, so the specific ones
# come first.


def _shrink_scalar(key: str, value, level: _Level):
    """Apply the first rule whose pattern matches the field's canonical (or own) name."""
    if value is None:
        return _fill_none(level.name(key), level)
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    for name in dict.fromkeys((level.name(key), key)):
        for pattern, rule in _RULES:
            if pattern.search(name):
                return rule(name, value, level)
    return value


def _fill_none(name: str, level: _Level):
    """A size left ``None`` that the family's modelling code reads as a number (several default
    configs, e.g. ministral's head_dim or nemotron's kv heads) gets the value ``None`` stands for:
    head_dim = hidden / heads, kv heads = heads, and the target top-k for routed experts."""
    if name == "head_dim":
        return level.sizes.head_dim
    if name == "num_key_value_heads" and level.heads:
        return level.sizes.heads
    if name == "num_experts_per_tok":
        return level.sizes.top_k
    return None


def _keep(name, value, level):
    """Left as it is here; a whole-config pass or a consistency fix sets it."""
    return value


def _positions(name, value, level):
    """Learned position tables stay small, yet hold a 64-token batch."""
    return max(_MIN_POSITIONS, min(value, _MAX_POSITIONS)) if value > 0 else value


def _original_positions(name, value, level):
    """The pre-extension context of a long-context rope (longrope, yarn, llama3) keeps its ratio to
    the maximum, so the tiny model still runs past it and takes the scaled path."""
    old = level.max_positions
    if not old or value <= 0:
        return min(value, _MAX_POSITIONS)
    return max(1, round(value * _positions("", old, level) / old))


def _vocab(name, value, level):
    """Every vocabulary (token, type, codebook, hashed n-gram) shrinks to the target vocabulary."""
    return min(value, level.sizes.vocab)


def _leading_count(name, value, level):
    """How many kept layers lie before the boundary (see _choose_layers)."""
    return sum(i < value for i in level.kept) if level.kept else value


def _trailing_count(name, value, level):
    """How many kept layers lie in the trailing block (see _TRAILING_COUNTS)."""
    n = level.layers or 0
    return sum(i >= n - value for i in level.kept) if level.kept and value > 0 else value


def _end_index(name, value, level):
    """A last-layer index (ernie's moe_layer_end_index): the last kept layer at or before it."""
    inside = [new for new, old in enumerate(level.kept) if old <= value]
    return inside[-1] if inside else value


def _period(name, value, level):
    """A period no longer than the layers kept, so the periodic kind of layer still occurs."""
    return min(value, level.sizes.layers) if value > 0 else value


def _layer_count(name, value, level):
    """Any stack of blocks (decoder, encoder, vision tower) gets the target layer count."""
    return min(value, level.sizes.layers) if value > 0 else value


def _kv_heads(name, value, level):
    """Multi-head stays multi-head, multi-query stays multi-query, anything between becomes GQA."""
    heads, s = level.heads, level.sizes
    if value <= 1:
        return value
    if heads is not None and value >= heads:
        return s.heads
    return min(s.kv_heads, s.heads)


def _heads(name, value, level):
    """Attention, linear-attention, SSM and indexer heads alike: at most the target heads."""
    return min(value, level.sizes.heads) if value > 0 else value


def _head_dim(name, value, level):
    """hidden / heads, or a whole multiple of it where the family's head is such a multiple
    (zamba2's attention concatenates the embeddings to the hidden state: twice the width; up to
    4x, a larger head would dominate the tiny model)."""
    if value <= 0:
        return value
    ratio = value * level.heads / level.hidden if level.hidden and level.heads else 1
    multiple = round(ratio) if 2 <= ratio <= 4 and abs(ratio - round(ratio)) < 1e-9 else 1
    return level.sizes.head_dim * multiple


def _rank(name, value, level):
    """Low-rank bottlenecks stay bottlenecks: at most half the target hidden size."""
    return min(value, level.sizes.rank) if value > 0 else value


def _rotary_dim(name, value, level):
    """The same fraction of the (new) head as before, in whole pairs."""
    old = level.head_dim or value
    return max(2, 2 * round(level.sizes.head_dim * value / old / 2))


def _intermediate(name, value, level):
    """MLP widths: twice the hidden size, a quarter of that for an expert (there are several);
    a 0 (no shared expert) stays 0."""
    if value <= 0:
        return value
    if re.search(r"moe|expert|shared", name):
        return level.sizes.expert_intermediate
    return level.sizes.intermediate


def _experts(name, value, level):
    """At most the target number of routed experts."""
    return min(value, level.sizes.experts) if value > 0 else value


def _top_k(name, value, level):
    """Route to half the experts, so routing still chooses."""
    return min(value, level.sizes.top_k) if value > 0 else value


def _shared_experts(name, value, level):
    """One shared expert is enough to run the shared path."""
    return min(value, 1)


def _window(name, value, level):
    """Windows and chunks below a 16-token batch (see _WINDOW); 0 / None (no window) stays."""
    return min(value, _WINDOW) if value > 0 else value


def _ssm_state(name, value, level):
    """SSM state sizes: small, the scan is the same code at any size."""
    return min(value, _SSM_STATE) if value > 0 else value


def _dt_rank(name, value, level):
    """Mamba's time-step rank: what its "auto" gives for the new hidden size."""
    return min(value, max(1, math.ceil(level.sizes.hidden / 16))) if value > 0 else value


def _multiple_of(name, value, level):
    """Rounding granularities small enough not to undo the shrink."""
    return min(value, 16) if value > 0 else value


def _other_width(name, value, level):
    """Any other ``*_size`` field holding one of the tree's hidden sizes is that hidden size under
    another name (dots3's adapter_input_size, checked against its config's hidden_size)."""
    return level.sizes.hidden if value in level.tree_hiddens else value


def _hidden(name, value, level):
    """Another level's hidden size becomes the new hidden size (dots3's audio adapter feeds the text
    model). A width that is a whole multiple or fraction of the level's hidden size keeps that ratio to
    the new one (zamba2's attention is twice as wide, electra's embeddings half as wide); any other
    shrinks to the new hidden size, and a smaller one (a 3-channel image, a 4-channel latent) stays."""
    old, new = level.hidden, level.sizes.hidden
    if value in level.tree_hiddens:
        return new
    if old and value >= old and value % old == 0:
        return value // old * new
    if old and value < old and old % value == 0 and new % (old // value) == 0 and new // (old // value) >= 8:
        return new // (old // value)
    return min(value, new)


_RULES = [
    (re.compile(p), rule)
    for p, rule in [
        # Layer counts and indices first: some of their names end like token indices.
        (rf"^({'|'.join(_LEADING_COUNTS)}|moe_layer_start_index)$", _leading_count),
        (rf"^({'|'.join(_TRAILING_COUNTS)})$", _trailing_count),
        (r"^moe_layer_end_index$", _end_index),
        # Token ids are remapped over the whole config at once (_remap_token_ids).
        (r"_token_ids?$|_token_index$|^lang_id$|_index$|_idx$", _keep),
        (r"^original_max_position_embeddings$", _original_positions),
        (
            r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|"
            r"max_target_positions|max_source_positions|context_length)$",
            _positions,
        ),
        # Rounding granularities (lfm2 rounds its MLP up to a multiple of 256, which would undo it).
        (r"divisible_by$|multiple_of$", _multiple_of),
        (r"vocab|^codebook_size$", _vocab),
        # Periods and strides of periodic layer kinds (jamba's attention every 8th layer).
        (
            r"(_layer_period|_every_n_layers|_layer_interval|layer_interval|_sparse_step|_moe_layer_step|"
            r"sliding_window_pattern|^layer_group_size|_layers_per_attn_res_block)$",
            _period,
        ),
        (r"_layer_offset$", _keep),  # after the periods (_fix_periods)
        (r"(^|_)layers?$|^depth$|^num_blocks$|_layers_per_stack$", _layer_count),
        (r"(key_value_heads|kv_heads|kv_n_heads|^num_query_groups|num_key_heads)$", _kv_heads),
        (r"(attention_heads|(^|_)n_heads?$|(^|_)num_heads$|_n_heads$|value_heads$|heads_per_ngram$)", _heads),
        (r"^(q_lora_rank|kv_lora_rank|o_lora_rank)$", _rank),
        (r"^(qk_rope_head_dim|qk_nope_head_dim|qk_head_dim)$", _keep),  # _fix_mla
        (r"^rotary_dim$", _rotary_dim),
        (r"head_dim$|^d_head$|^d_kv$|^dim_head$|head_size$|^kv_channels$|_d_head$|_headdim$", _head_dim),
        (
            r"(intermediate_size|ffn_dim$|^d_ff$|^dff$|^dim_ff$|^d_inner$|ffn_hidden_size$|^mlp_dim$|"
            r"feed_forward_size$|^n_inner$|_ffn_size$)",
            _intermediate,
        ),
        # Routed experts (longcat's zero experts are routed too), the top-k, the shared ones.
        (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|zero_expert_num)$", _experts),
        (r"(experts_per_tok(en)?|^moe_k$|^moe_top_?k$|^top_k$)$", _top_k),
        (r"(n_shared_experts|num_shared_experts)$", _shared_experts),
        (
            r"(sliding_window(_size)?|attention_window_size|^local_attention$|^window_size$|"
            r"attention_chunk_size|keep_window_size|window_len|chunk_length|^(mamba_)?chunk_size|^index_topk)$",
            _window,
        ),
        (r"(state_size|d_state)$", _ssm_state),
        (r"(time_step_rank|dt_rank)$", _dt_rank),
        (r"(_rank|lowrank)$", _rank),  # adapters and low-rank mixers (zamba2, gemma3n's laurel)
        # Widths last: every *_dim / *_channels / *_width the rules above did not claim.
        (
            r"(hidden_size|hidden_dim|^d_model$|^n_embd$|emb_dim$|embed_dim$|embedding_dim$|embedding_size$|"
            r"_width$|^dim$|_dim$|_channels?$)",
            _hidden,
        ),
        (r"(_size|_dimension)$", _other_width),
    ]
]


# --------------------------------------------------------------------------------------------------
# Consistency between fields, once each has been shrunk on its own.


def _fix_periods(out: dict, level: _Level) -> None:
    """An offset within a period (jamba's attn_layer_offset) must stay below the shrunk period, so
    that the periodic kind of layer still occurs."""
    for key, value in list(out.items()):
        if not (key.endswith("_offset") and isinstance(value, int)) or isinstance(value, bool):
            continue
        period = out.get(key.replace("_offset", "_period"))
        if isinstance(period, int) and period > 0:
            out[key] = min(value, period - 1)


def _fix_mla(out: dict, level: _Level) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3 and kin): the query / key head is a no-rope part
    plus a rope part, and the value head has a size of its own. A family whose qk_rope_head_dim is
    only the rotated share of an ordinary head (deepseek_v4: head_dim * partial_rotary_factor)
    keeps that relation instead."""
    if not isinstance(out.get("qk_rope_head_dim"), int):
        return
    d = level.sizes.head_dim
    if "qk_nope_head_dim" not in out and isinstance(out.get("head_dim"), int):
        factor = out.get("partial_rotary_factor")
        share = factor if isinstance(factor, float) else level.values["qk_rope_head_dim"] / level.head_dim
        out["qk_rope_head_dim"] = max(2, 2 * round(out["head_dim"] * share / 2))
        return
    rope = out["qk_rope_head_dim"] = d // 2 if out["qk_rope_head_dim"] else 0
    if isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_nope_head_dim"] = d - rope if out["qk_nope_head_dim"] else 0
    if isinstance(out.get("qk_head_dim"), int):
        out["qk_head_dim"] = (out.get("qk_nope_head_dim") or 0) + rope
    if isinstance(out.get("v_head_dim"), int):
        out["v_head_dim"] = d
    if isinstance(out.get("head_dim"), int) and level.values.get("head_dim") == level.values.get(
        "qk_rope_head_dim"
    ):
        out["head_dim"] = rope  # families whose head_dim names the rotary part


# SSM fields, by family naming: (heads, head size, expansion, inner width, groups).
_SSM_HEADS = ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
_SSM_HEAD_DIM = ("mamba_head_dim", "mamba_d_head", "mamba_headdim")
_SSM_EXPAND = ("mamba_expand", "expand")
_SSM_GROUPS = ("mamba_n_groups", "mamba_ngroups", "n_groups")


def _fix_ssm(out: dict, level: _Level) -> None:
    """Mamba-2 style mixers split ``expand * hidden`` channels into heads of one size, in groups that
    divide the heads: recompute heads from the shrunk widths."""
    heads_key = _first_key(out, _SSM_HEADS) or ("num_heads" if "state_size" in out else None)
    dim_key = _first_key(out, _SSM_HEAD_DIM) or ("head_dim" if heads_key == "num_heads" else None)
    expand = next((out[k] for k in _SSM_EXPAND if isinstance(out.get(k), (int, float))), None)
    if heads_key is None or expand is None:
        return
    inner = int(expand * level.sizes.hidden)
    if _as_int(out.get("mamba_d_ssm")):  # falcon_h1 states the inner width too
        out["mamba_d_ssm"] = inner
    head_dim = level.sizes.head_dim
    if inner % head_dim:
        head_dim = math.gcd(inner, head_dim)
    if dim_key is not None:
        out[dim_key] = head_dim
    out[heads_key] = inner // head_dim
    groups_key = _first_key(out, _SSM_GROUPS)
    if groups_key is not None and isinstance(out[groups_key], int):
        out[groups_key] = max(g for g in range(1, min(out[groups_key], 2) + 1) if out[heads_key] % g == 0)


def _first_key(out: dict, names) -> str | None:
    return next((k for k in names if isinstance(out.get(k), int) and not isinstance(out.get(k), bool)), None)


def _fix_expert_groups(out: dict, level: _Level) -> None:
    """Group-limited routing (DeepSeek-V3's n_group / topk_group): the experts split evenly into
    groups, and the experts routed to fit in the groups selected."""
    group_key = _first_key(out, ("n_group", "num_expert_group"))
    experts = next(
        (
            out[k]
            for k in ("n_routed_experts", "num_experts", "num_local_experts")
            if isinstance(out.get(k), int)
        ),
        None,
    )
    if group_key is None or not experts:
        return
    old_groups = out[group_key]
    groups = max(g for g in range(1, min(old_groups, 2) + 1) if experts % g == 0)
    out[group_key] = groups
    if isinstance(out.get("topk_group"), int) and old_groups:
        out["topk_group"] = max(1, min(groups, groups * out["topk_group"] // old_groups))
        per_group = experts // groups
        top_key = _first_key(out, ("num_experts_per_tok", "num_experts_per_token"))
        if top_key is not None:
            out[top_key] = max(1, min(out[top_key], out["topk_group"] * per_group))


def _fix_partial_rotary(out: dict, level: _Level) -> None:
    """A partial rotary factor must still rotate a whole, non-zero number of pairs of the new head."""
    factor = out.get("partial_rotary_factor")
    if isinstance(factor, float) and 0 < factor < 1:
        out["partial_rotary_factor"] = _pair_fraction(factor, _new_head_dim(out, level))


def _new_head_dim(out: dict, level: _Level) -> int:
    head_dim = out.get("head_dim")
    return head_dim if _as_int(head_dim) else level.sizes.head_dim


def _fix_rope_dicts(out: dict, level: _Level) -> None:
    """Keep rope parameters valid for the new heads: partial factors that rotate whole pairs, mrope
    sections that sum to half the rotary dimension, long-rope factor lists of that length."""
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            out[key] = _shrink_rope(out[key], out, level)


def _pair_fraction(factor: float, head_dim: int) -> float:
    """The nearest fraction of ``head_dim`` that is a whole, non-zero number of pairs."""
    pairs = max(1, round(head_dim * factor / 2))
    return 2 * pairs / head_dim


def _shrink_rope(rope: dict, out: dict, level: _Level) -> dict:
    """Shrink one rope dict, or each of a mapping of them (gemma3's per layer type)."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {k: _shrink_rope(v, out, level) for k, v in rope.items()}
    rope = dict(rope)
    head_dim = _new_head_dim(out, level)
    factor = rope.get("partial_rotary_factor")
    if isinstance(factor, float) and 0 < factor < 1:
        factor = rope["partial_rotary_factor"] = _pair_fraction(factor, head_dim)
    elif isinstance(out.get("partial_rotary_factor"), float):
        factor = out["partial_rotary_factor"]
    else:
        factor = 1.0
    if _as_int(out.get("rotary_dim")):
        rotary = out["rotary_dim"]
    elif "qk_nope_head_dim" in out and _as_int(out.get("qk_rope_head_dim")):
        rotary = out["qk_rope_head_dim"]  # MLA rotates only the rope part
    else:
        rotary = int(head_dim * factor)
    half = max(1, rotary // 2)
    if isinstance(rope.get("mrope_section"), list):
        rope["mrope_section"] = _split(rope["mrope_section"], half)
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list) and rope[key]:
            rope[key] = [rope[key][i * len(rope[key]) // half] for i in range(half)]
    if _as_int(rope.get("max_position_embeddings")):  # ministral3 repeats it here
        rope["max_position_embeddings"] = _positions("", rope["max_position_embeddings"], level)
    if _as_int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = _original_positions(
            "", rope["original_max_position_embeddings"], level
        )
    return rope


def _split(sections: list[int], total: int) -> list[int]:
    """Rescale ``sections`` to sum to ``total`` (largest remainders first; a section may become 0
    when there are fewer pairs than sections)."""
    old = sum(sections) or 1
    exact = [s * total / old for s in sections]
    new = [int(x) for x in exact]
    by_remainder = sorted(range(len(new)), key=lambda i: exact[i] - new[i], reverse=True)
    for i in by_remainder[: total - sum(new)]:
        new[i] += 1
    return new


def _fix_family_quirks(out: dict, level: _Level) -> None:
    """The few families whose fields encode their structure in a way no generic rule can read."""
    quirk = _QUIRKS.get(out.get("model_type"))
    if quirk is not None:
        quirk(out, level)


def _gpt_neo(out: dict, level: _Level) -> None:
    """gpt_neo rebuilds attention_layers from attention_types ([[kinds, repeats], ...]) and checks
    the count against num_layers: restate the kept layers in that form."""
    if isinstance(out.get("attention_layers"), list):
        out["attention_types"] = [[list(out["attention_layers"]), 1]]


def _reformer(out: dict, level: _Level) -> None:
    """reformer's axial position embeddings factor the longest sequence into axial_pos_shape and split
    the hidden size into axial_pos_embds_dim; in training the sequence must be exactly that long, so
    the shape becomes 4 x 4 = 16 tokens (the length the coverage benchmark and the tests use)."""
    out["axial_pos_shape"] = [4, 4]
    quarter = level.sizes.hidden // 4
    out["axial_pos_embds_dim"] = [quarter, level.sizes.hidden - quarter]


def _zamba(out: dict, level: _Level) -> None:
    """zamba ties every hybrid layer's shared transformer block to the first one's and fails to build
    with a single hybrid layer: with one kept, the last kept mamba layer becomes hybrid too."""
    kinds = out.get("layers_block_type")
    if isinstance(kinds, list) and kinds.count("hybrid") == 1 and len(kinds) > 1:
        last_other = max(i for i, kind in enumerate(kinds) if kind != "hybrid")
        kinds[last_other] = "hybrid"


_QUIRKS = {"gpt_neo": _gpt_neo, "reformer": _reformer, "zamba": _zamba}


# In order: the MLA rope share reads the partial factor, the rope dicts read the MLA dims.
_FIXES = (
    _fix_periods,
    _fix_partial_rotary,
    _fix_mla,
    _fix_ssm,
    _fix_expert_groups,
    _fix_rope_dicts,
    _fix_family_quirks,
)


def _drop_read_only(out: dict, cls) -> None:
    """A field the class exposes as a property without a setter is derived from other fields; it
    cannot be passed back in (configs saved by older versions sometimes carry one)."""
    for key in list(out):
        prop = getattr(cls, key, None)
        if isinstance(prop, property) and prop.fset is None:
            del out[key]


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
            d[key] = [mapping.get(v, v) if _as_int(v) is not None else v for v in value]
        elif _as_int(value) is not None:
            d[key] = mapping.get(value, value)


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if _as_int(v) is not None]


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
        target = next((data[k] for k in data if _read(config, k) is text and isinstance(data[k], dict)), None)
    if (
        target is not None
        and "pad_token_id" not in target
        and _read(text, "pad_token_id", "absent") == "absent"
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
