"""The free stage grain (partition/grain.py): exact for the paper's objective, the paper's own grain
where memory allows it, and uneven microbatches in the simulator and tuner. Pure Python."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from roundpipe.errors import ConfigError, PlanError
from roundpipe.partition.cost import LayerCost, layer_times, model_costs
from roundpipe.partition.grain import MAX_FUSED_LAYERS, grain_choices, objective
from roundpipe.partition.memory import last_stage_bytes, memory_vectors, stage_bytes
from roundpipe.partition.model_plan import plan_partitions
from roundpipe.presets import load_hardware, load_model_config
from roundpipe.sim.options import SimOptions
from roundpipe.sim.scenario import Scenario, check_scenario, microbatch_sizes, prepare, run_scenario
from roundpipe.sim.search import microbatch_candidates

SEEDS = 40


def _costs(n_blocks: int, rng: random.Random, head_shards: int = 1) -> list[LayerCost]:
    # A layer's device gradients are its trainable parameters in fp32, so one multiple of its weight
    # bytes for the whole model: 0 frozen (next to it under LoRA), 1 with fp32 weights, 2 with bf16.
    grads_per_weight_byte = rng.choice([0, 1, 2])

    def cost(name: str, recompute: bool) -> LayerCost:
        weights = rng.randint(1, 9) * 100
        return LayerCost(
            name=name, fwd_flops=0.0, bwd_flops=0.0, param_bytes=weights, trainable_params=1,
            act_in_bytes=10, grad_device_bytes=grads_per_weight_byte * weights,
            saved_bytes=rng.randint(0, 3) * 100, work_bytes=rng.randint(3, 6) * 100,
            fwd_work_bytes=rng.randint(0, 2) * 100, recompute=recompute,
        )  # fmt: skip

    return (
        [cost("embed", True)]
        + [cost(f"layers.{i}", True) for i in range(n_blocks)]
        + [cost(f"head.{k}" if head_shards > 1 else "head", False) for k in range(head_shards)]
    )


def _compositions(n: int):
    """Every cut of ``n`` layers into contiguous non-empty stages, as bounds."""
    for k in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            yield (0, *cuts, n)


def _searched_rule(costs, c, bounds, phase, reserve) -> list[int]:
    """Each stage before the fused one ``[c, n)`` by the stage search's sufficient rule
    (``optimal_partition``): the largest stage's weights (the fused one's included) as everyone's
    prefetch, and as everyone's draining gradients the most any run of layers no heavier than that
    has, or the fused stage's."""
    w, a, p, d = memory_vectors(costs[:c], phase)
    w_b, _, _, d_b = memory_vectors(costs, "backward")
    spans = list(zip(bounds, bounds[1:]))
    cap = max(max(sum(w[i:j]) for i, j in spans), sum(w_b[c:]))
    runs = [(i, j) for i in range(len(w)) for j in range(i + 1, len(w) + 1)]
    draining = max([sum(d[i:j]) for i, j in runs if sum(w[i:j]) <= cap] + [sum(d_b[c:])])
    return [sum(w[i:j]) + cap + draining + sum(a[i:j]) + max(p[i:j]) + reserve for i, j in spans]


