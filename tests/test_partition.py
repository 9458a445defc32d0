"""Presets, the analytic cost model and the optimal partitioner (pure Python, no torch).

The partitioner is checked against brute force on random small instances; on real configs its
plans are checked for balance (against an independent min-max dynamic program) and for memory
(by the cost model's own accounting). ``roundpipe partition`` prints the plans.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe.commands.partition import main as partition_main
from roundpipe.errors import ConfigError, PlanError
from roundpipe.partition import (
    auto_microbatches,
    choose_head_shards,
    last_stage_bytes,
    layer_times,
    model_costs,
    model_totals,
    optimal_partition,
    plan_partitions,
    roundpipe_bubble,
    stage_bytes,
)
from roundpipe.presets import GIB, known_gpus, known_models, load_hardware, load_model_config
from roundpipe.schedule.table import Partition

SEQ = 4096


# ---------------------------------------------------------------------------------------------
# Brute force reference


def _draining(w, d, cap: int) -> int:
    """The most gradients any run of layers of weights ``<= cap`` has (the search's drain bound)."""
    n = len(w)
    return max((sum(d[i:j]) for i in range(n) for j in range(i + 1, n + 1) if sum(w[i:j]) <= cap), default=0)


def _brute_force(times, stages, w, a, p, budget, reserve, d=None):
    """Min bottleneck over all contiguous partitions into ``stages`` that pass the memory rule."""
    n = len(times)
    d = d or [0] * n
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        spans = list(zip(bounds, bounds[1:]))
        weights = [sum(w[i:j]) for i, j in spans]
        if budget is not None:
            prefetch = max(weights)
            draining = _draining(w, d, prefetch)
            if any(
                weights[s] + prefetch + draining + sum(a[i:j]) + max(p[i:j]) + reserve > budget
                for s, (i, j) in enumerate(spans)
            ):
                continue
        bottleneck = max(math.fsum(times[i:j]) for i, j in spans)
        best = bottleneck if best is None else min(best, bottleneck)
    return best


@st.composite
def _instances(draw):
    n = draw(st.integers(1, 9))
    stages = draw(st.integers(1, 4))
    integral = draw(st.booleans())  # integer times make ties, which stress the search
    time = st.integers(1, 20).map(float) if integral else st.floats(0.001, 100.0)
    times = draw(st.lists(time, min_size=n, max_size=n))
    size = st.integers(0, 50)
    w = draw(st.lists(size, min_size=n, max_size=n))
    a = draw(st.lists(size, min_size=n, max_size=n))
    p = draw(st.lists(size, min_size=n, max_size=n))
    d = draw(st.lists(size, min_size=n, max_size=n) | st.just([0] * n))  # gradients left downloading
    budget = draw(st.none() | st.integers(0, 500))
    reserve = draw(st.integers(0, 20))
    return times, stages, w, a, p, d, budget, reserve


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_partitioner_bottleneck_equals_brute_force_optimum(instance):
    times, stages, w, a, p, d, budget, reserve = instance
    expected = _brute_force(times, stages, w, a, p, budget, reserve, d) if stages <= len(times) else None
    kw = dict(
        weight_bytes=w, added_bytes=a, peak_bytes=p, drain_bytes=d, budget=budget, reserve_bytes=reserve
    )
    if expected is None:
        with pytest.raises(PlanError):
            optimal_partition(times, stages, **kw)
        return
    result = optimal_partition(times, stages, **kw)
    assert result.partition.num_stages == stages
    assert math.isclose(result.bottleneck, expected, rel_tol=1e-9)
    # The returned partition itself passes the memory rule, and its reported peaks are right.
    spans = list(zip(result.partition.bounds, result.partition.bounds[1:]))
    assert result.stage_times == tuple(math.fsum(times[i:j]) for i, j in spans)
    if budget is not None:
        weights = [sum(w[i:j]) for i, j in spans]
        drains = [sum(d[i:j]) for i, j in spans]
        draining = _draining(w, d, max(weights))
        searched = tuple(
            wt + max(weights) + draining + sum(a[i:j]) + max(p[i:j]) + reserve
            for wt, (i, j) in zip(weights, spans)
        )
        # The search's (sufficient) rule: the largest stage as everyone's prefetch, and the most
        # gradients a run of layers no heavier has as everyone's draining predecessor.
        assert max(searched) <= budget
        # Reported peaks: each stage with the largest *other* stage's weights and gradients (never more).
        others = [max(weights[:s] + weights[s + 1 :], default=0) for s in range(len(weights))]
        down = [max(drains[:s] + drains[s + 1 :], default=0) for s in range(len(drains))]
        peaks = tuple(
            wt + o + g + sum(a[i:j]) + max(p[i:j]) + reserve
            for wt, o, g, (i, j) in zip(weights, others, down, spans)
        )
        assert result.stage_peaks == peaks and all(x <= y for x, y in zip(peaks, searched))


def test_single_layer_over_budget_names_layer_bytes_budget_and_levers():
    with pytest.raises(PlanError) as info:
        optimal_partition([1.0, 1.0, 1.0], 2, weight_bytes=[10, 90, 10], budget=150, names=["a", "big", "c"])
    msg = str(info.value)
    assert "'big'" in msg and "180" in msg and "150" in msg
    for lever in ("more microbatches", "shorter sequences", "more head shards"):
        assert lever in msg
    assert info.value.layer == "big" and info.value.needed == 180 and info.value.budget == 150


def test_too_few_stages_for_the_budget_says_how_many_would_fit():
    with pytest.raises(PlanError) as info:
        optimal_partition([1.0] * 6, 2, weight_bytes=[10] * 6, budget=45)
    assert info.value.min_stages == 3 and "at least 3 stages" in str(info.value)


def test_more_stages_than_layers_is_a_plan_error():
    with pytest.raises(PlanError, match="1..3"):
        optimal_partition([1.0, 2.0, 3.0], 4)


# ---------------------------------------------------------------------------------------------
# Presets


def test_every_preset_number_carries_a_source():
    for name in known_models():
        assert load_model_config(name)["_source"]
    for name in known_gpus():
        server = load_hardware(name)
        assert server.gpu.source and server.source


def test_server_spec_builds_a_server_with_topology():
    server = load_hardware("8xrtx4090")
    assert server.num_gpus == 8 and server.gpu.name == "rtx4090"
    assert server.memory_bytes == 24 * GIB
    assert server.num_switches == 8 // server.gpus_per_switch
    assert server.switch_of(7) == server.num_switches - 1
    assert server.gpu.host_link_bw_effective == 24e9  # the measured pinned figure wins over nominal
    assert server.gpu.peak_flops("fp16", fp16_accumulate=True) == 330.3e12  # GeForce: fp16 accumulate is 2x
    assert server.gpu.peak_flops("fp16") == server.gpu.peak_flops("bf16") == 165.2e12
    assert load_hardware("8xrtx4090", gpus_per_switch=2).num_switches == 4


@pytest.mark.parametrize(
    "loader,name", [(load_hardware, "rtx5090"), (load_hardware, "8xa100"), (load_model_config, "gpt2")]
)
def test_unknown_preset_names_list_the_known_ones(loader, name):
    with pytest.raises(ConfigError) as info:
        loader(name)
    known = known_gpus() if loader is load_hardware else known_models()
    assert all(k in str(info.value) for k in known)


def test_model_config_from_a_local_config_json(tmp_path):
    cfg = load_model_config("qwen3-8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path) == cfg
    assert load_model_config(tmp_path / "config.json")["hidden_size"] == 4096
    assert load_model_config("Qwen/Qwen3-8B") == cfg  # a hub id maps to its preset


# ---------------------------------------------------------------------------------------------
# Cost model


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "llama3.1-8b",
        "llama3.1-70b",
    ],
)
def test_parameter_count_matches_the_model_card(name):
    cfg = load_model_config(name)
    totals = model_totals(model_costs(cfg, SEQ))
    assert totals["params"] == pytest.approx(cfg["_card_params"]["total"], rel=0.02)


