"""The best plan by default: RunConfig's policy, partition and microbatch count are "auto", chosen
after the first batch's profile, cached, pinned by any explicit value, and reported with reasons."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support.reference import EPS, LR
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.config import known_policies
from roundpipe.errors import ConfigError, DeviceMemoryError, PlanError
from roundpipe.partition.cost import LayerCost
from roundpipe.partition.grain import grain_choices
from roundpipe.presets import load_hardware
from roundpipe.runtime.pipeline import Pipeline
from roundpipe.schedule import POLICIES, Partition
from roundpipe.sim.choice import choose
from roundpipe.sim.options import SimOptions
from roundpipe.sim.search import OBJECTIVE_GRAINS, stage_plans
from roundpipe.sim.simulator import simulate
from roundpipe.sim.workload import LayerWork, Workload
from roundpipe.testing import faults

torch.set_num_threads(1)

EXECUTABLE = [p for p in POLICIES if p in known_policies()]


def _fb(pipe, batch):
    return pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
    )


def _count_profiles(monkeypatch) -> list[int]:
    calls: list[int] = []
    profile = Pipeline._profile  # what profile() and the first forward_backward both run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return profile(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "_profile", counted)
    return calls


# ----------------------------------------------------------------------------- configuration
def test_the_defaults_are_auto_and_the_optimizer_stays_exact():
    config = roundpipe.RunConfig()
    assert (config.policy, config.partition, config.num_microbatches) == ("auto", "auto", "auto")
    assert config.optimizer_mode == "sync"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "zigzag"}, "choose 'auto' or one of 1f1b, chimera"),
        ({"policy_options": {"no_such_option": 1}}, "no policy takes the options no_such_option"),
        ({"backward_partition": (2, 2)}, "backward_partition needs partition too"),
        ({"round_size": 2, "policy": "1f1b"}, "which policy '1f1b' does not do"),
    ],
)
def test_auto_values_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        roundpipe.RunConfig(**kwargs)


def test_round_size_with_the_auto_policy_keeps_to_the_policies_that_deal_in_rounds():
    config = roundpipe.RunConfig(round_size=2)  # valid: "auto" then only considers roundpipe
    assert config.policy == "auto"


# ----------------------------------------------------------------------------- the choice on the runtime
@pytest.mark.slow  # ~15 s: it profiles a model whose head dominates
def test_before_the_first_batch_auto_runs_as_roundpipe_and_says_so():
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        plan = pipe.plan
        assert pipe.layer_times is None
    assert plan.policy == "roundpipe" and plan.num_microbatches is None
    assert len([r for r in plan.rows if r["kind"] == "F"]) == 4  # one layer per stage
    for part in ("policy", "partition", "num_microbatches"):
        assert "until the first batch is profiled" in plan.why[part], part


def test_the_choice_is_made_on_the_first_step_cached_and_reported_with_reasons(monkeypatch):
    profiles = _count_profiles(monkeypatch)
    batch = make_batch(batch=6)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS)
        _fb(pipe, batch)
        pipe.step()
        assert profiles == [1] and pipe.layer_times is not None
        first = pipe.last_plan.table
        plan = pipe.plan
        _fb(pipe, batch)
        pipe.step()
        second = pipe.last_plan.table
        assert profiles == [1]  # once: the choice is cached
    assert (second.policy, second.forward, second.backward) == (first.policy, first.forward, first.backward)
    assert second.num_microbatches == first.num_microbatches
    assert plan.policy == first.policy and plan.num_microbatches == first.num_microbatches
    assert 2 <= plan.num_microbatches <= 6  # every device busy, at most one sample each
    assert plan.why["policy"].startswith(f"auto: {plan.policy}") and "predicted" in plan.why["policy"]
    assert plan.why["partition"].startswith("auto: ")
    assert plan.why["num_microbatches"].startswith(f"auto: {plan.num_microbatches} for a batch of 6")
    text = str(plan)
    assert all(line in text for line in plan.why.values())
    assert plan.predictions and plan.predictions[0]["predicted_step_s"] > 0
    chosen = {"policy": plan.policy, "num_microbatches": plan.num_microbatches}
    assert any(chosen.items() <= p.items() for p in plan.predictions)


@pytest.mark.parametrize(
    ("pinned", "check"),
    [
        ({"policy": "1f1b"}, lambda t: t.policy == "1f1b"),
        ({"partition": (2, 1, 1)}, lambda t: t.forward == t.backward == Partition.from_sizes((2, 1, 1))),
        ({"num_microbatches": 3}, lambda t: t.num_microbatches == 3),
    ],
    ids=["policy", "partition", "num_microbatches"],
)
def test_an_explicit_value_pins_its_part_and_the_rest_is_chosen(pinned, check):
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2", **pinned)) as pipe:
        _fb(pipe, make_batch(batch=6))
        table, plan = pipe.last_plan.table, pipe.plan
    assert check(table)
    (part,) = pinned
    assert plan.why[part] == "given by RunConfig"
    for other in {"policy", "partition", "num_microbatches"} - {part}:
        assert plan.why[other].startswith("auto: "), other


def test_nothing_auto_means_no_profile(monkeypatch):
    profiles = _count_profiles(monkeypatch)
    config = roundpipe.RunConfig(devices="cpu:2", policy="roundpipe", partition=None, num_microbatches=2)
    with roundpipe.wrap(make_model("llama"), config) as pipe:
        _fb(pipe, make_batch(batch=4))
        assert pipe.layer_times is None and pipe.last_plan.table.forward.num_stages == 4
    assert profiles == []


def test_roundpipe_with_partition_auto_tries_the_free_grain_not_a_multiple_of_the_devices():
    """The runtime picks among the search's candidates for its measured times, and those include
    the RoundPipe objective's free grain (a stage count that need not be a multiple of the
    devices) besides the per-device counts. Which candidate wins depends on the measured times."""
    model = make_model("llama", num_layers=5)  # 7 layers
    config = roundpipe.RunConfig(devices="cpu:2", policy="roundpipe", num_microbatches=4)
    with roundpipe.wrap(model, config) as pipe:
        _fb(pipe, make_batch(batch=8))
        table, times = pipe.last_plan.table, pipe._planner._measured
        costs = pipe._planner._layer_costs(times[1])
    per_layer = times[0]
    fwd = [f for f, _ in per_layer]
    bwd = [b + (f if c.recompute else 0.0) for (f, b), c in zip(per_layer, costs)]
    pairs, why = stage_plans("roundpipe", costs, fwd, bwd, num_devices=2, microbatches=4)
    assert why == [] and (table.forward, table.backward) in pairs
    grains = grain_choices(costs, fwd, bwd, num_devices=2, microbatches=4, limit=OBJECTIVE_GRAINS)
    assert all((g.forward, g.backward) in pairs for g in grains)  # the free grains are all tried


def test_each_batch_shape_gets_its_own_choice_from_the_one_profile(monkeypatch):
    """A smaller last batch or a held-out batch is planned for its own size from the same measured
    times: no second profile, and never more microbatches than samples."""
    profiles = _count_profiles(monkeypatch)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS)
        _fb(pipe, make_batch(batch=8))
        pipe.step()
        big = pipe.last_plan.table
        assert pipe.evaluate(**make_batch(batch=3, seed=1)).loss > 0
        _fb(pipe, make_batch(batch=3, seed=2))
        small = pipe.last_plan.table
        assert pipe.plan.why["num_microbatches"].startswith(
            f"auto: {small.num_microbatches} for a batch of 3"
        )
    assert profiles == [1]
    assert small.num_microbatches <= 3 < big.num_microbatches


def test_a_checkpoint_carries_the_profile_so_a_resumed_run_makes_the_same_choice(monkeypatch):
    model = make_model("llama", lora="default")
    batch = make_batch(batch=6)
    with roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS)
        _fb(pipe, batch)
        pipe.step()
        state, table = pipe.state_dict(), pipe.last_plan.table
    assert set(state["measured"]["layer_times"]) == {"embed", "layers.0", "layers.1", "head"}
    profiles = _count_profiles(monkeypatch)
    with roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS)
        pipe.load_state_dict(state)
        _fb(pipe, batch)
        resumed = pipe.last_plan.table
    assert profiles == []
    assert (resumed.policy, resumed.forward, resumed.backward) == (
        table.policy,
        table.forward,
        table.backward,
    )
    assert resumed.num_microbatches == table.num_microbatches


# ----------------------------------------------------------------------------- the chooser (torch-free)
def _costs(n: int):
    """``n`` layers, the last the head (no recompute), every one trainable; bytes play no part."""

    def costs(tokens: float) -> list[LayerCost]:
        return [
            LayerCost(
                f"l{i}",
                0.0,
                0.0,
                param_bytes=1 << 20,
                trainable_params=1,
                act_in_bytes=int(tokens) * 8,
                work_bytes=int(tokens) * 64,
                kind="head" if i == n - 1 else "block",
                recompute=i < n - 1,
            )  # fmt: skip
            for i in range(n)
        ]

    return costs


def _times(n: int, seed: int = 0) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [(1e-3 * (1 + 0.1 * rng.random()), 2e-3 * (1 + 0.1 * rng.random())) for _ in range(n)]


def test_the_chooser_is_deterministic_and_prefers_repeatable_plans():
    """On 2 devices chimera's two pipelines are predicted fastest, but each stage's gradients then
    reach the host from two devices in arrival order; the default takes the fastest plan that sums
    each stage on one device, and chimera runs when it is named."""
    args = dict(num_devices=2, batch=8, seq_len=16, policies=EXECUTABLE)
    times = _times(6)
    a = choose(times, 64.0, _costs(6), **args)
    b = choose(times, 64.0, _costs(6), **args)
    assert a == b
    assert a.ranked[0].policy == "chimera" and not a.ranked[0].repeatable
    assert a.best.policy != "chimera" and a.best.repeatable
    assert a.faster_unrepeatable is a.ranked[0]
    named = choose(times, 64.0, _costs(6), **{**args, "policies": ["chimera"]})
    assert named.best.policy == "chimera"


def test_a_count_above_twice_the_devices_is_predicted_by_the_steady_state():
    """Counts above 2D extrapolate from the 2D simulation by the busiest device's work per
    microbatch: on even stages that is the simulated step itself."""
    n, d = 9, 3
    times = [(1e-3, 2e-3)] * (n - 1) + [(3e-3, 3e-3)]
    choice = choose(
        times, 64.0, _costs(n), num_devices=d, batch=48, seq_len=4, policies=["1f1b"], microbatches=24
    )
    best = choice.best
    assert not best.simulated and best.num_microbatches == 24
    tokens = 48 * 4 / 24
    layers = tuple(
        LayerWork(f"l{i}", f / 64 * tokens, b / 64 * tokens, recompute=i < n - 1, trainable_params=1)
        for i, (f, b) in enumerate(times)
    )
    table = POLICIES["1f1b"](best.forward, best.backward, d, 24)
    options = SimOptions(transfers=False, optimizer_time=False, record_timeline=False)
    direct = simulate(table, Workload(layers), load_hardware(f"{d}xcpu"), options).iteration_s
    assert best.step_s == pytest.approx(direct, rel=0.02)


def test_no_candidate_is_a_plan_error_naming_why():
    with pytest.raises(PlanError, match="interleaved: takes no microbatch count of a batch of 1"):
        choose(_times(6), 64.0, _costs(6), num_devices=2, batch=1, seq_len=8, policies=["interleaved"])


def test_a_device_as_small_as_one_layer_per_stage_needs_still_trains_on_the_defaults():
    """Under a tight capacity the choice keeps every candidate stage within the estimated bytes;
    what it runs stays within the device, also when every gradient download is slow, so that the
    previous stage's fp32 gradients are still on the device while the next stage's fill (CI once
    ran out of memory there: the plans' memory rule did not count them)."""
    from support.memory_oracle import (
        device_of,
        gradients_downloading,
        hand_offs_in_flight,
        microbatches_of,
        slow_gradient_downloads,
        working_set,
    )

    model = make_model("qwen3", num_layers=3)
    batch = make_batch(batch=4)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1")) as probe:
        two_layers = sum(sorted(probe.store.layer_bytes)[-2:])
        downloading = gradients_downloading(probe.store)
    split = microbatches_of(batch, 2)
    need = two_layers + downloading + working_set(model, split) + hand_offs_in_flight(model, split)
    slow_downloads = slow_gradient_downloads()
    for plan in ([], [slow_downloads]):
        config = roundpipe.RunConfig(devices="cpu:2", device_capacity=device_of(need))
        with faults.injected(*plan), roundpipe.wrap(model, config) as pipe:
            assert _fb(pipe, batch).loss > 0
            assert pipe.plan.why["policy"].startswith("auto: ")
            assert all(d.memory.peak <= need for d in pipe.backend.devices)
    assert slow_downloads.fired > 0
    # Without room for the gradients still downloading no plan fits: refused before any work, not
    # out of memory half-way through a step.
    config = roundpipe.RunConfig(devices="cpu:2", device_capacity=device_of(need - downloading))
    with (
        faults.injected(slow_gradient_downloads()),
        roundpipe.wrap(model, config) as pipe,
        pytest.raises(DeviceMemoryError, match="Levers"),
    ):
        _fb(pipe, batch)


def test_when_no_candidate_fits_the_estimates_auto_runs_the_least_memory_plan(monkeypatch):
    import roundpipe.sim.choice as choice

    def nothing_fits(*args, **kwargs):
        raise PlanError("no stage grain fits the per-device budget")

    monkeypatch.setattr(choice, "choose", nothing_fits)
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2")) as pipe:
        _fb(pipe, make_batch(batch=4))
        table, plan = pipe.last_plan.table, pipe.plan
    assert table.policy == "roundpipe" and table.forward.num_stages == 4 and table.num_microbatches == 2
    assert "no candidate fits the estimated memory" in plan.why["policy"]
    with (
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:2", policy="1f1b")) as pipe,
        pytest.raises(PlanError, match="per-device budget"),
    ):
        _fb(pipe, make_batch(batch=4))  # a policy given: the error is the user's to act on


def test_a_plan_lists_its_chosen_candidate_even_when_slower_ones_were_preferred():
    from roundpipe.runtime.planning import SHOWN_PREDICTIONS, shown_predictions
    from roundpipe.sim.choice import Candidate, Choice

    part = Partition.from_sizes((1, 1))
    ranked = tuple(
        Candidate("1f1b", 2 + i, part, part, step_s=1.0 + i / 10, repeatable=i >= SHOWN_PREDICTIONS)
        for i in range(SHOWN_PREDICTIONS + 2)
    )
    chosen = ranked[SHOWN_PREDICTIONS]  # the fastest repeatable one ranks below the shown five
    shown = shown_predictions(Choice(best=chosen, ranked=ranked))
    assert [p["num_microbatches"] for p in shown] == [
        c.num_microbatches for c in ranked[:SHOWN_PREDICTIONS]
    ] + [chosen.num_microbatches]
    shown = shown_predictions(Choice(best=ranked[1], ranked=ranked))
    assert len(shown) == SHOWN_PREDICTIONS  # listed once when it is among the fastest
    assert shown_predictions(None) == ()