def _brute_force(costs, f, b, n_dev, m, budget, reserve) -> tuple[float, float]:
    """The best objective over every grain that fits the memory rule (``stage_bytes``, the fused
    device's ``last_stage_bytes``), and over those that fit the stage search's sufficient rule too."""
    from roundpipe.schedule.table import Partition

    n = len(costs)
    head = next(i for i, c in enumerate(costs) if not c.recompute)
    fused_t = [b[i] if c.recompute else f[i] + b[i] for i, c in enumerate(costs)]
    best = best_searched = math.inf
    for c in range(max(0, head - MAX_FUSED_LAYERS), head + 1):  # the fused stage's reach
        u = sum(fused_t[c:])
        prefixes = list(_compositions(c)) if c else [(0,)]
        for fb in prefixes:
            for bb in prefixes:
                fwd, bwd = Partition(fb + (n,)), Partition(bb + (n,))
                searched = True
                if budget is not None:
                    peaks = stage_bytes(costs, fwd, "forward", reserve) + stage_bytes(
                        costs, bwd, "backward", reserve
                    )
                    if max(peaks) > budget or last_stage_bytes(costs, fwd, bwd, reserve) > budget:
                        continue
                    searched = not c or all(
                        max(_searched_rule(costs, c, cuts, phase, reserve)) <= budget
                        for cuts, phase in ((fb, "forward"), (bb, "backward"))
                    )
                tf = [sum(f[i] for i in fwd.layers(s)) for s in range(fwd.num_stages - 1)]
                tb = [sum(b[i] for i in bwd.layers(s)) for s in range(bwd.num_stages - 1)]
                t = max(tf + tb + [u])
                score = objective(m, n_dev, fwd.num_stages + bwd.num_stages - 1, t)
                best = min(best, score)
                if searched:
                    best_searched = min(best_searched, score)
    return best, best_searched


@pytest.mark.parametrize("seed", range(SEEDS))
def test_the_grain_is_optimal_for_the_objective_by_brute_force(seed):
    """The grain is the best of those the stage search's sufficient memory rule allows, and never
    better than the best that fits (it would not fit). Between the two: the cuts it also checks
    against the full rule (an idle stage merged, stages packed from the head down)."""
    rng = random.Random(seed)
    costs = _costs(rng.randint(1, 5), rng)
    f = [rng.choice([0.0, 1.0, 2.0, 3.0]) for _ in costs]
    b = [x * rng.choice([2, 3]) + rng.random() for x in f]
    n_dev, m = rng.randint(1, 4), rng.randint(1, 8)
    budget = rng.choice([None, 4000, 6000])
    reserve = 100
    best, best_searched = _brute_force(costs, f, b, n_dev, m, budget, reserve)
    if math.isinf(best_searched):
        if math.isinf(best):
            with pytest.raises(PlanError):
                grain_choices(
                    costs, f, b, num_devices=n_dev, microbatches=m, budget=budget, reserve_bytes=reserve
                )
        return
    got = grain_choices(costs, f, b, num_devices=n_dev, microbatches=m, budget=budget, reserve_bytes=reserve)
    assert best * (1 - 1e-12) <= got[0].objective <= best_searched * (1 + 1e-12)
    if budget is None:
        assert got[0].objective == pytest.approx(best, rel=1e-12)
    for g in got:  # every choice is a valid, fitting grain with the head fused last
        assert g.forward.bounds[-2] == g.backward.bounds[-2] == g.fused_start
        assert g.objective >= got[0].objective
        if budget is not None:
            assert max(stage_bytes(costs, g.forward, "forward", reserve)) <= budget
            assert max(stage_bytes(costs, g.backward, "backward", reserve)) <= budget


def _paper_times(name: str, costs, hw):
    measured = {  # ms, RTX 4090, 4 x 2048 tokens, fp16 with fp16 accumulation (benchmarks/data)
        "qwen3-1.7b": (7.429, 15.831, 22.066, 43.707),
        "llama3.1-8b": (18.504, 41.207, 37.226, 74.501),
    }[name]
    times = {c.name: (measured[0] / 1e3, measured[1] / 1e3) for c in costs if c.name.startswith("layers.")}
    times["head"] = (measured[2] / 1e3, measured[3] / 1e3)
    times["embed"] = (0.0, 0.0)
    return layer_times(costs, hw, times=times)


@pytest.mark.parametrize("name,stages", [("qwen3-1.7b", (5, 11)), ("llama3.1-8b", (7, 17))])
def test_on_the_papers_times_the_grain_is_the_papers(name, stages):
    # The paper's partitioner: Qwen3-1.7B 4 forward + 10 backward stages, Llama-3.1-8B 6 + 16, each
    # plus the head's own stage (counted here in both partitions).
    hw = load_hardware("8xrtx4090")
    costs = model_costs(load_model_config(name), 2048, 4, dtype="fp16", head_shards=1)
    f, b = _paper_times(name, costs, hw)
    best = grain_choices(
        costs,
        f,
        b,
        num_devices=8,
        microbatches=16,
        budget=hw.memory_bytes,
        reserve_bytes=hw.workspace_reserve_bytes,
    )[0]
    assert best.stages == stages
    assert best.fused_start == len(costs) - 1  # the head alone: a decoder layer more would not pay