def test_lora_trainable_params_are_counted_per_linear():
    # Qwen3-8B, r=16 on q,k,v,o,gate,up,down: 36 layers x 16 x sum(in + out) = 43,646,976.
    per_layer = 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 12288))
    costs = model_costs(load_model_config("qwen3-8b"), SEQ, lora_rank=16)
    assert model_totals(costs)["trainable_params"] == 36 * per_layer == 43_646_976


def test_backward_costs_twice_forward_under_full_fine_tuning_and_less_under_lora():
    cfg = load_model_config("qwen3-8b")
    block_full = model_costs(cfg, SEQ)[1]
    block_lora = model_costs(cfg, SEQ, lora_rank=16)[1]
    assert 2.0 <= block_full.bwd_flops / block_full.fwd_flops < 2.1  # attention core is 2.5x
    assert 2.9 < block_full.bwd_recompute_flops / block_full.fwd_flops < 3.2
    assert block_lora.bwd_flops < 0.6 * block_full.bwd_flops
    head = model_costs(cfg, SEQ)[-1]
    assert not head.recompute and head.bwd_recompute_flops == 2 * head.fwd_flops


def test_attention_term_grows_with_sequence_and_moe_counts_active_experts_only():
    cfg = load_model_config("qwen3-8b")
    per_token = [model_costs(cfg, s)[1].fwd_flops / s for s in (1024, 2048)]
    assert per_token[1] - per_token[0] == pytest.approx(2 * 32 * 128 * 1024)  # 4 h d (T+1)/2
    # Qwen3-30B-A3B: hidden 2048, 32 heads, 4 kv heads, 128 experts of 768, 8 active per token.
    block = model_costs(load_model_config("qwen3-30b-a3b"), SEQ)[1]
    attention = 2048 * 4096 * 2 + 2048 * 512 * 2
    active = attention + 2048 * 128 + 8 * 3 * 2048 * 768
    assert block.params == attention + 2048 * 128 + 128 * 3 * 2048 * 768 + 2 * 2048 + 2 * 128
    assert block.fwd_flops / SEQ == pytest.approx(2 * active + 2 * 32 * 128 * (SEQ + 1))


