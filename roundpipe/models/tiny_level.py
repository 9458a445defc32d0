"""What ``tiny_config`` reads off one config level before shrinking it, and which layers it keeps.

A *level* is the config itself, a nested text / vision / audio config, or a per-layer override
applied to its level. :class:`Level` holds the target sizes (:class:`Sizes`), the level's original
sizes and the layers kept. Layers are not simply truncated: each original layer has features (its
entry in every per-layer list, its membership in every list of layer indices, its side of a leading
dense block, its per-layer override) and the layers kept are picked to show as many distinct
features as possible (:func:`make_level`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sizes:
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


@dataclass
class Level:
    """What the rules of one config level need: the target sizes, the level's original sizes, the
    original hidden sizes of every level of the tree, and the layers kept."""

    sizes: Sizes
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


def make_level(data: dict, obj, sizes: Sizes, tree_hiddens: frozenset[int]) -> Level:
    """Read the level's original sizes (from ``data`` first: for a per-layer override it differs from
    the object's) and choose which of its layers to keep."""
    attribute_map = type(obj).attribute_map

    def original(name):
        value = data.get(attribute_map.get(name, name))
        return as_int(value if value is not None else read_attr(obj, name))

    hidden, heads = original("hidden_size"), original("num_attention_heads")
    head_dim = original("head_dim") or (hidden // heads if hidden and heads else None)
    layers = original("num_hidden_layers") or _layer_count_from_lists(data)
    canonical = {real: canon for canon, real in attribute_map.items()}
    positions = original("max_position_embeddings")
    level = Level(sizes, canonical, hidden, heads, head_dim, layers, positions, [], data, tree_hiddens)
    level.kept = _choose_layers(data, level) if layers else []
    return level


def read_attr(obj, name: str, default=None):
    """``getattr`` that neither raises for per-layer attributes of heterogeneous configs nor for
    properties that fail on a partially filled config."""
    getter = getattr(obj, "_getattr_without_heterogeneous_validation", None)
    try:
        if getter is not None:
            return getter(name, default)
        return getattr(obj, name, default)
    except Exception:
        return default


def as_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_config(value) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


# Lists with one entry per layer, whatever their length says (some families derive the layer count
# from them, nemotron_h; others repeat them cyclically, recurrent_gemma's block_types).
LAYER_KIND_LISTS = re.compile(r"(^|_)(layer_types|layers_block_type|block_types|attn_layers|indexer_types)$")


# Lists of layer indices.
_INDEX_LISTS = re.compile(r"(layers|idxs|indexes|indices|layer_ids)$")


def _layer_count_from_lists(data: dict) -> int | None:
    """The layer count of a family that has no num_hidden_layers field (it derives it from a list)."""
    for key, value in data.items():
        if LAYER_KIND_LISTS.search(key) and isinstance(value, list) and value:
            return len(value)
    return None


def per_layer_keys(data: dict, n: int) -> list[str]:
    """The keys of lists with exactly one scalar entry per original layer."""
    keys = []
    for key, value in data.items():
        if not isinstance(value, list) or len(value) != n or not all(is_scalar(v) for v in value):
            continue
        if _INDEX_LISTS.search(key) and _is_index_list(value, n) and not LAYER_KIND_LISTS.search(key):
            continue
        if LAYER_KIND_LISTS.search(key) or re.search(r"layer|block|type|pattern|heads|rope", key) or n >= 8:
            keys.append(key)
    return keys


def index_list_keys(data: dict, n: int) -> list[str]:
    """The keys of lists of layer indices (mllama's cross_attention_layers, flint's mlp_only_layers)."""
    return [
        key
        for key, value in data.items()
        if _INDEX_LISTS.search(key)
        and not LAYER_KIND_LISTS.search(key)
        and isinstance(value, list)
        and _is_index_list(value, n)
    ]


def is_scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _is_index_list(value: list, n: int) -> bool:
    """Strictly increasing ints below ``n``: a set of layer indices, not a per-layer flag list."""
    ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return len(ints) == len(value) and all(0 <= v < n for v in ints) and ints == sorted(set(ints))


# Fields that count the first layers of some kind (a leading dense block, the layers before the
# sliding-window ones): each layer's side of the boundary is part of its signature.
LEADING_COUNTS = ("first_k_dense_replace", "num_dense_layers", "n_dense_layers", "max_window_layers")


# Fields that count the last layers of some kind (Gemma-3n's layers reusing earlier layers' KV).
# Not a feature in _choose_layers: a kept KV-sharing layer needs a kept producer of its own kind.
TRAILING_COUNTS = ("num_kv_shared_layers",)


def _choose_layers(data: dict, level: Level) -> list[int]:
    """The original indices of the layers to keep, in order.

    Each layer has features: its entry in every per-layer list, its membership in every list of
    layer indices, its side of every leading-block boundary, its per-layer override. Layers are
    picked greedily, each time the one showing the most features not yet shown (the earliest on a
    tie), so two layers cover sliding + full *and* dense + MoE where one layer of each exists.
    """
    n, want = level.layers, level.sizes.layers
    if n <= want:
        return list(range(n))
    lists = [data[k] for k in per_layer_keys(data, n)]
    index_sets = [set(data[k]) for k in index_list_keys(data, n)]
    overrides = overrides_by_layer(data.get("per_layer_config"))
    leading = [v for k in LEADING_COUNTS if isinstance(v := data.get(k), int) and 0 < v < n]
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


def overrides_by_layer(per_layer) -> dict[int, dict]:
    """A heterogeneous config's ``per_layer_config`` ({"07": {...}}) keyed by int layer index."""
    if not isinstance(per_layer, dict):
        return {}
    return {int(k): v for k, v in per_layer.items() if str(k).isdigit() and isinstance(v, dict)}


__all__ = [
    "LAYER_KIND_LISTS",
    "LEADING_COUNTS",
    "TRAILING_COUNTS",
    "Level",
    "Sizes",
    "as_int",
    "index_list_keys",
    "is_config",
    "is_scalar",
    "make_level",
    "overrides_by_layer",
    "per_layer_keys",
    "read_attr",
]
