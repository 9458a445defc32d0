"""``tiny_config``'s rules for one field at a time: scalars by the field's name, lists by their kind.

Scalar rules are ``(pattern on the canonical name, rule)``; the first match wins, so the specific
ones come first. A rule sees the field's name, its value and the :class:`~.tiny_level.Level`; the
fields that must agree with each other are made to afterwards (``tiny_fixes.py``).
"""

from __future__ import annotations

import math
import re

from roundpipe.models.tiny_level import (
    LAYER_KIND_LISTS,
    LEADING_COUNTS,
    TRAILING_COUNTS,
    Level,
    index_list_keys,
    is_scalar,
    per_layer_keys,
)

# Learned position tables are capped here (but never below 64, so short test batches always fit).
_MAX_POSITIONS = 256
_MIN_POSITIONS = 64
# Sliding windows, attention chunks, SSM scan chunks and sparse-attention top-k shrink to this,
# below a 16-token test sequence, so the windowed / chunked / sparse code path really runs.
_WINDOW = 8
_SSM_STATE = 16


def shrink_list(key: str, value: list, level: Level):
    """Per-layer lists keep the kept layers' entries, index lists are renumbered, patterns keep one
    of each kind; any other list is left alone (a value list such as ``time_step_limit``)."""
    n = level.layers
    if n and len(value) == n and key in per_layer_keys(level.values, n):
        picked = [value[i] for i in level.kept] if n > level.sizes.layers else list(value)
        return [shrink_scalar(_singular(key), v, level) for v in picked]
    if n and key in index_list_keys(level.values, n):
        return _remap_indices(value, level)
    if LAYER_KIND_LISTS.search(key) and all(is_scalar(v) for v in value):
        return _one_of_each(value, level.sizes.layers)
    return value


def _singular(key: str) -> str:
    """The scalar field a per-layer list holds (``num_attention_heads_per_layer`` -> ``..._heads``)."""
    return re.sub(r"_per_layer$", "", key)


def _remap_indices(value: list, level: Level) -> list[int]:
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


def shrink_scalar(key: str, value, level: Level):
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


def _fill_none(name: str, level: Level):
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


def positions(name, value, level):
    """Learned position tables stay small, yet hold a 64-token batch."""
    return max(_MIN_POSITIONS, min(value, _MAX_POSITIONS)) if value > 0 else value


def original_positions(name, value, level):
    """The pre-extension context of a long-context rope (longrope, yarn, llama3) keeps its ratio to
    the maximum, so the tiny model still runs past it and takes the scaled path."""
    old = level.max_positions
    if not old or value <= 0:
        return min(value, _MAX_POSITIONS)
    return max(1, round(value * positions("", old, level) / old))


def _vocab(name, value, level):
    """Every vocabulary (token, type, codebook, hashed n-gram) shrinks to the target vocabulary."""
    return min(value, level.sizes.vocab)


def _leading_count(name, value, level):
    """How many kept layers lie before the boundary (see tiny_level._choose_layers)."""
    return sum(i < value for i in level.kept) if level.kept else value


def _trailing_count(name, value, level):
    """How many kept layers lie in the trailing block (see TRAILING_COUNTS)."""
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
        (rf"^({'|'.join(LEADING_COUNTS)}|moe_layer_start_index)$", _leading_count),
        (rf"^({'|'.join(TRAILING_COUNTS)})$", _trailing_count),
        (r"^moe_layer_end_index$", _end_index),
        # Token ids are remapped over the whole config at once (tiny._remap_token_ids).
        (r"_token_ids?$|_token_index$|^lang_id$|_index$|_idx$", _keep),
        (r"^original_max_position_embeddings$", original_positions),
        (
            r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|"
            r"max_target_positions|max_source_positions|context_length)$",
            positions,
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
        (r"_layer_offset$", _keep),  # after the periods (tiny_fixes._fix_periods)
        (r"(^|_)layers?$|^depth$|^num_blocks$|_layers_per_stack$", _layer_count),
        (r"(key_value_heads|kv_heads|kv_n_heads|^num_query_groups|num_key_heads)$", _kv_heads),
        (r"(attention_heads|(^|_)n_heads?$|(^|_)num_heads$|_n_heads$|value_heads$|heads_per_ngram$)", _heads),
        (r"^(q_lora_rank|kv_lora_rank|o_lora_rank)$", _rank),
        (r"^(qk_rope_head_dim|qk_nope_head_dim|qk_head_dim)$", _keep),  # tiny_fixes._fix_mla
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


__all__ = ["original_positions", "positions", "shrink_list", "shrink_scalar"]