def test_head_shards_split_the_head_evenly_and_keep_totals():
    cfg = load_model_config("qwen3-8b")
    one = model_costs(cfg, SEQ)
    four = model_costs(cfg, SEQ, head_shards=4)
    heads = [c for c in four if c.kind == "head"]
    assert [c.name for c in heads] == ["head.0", "head.1", "head.2", "head.3"]
    assert sum(c.fwd_flops for c in heads) == pytest.approx(one[-1].fwd_flops)
    assert sum(c.params for c in heads) == one[-1].params
    assert heads[0].params == heads[1].params + 4096  # the final norm goes with the first shard
    assert heads[1].work_bytes < one[-1].work_bytes


def test_the_head_costs_only_the_tokens_with_a_label():
    cfg = load_model_config("qwen3-8b")
    for shards in (1, 4):
        every = model_costs(cfg, SEQ, head_shards=shards)
        masked = model_costs(cfg, SEQ, head_shards=shards, label_fraction=0.25)
        for a, b in zip(every, masked):
            if a.kind != "head":
                assert a == b  # blocks and embedding see every token
                continue
            assert b.fwd_flops == pytest.approx(a.fwd_flops / 4)
            assert b.saved_bytes < a.saved_bytes and b.act_in_bytes == a.act_in_bytes  # hand-off keeps all
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="label_fraction"):
            model_costs(cfg, SEQ, label_fraction=bad)


def test_measured_times_replace_analytic_ones_by_layer_name():
    costs = model_costs(load_model_config("qwen3-0.6b"), 512)
    hw = load_hardware("rtx4090")
    fwd, bwd = layer_times(costs, hw, times={"layers.3": (0.5, 1.0), "head": (0.2, 0.3)})
    assert fwd[4] == 0.5 and bwd[4] == 1.5  # the block recomputes its forward in backward
    assert fwd[-1] == 0.2 and bwd[-1] == 0.3  # the head does not
    with pytest.raises(ConfigError):
        layer_times(costs, hw, times={"layers.99": (1.0, 1.0)})


# ---------------------------------------------------------------------------------------------
# Plans on real configs


def _minmax(times, stages):
    """Independent reference: classic O(S n^2) min-max linear partition, no memory."""
    n = len(times)
    pre = [0.0, *itertools.accumulate(times)]
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(1, n + 1):
            best[s][j] = min(
                (max(best[s - 1][i], pre[j] - pre[i]) for i in range(s - 1, j)), default=math.inf
            )
    return best[stages][n]


# Largest stage over the mean, (forward, backward), with 8 stages: what whole layers allow. Qwen3-8B
# balances within 10%; 32 Llama-3.1-8B blocks + head cannot (some stage holds 5 blocks while the mean
# is ~4.25: +17.6%), nor can the forward of Qwen3-1.7B (28 blocks + a head of 5.3 blocks).
BALANCE_8 = {"qwen3-8b": (0.10, 0.10), "qwen3-1.7b": (0.13, 0.10), "llama3.1-8b": (0.18, 0.20)}


@pytest.mark.parametrize("name", sorted(BALANCE_8))
def test_plans_on_8_stages_are_optimal_and_as_balanced_as_whole_layers_allow(name):
    p = plan_partitions(name, "8xrtx4090", seq_len=SEQ, stages=8)
    print("\n" + p.table())
    costs = model_costs(load_model_config(name), SEQ, head_shards=p.head_shards)
    fwd_t, bwd_t = layer_times(costs, load_hardware("8xrtx4090"))
    assert p.fwd_bottleneck == pytest.approx(_minmax(fwd_t, 8), rel=1e-9)
    assert p.bwd_bottleneck == pytest.approx(_minmax(bwd_t, 8), rel=1e-9)
    fwd_tol, bwd_tol = BALANCE_8[name]
    assert p.fwd_bottleneck <= (1 + fwd_tol) * p.fwd_mean
    assert p.bwd_bottleneck <= (1 + bwd_tol) * p.bwd_mean