def test_plan_uses_the_free_grain_by_default():
    p = plan_partitions(
        "llama3.1-8b", "8xrtx4090", seq_len=2048, micro_batch_size=4, dtype="fp16", microbatches=16
    )
    assert p.fits
    assert p.forward.bounds[-2] == p.backward.bounds[-2]  # the head stage is fused
    counted = plan_partitions(
        "llama3.1-8b", "8xrtx4090", seq_len=2048, micro_batch_size=4, dtype="fp16", stages=(8, 16)
    )
    assert (counted.forward.num_stages, counted.backward.num_stages) == (8, 16)


# ----------------------------------------------------------------------------- uneven microbatches


def test_microbatch_sizes_follow_the_runtimes_split():
    assert microbatch_sizes(10, 4) == (3, 3, 2, 2)
    assert microbatch_sizes(512, 40) == (13,) * 32 + (12,) * 8
    assert sum(microbatch_sizes(512, 40)) == 512


def test_the_simulator_takes_any_microbatch_count_up_to_the_batch():
    s = Scenario(
        "qwen3-1.7b", "8xrtx4090", "roundpipe", seq_len=2048, global_batch=512, microbatches=40, dtype="fp16"
    )
    assert check_scenario(s)[1:] == (40, 13)
    res = run_scenario(s)
    assert res.num_microbatches == 40 and res.iteration_s > 0
    with pytest.raises(ConfigError, match="1..512"):
        check_scenario(Scenario("qwen3-1.7b", global_batch=512, microbatches=513))


def test_an_uneven_step_costs_its_share_of_an_even_one():
    kw = dict(model="qwen3-0.6b", hardware="8xrtx4090", policy="1f1b", seq_len=1024, microbatches=4)
    opts = SimOptions(transfers=False, optimizer_time=False)
    even = prepare(Scenario(**kw, global_batch=12))  # 3 sequences per microbatch
    uneven = prepare(Scenario(**kw, global_batch=10))  # 3, 3, 2, 2
    assert uneven.workload.microbatch_sizes == (3, 3, 2, 2) and uneven.micro_batch_size == 3
    from roundpipe.sim.simulator import simulate

    r_even = simulate(even.table, even.workload, even.hardware, opts)
    r_uneven = simulate(uneven.table, uneven.workload, uneven.hardware, opts)
    assert sum(r_uneven.compute_busy_s) == pytest.approx(sum(r_even.compute_busy_s) * 10 / 12, rel=1e-9)
    assert r_uneven.tokens_per_s * r_uneven.iteration_s == pytest.approx(10 * 1024)


def test_the_tuner_tries_counts_that_do_not_divide_the_batch():
    assert 16 in microbatch_candidates("roundpipe", 8, 100)  # 100 / 16 is uneven
    assert all(m % 8 == 0 for m in microbatch_candidates("interleaved", 8, 100))
    assert all(m % 2 == 0 for m in microbatch_candidates("chimera", 8, 100))


def test_a_scenario_deals_in_rounds_and_the_host_holds_less():
    # more forward and backward stages than devices: then a round holds back the next (see the policy)
    kw = dict(
        model="qwen3-1.7b", seq_len=2048, global_batch=64, microbatches=64, dtype="fp16", stages=(16, 16)
    )
    whole = run_scenario(Scenario(**kw))
    rounds = run_scenario(Scenario(**kw, round_size=16))
    assert rounds.peak_host_bytes < whole.peak_host_bytes
    with pytest.raises(ConfigError, match="round_size"):
        prepare(Scenario(**{**kw, "policy": "1f1b", "stages": 8}, round_size=16))
