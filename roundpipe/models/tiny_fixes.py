"""``tiny_config``'s consistency fixes: fields that must agree once each has been shrunk on its own.

Multi-head latent attention dims, Mamba-2 heads and groups, group-limited routing, partial rotary
factors, rope dicts (mrope sections, long-rope factor lists), periods and their offsets, and the few
families whose fields encode their structure in a way no name rule can read (``_QUIRKS``, each
with why). :data:`FIXES` runs them in order on one shrunk level.
"""

from __future__ import annotations

import math

from roundpipe.models.tiny_level import Level, as_int
from roundpipe.models.tiny_rules import original_positions, positions


def _fix_periods(out: dict, level: Level) -> None:
    """An offset within a period (jamba's attn_layer_offset) must stay below the shrunk period, so
    that the periodic kind of layer still occurs."""
    for key, value in list(out.items()):
        if not (key.endswith("_offset") and isinstance(value, int)) or isinstance(value, bool):
            continue
        period = out.get(key.replace("_offset", "_period"))
        if isinstance(period, int) and period > 0:
            out[key] = min(value, period - 1)


def _fix_mla(out: dict, level: Level) -> None:
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


def _fix_ssm(out: dict, level: Level) -> None:
    """Mamba-2 style mixers split ``expand * hidden`` channels into heads of one size, in groups that
    divide the heads: recompute heads from the shrunk widths."""
    heads_key = _first_key(out, _SSM_HEADS) or ("num_heads" if "state_size" in out else None)
    dim_key = _first_key(out, _SSM_HEAD_DIM) or ("head_dim" if heads_key == "num_heads" else None)
    expand = next((out[k] for k in _SSM_EXPAND if isinstance(out.get(k), (int, float))), None)
    if heads_key is None or expand is None:
        return
    inner = int(expand * level.sizes.hidden)
    if as_int(out.get("mamba_d_ssm")):  # falcon_h1 states the inner width too
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


def _fix_expert_groups(out: dict, level: Level) -> None:
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


def _fix_partial_rotary(out: dict, level: Level) -> None:
    """A partial rotary factor must still rotate a whole, non-zero number of pairs of the new head."""
    factor = out.get("partial_rotary_factor")
    if isinstance(factor, float) and 0 < factor < 1:
        out["partial_rotary_factor"] = _pair_fraction(factor, _new_head_dim(out, level))


def _new_head_dim(out: dict, level: Level) -> int:
    head_dim = out.get("head_dim")
    return head_dim if as_int(head_dim) else level.sizes.head_dim


def _fix_rope_dicts(out: dict, level: Level) -> None:
    """Keep rope parameters valid for the new heads: partial factors that rotate whole pairs, mrope
    sections that sum to half the rotary dimension, long-rope factor lists of that length."""
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            out[key] = _shrink_rope(out[key], out, level)


def _pair_fraction(factor: float, head_dim: int) -> float:
    """The nearest fraction of ``head_dim`` that is a whole, non-zero number of pairs."""
    pairs = max(1, round(head_dim * factor / 2))
    return 2 * pairs / head_dim


def _shrink_rope(rope: dict, out: dict, level: Level) -> dict:
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
    if as_int(out.get("rotary_dim")):
        rotary = out["rotary_dim"]
    elif "qk_nope_head_dim" in out and as_int(out.get("qk_rope_head_dim")):
        rotary = out["qk_rope_head_dim"]  # MLA rotates only the rope part
    else:
        rotary = int(head_dim * factor)
    half = max(1, rotary // 2)
    if isinstance(rope.get("mrope_section"), list):
        rope["mrope_section"] = _split(rope["mrope_section"], half)
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list) and rope[key]:
            rope[key] = [rope[key][i * len(rope[key]) // half] for i in range(half)]
    if as_int(rope.get("max_position_embeddings")):  # ministral3 repeats it here
        rope["max_position_embeddings"] = positions("", rope["max_position_embeddings"], level)
    if as_int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = original_positions(
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


def _fix_family_quirks(out: dict, level: Level) -> None:
    """The few families whose fields encode their structure in a way no generic rule can read."""
    quirk = _QUIRKS.get(out.get("model_type"))
    if quirk is not None:
        quirk(out, level)


def _gpt_neo(out: dict, level: Level) -> None:
    """gpt_neo rebuilds attention_layers from attention_types ([[kinds, repeats], ...]) and checks
    the count against num_layers: restate the kept layers in that form."""
    if isinstance(out.get("attention_layers"), list):
        out["attention_types"] = [[list(out["attention_layers"]), 1]]


def _reformer(out: dict, level: Level) -> None:
    """reformer's axial position embeddings factor the longest sequence into axial_pos_shape and split
    the hidden size into axial_pos_embds_dim; in training the sequence must be exactly that long, so
    the shape becomes 4 x 4 = 16 tokens (the length the coverage benchmark and the tests use)."""
    out["axial_pos_shape"] = [4, 4]
    quarter = level.sizes.hidden // 4
    out["axial_pos_embds_dim"] = [quarter, level.sizes.hidden - quarter]


def _zamba(out: dict, level: Level) -> None:
    """zamba ties every hybrid layer's shared transformer block to the first one's and fails to build
    with a single hybrid layer: with one kept, the last kept mamba layer becomes hybrid too."""
    kinds = out.get("layers_block_type")
    if isinstance(kinds, list) and kinds.count("hybrid") == 1 and len(kinds) > 1:
        last_other = max(i for i, kind in enumerate(kinds) if kind != "hybrid")
        kinds[last_other] = "hybrid"


_QUIRKS = {"gpt_neo": _gpt_neo, "reformer": _reformer, "zamba": _zamba}


# In order: the MLA rope share reads the partial factor, the rope dicts read the MLA dims.
FIXES = (
    _fix_periods,
    _fix_partial_rotary,
    _fix_mla,
    _fix_ssm,
    _fix_expert_groups,
    _fix_rope_dicts,
    _fix_family_quirks,
)


__all__ = ["FIXES"]