@pytest.mark.parametrize("name,stages", [("qwen3-1.7b", 11), ("qwen3-8b", 13), ("llama3.1-8b", 9)])
def test_plans_balance_within_10_percent_where_whole_layers_allow(name, stages):
    p = plan_partitions(name, "8xrtx4090", seq_len=SEQ, stages=stages)
    assert max(p.imbalance) <= 0.10, p.table()


def test_the_head_is_sharded_when_that_lowers_the_bottleneck():
    # Qwen3-1.7B's head + loss costs ~3.9 blocks forward: alone in a stage it is the bottleneck
    # of 11 stages (28 blocks, ~2.8 per stage), not of 8 (4 per stage).
    kw = dict(seq_len=SEQ, stages=11)
    k = choose_head_shards("qwen3-1.7b", "8xrtx4090", **kw)
    assert k > 1
    unsharded = plan_partitions("qwen3-1.7b", "8xrtx4090", head_shards=1, **kw)
    chosen = plan_partitions("qwen3-1.7b", "8xrtx4090", head_shards=k, **kw)
    assert sum(chosen.bottleneck) < 0.99 * sum(unsharded.bottleneck)


MEMORY_CASES = [("qwen3-8b", None), ("qwen3-32b", None), ("qwen3-235b-a22b", 16)]


@pytest.mark.parametrize("name,lora", MEMORY_CASES)
def test_plans_for_24gb_devices_fit_by_the_models_own_accounting(name, lora):
    p = plan_partitions(name, "8xrtx4090", seq_len=SEQ, lora_rank=lora)
    print("\n" + p.table())
    costs = model_costs(load_model_config(name), SEQ, lora_rank=lora, head_shards=p.head_shards)
    fwd = stage_bytes(costs, p.forward, "forward", p.reserve_bytes)
    bwd = stage_bytes(costs, p.backward, "backward", p.reserve_bytes)
    last = last_stage_bytes(costs, p.forward, p.backward, p.reserve_bytes)
    assert p.budget == 24 * GIB
    assert max(*fwd, *bwd, last) <= p.budget and p.fits
    assert (tuple(fwd), tuple(bwd), last) == (p.fwd_stage_peaks, p.bwd_stage_peaks, p.last_stage_peak)
    assert p.forward.bounds[-2] == p.backward.bounds[-2]  # the free grain fuses the head stage


def test_a_layer_that_cannot_fit_raises_plan_error_with_the_levers():
    with pytest.raises(PlanError) as info:
        plan_partitions("qwen3-32b", "8xrtx4090", seq_len=65536)
    msg = str(info.value)
    assert "layers." in msg and f"{24 * GIB:,}" in msg
    for lever in ("more microbatches", "shorter sequences", "more head shards"):
        assert lever in msg


def test_an_unshardable_head_that_does_not_fit_is_fixed_by_auto_head_shards():
    kw = dict(seq_len=SEQ, lora_rank=16, memory_budget=int(4.2 * GIB))
    with pytest.raises(PlanError, match="'head'"):
        plan_partitions("qwen3-8b", "8xrtx4090", head_shards=1, **kw)
    p = plan_partitions("qwen3-8b", "8xrtx4090", **kw)
    assert p.head_shards > 1 and p.fits


def test_auto_microbatches_keep_the_bubble_under_target():
    # Equal stages, one per device: the classic (D - 1) / (D - 1 + M).
    assert roundpipe_bubble([1.0] * 8, [3.0] * 8, 8, 8) == pytest.approx(7 / 15)
    m = auto_microbatches([1.0] * 8, [3.0] * 8, 8, target_bubble=0.10)
    assert m == 63 and roundpipe_bubble([1.0] * 8, [3.0] * 8, 8, m - 1) > 0.10
    assert auto_microbatches([1.0] * 32, [3.0] * 32, 8) == 16  # more stages, shorter fill
    assert auto_microbatches([1.0], [1.0], 1) == 1


def test_plan_serialises_and_prints_a_table():
    p = plan_partitions("qwen3-0.6b", "8xrtx4090", seq_len=1024, stages=(4, 8), microbatches=8)
    d = json.loads(p.to_json())
    assert d["forward"] == list(p.forward.bounds) and len(d["bwd_stage_times"]) == 8
    assert Partition(tuple(d["backward"])) == p.backward
    table = p.table()
    assert "F3" in table and "B7" in table and "est. time" in table and "peak" in table


def test_roundpipe_partition_prints_a_plan(capsys):
    partition_main(["qwen3-0.6b", "--stages", "4", "--seq", "1024"])
    assert "qwen3-0.6b on 8x rtx4090" in capsys.readouterr().out
