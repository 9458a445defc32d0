"""One plan search: the runtime's automatic choice (``sim/choice.py``), the tuner behind ``roundpipe
plan`` (``sim/tune.py``) and a scenario (``sim/scenario.py``) take their candidates (one
``Candidate`` class, the microbatch counts, a policy's partitions) from ``sim/search.py``, so for the
same inputs they look at the same plans and, judged the same way, pick the same one. Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import roundpipe.sim.tune as tune  # the module; the package also exports a function of that name
from roundpipe.partition.cost import layer_times, model_costs
from roundpipe.partition.memory import device_reserve_bytes
from roundpipe.partition.model_plan import EVERY_LAYER
from roundpipe.presets import load_hardware, load_model_config
from roundpipe.schedule import POLICIES
from roundpipe.sim import choice, scenario, search
from roundpipe.sim.choice import choose
from roundpipe.sim.options import SimOptions
from roundpipe.sim.scenario import Scenario, prepare
from roundpipe.sim.search import microbatch_candidates, partitions

ROOT = Path(__file__).resolve().parents[1] / "roundpipe"
RUNTIME_VIEW = SimOptions(transfers=False, optimizer_time=False)  # what the runtime's choice simulates


def test_there_is_one_candidate_class():
    defined = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "Candidate"
    ]
    assert defined == ["sim/search.py"]
    assert choice.Candidate is tune.Candidate is search.Candidate


@pytest.mark.parametrize(
    "devices, batch, expected",
    [
        (8, 64, [8, 16, 32, 64]),
        (8, 100, [8, 16, 32, 64, 100]),  # uneven: the runtime cuts by sample
        (4, 3, [3]),
        (2, 64, [2, 4, 8, 16]),  # one sample per microbatch only up to 16 per device
    ],
)
def test_microbatch_counts_are_the_devices_times_1_2_4_8_and_the_batch(devices, batch, expected):
    assert microbatch_candidates("1f1b", devices, batch) == expected


def test_a_policy_that_takes_none_of_them_gets_the_largest_multiple_it_takes():
    assert microbatch_candidates("chimera", 4, 3) == [2]
    assert microbatch_candidates("interleaved", 4, 3) == []  # a multiple of 4 samples: none fits


def test_the_scenario_cuts_a_weight_bound_policy_by_the_search_rule():
    s = Scenario(
        "qwen3-0.6b", "4xrtx4090", "1f1b", seq_len=512, global_batch=8, microbatches=4, head_shards=2
    )
    prep = prepare(s)
    costs = model_costs(load_model_config("qwen3-0.6b"), 512, 2, head_shards=2)
    f, b = layer_times(costs, prep.hardware)
    [(fwd, bwd)] = partitions("1f1b", costs, f, b, num_devices=4, microbatches=4)
    assert (prep.table.forward, prep.table.backward) == (fwd, bwd)
    assert scenario.partitions is search.partitions  # the scenario's one rule


def _runtime_choice(model: str, hardware: str, devices: int, seq_len: int, batch: int, policies, shards: int):
    """The runtime's automatic choice for the model as the tuner's cost model times it: the profile
    is the first batch at one microbatch per device, as the runtime takes it."""
    hw, config = load_hardware(hardware), load_model_config(model)
    profiled = batch // devices
    costs = model_costs(config, seq_len, profiled, head_shards=shards)
    f, b = layer_times(costs, hw)
    measured = [(x, y - (x if c.recompute else 0.0)) for x, y, c in zip(f, b, costs)]  # backward alone

    def layer_costs(tokens: float):
        return model_costs(config, seq_len, max(1, round(tokens / seq_len)), head_shards=shards)

    return choose(
        measured, float(seq_len * profiled), layer_costs, num_devices=devices, batch=batch,
        seq_len=seq_len, policies=policies, budget=hw.memory_bytes - device_reserve_bytes(hw),
    )  # fmt: skip


@pytest.mark.parametrize(
    "model, hardware, devices, seq_len, batch, policies, shards",
    [
        ("qwen3-0.6b", "4xrtx4090", 4, 1024, 8, ["1f1b"], "auto"),
        ("qwen3-0.6b", "4xrtx4090", 4, 4096, 8, ["gpipe", "1f1b", "zb"], "auto"),
        ("qwen3-1.7b", "8xrtx4090", 8, 2048, 16, ["gpipe", "1f1b", "zb", "chimera"], "auto"),
        ("qwen3-0.6b", "4xrtx4090", 4, 1024, 8, ["interleaved"], "auto"),  # 4 stages per device
        ("qwen3-1.7b", "8xrtx4090", 8, 2048, 16, ["interleaved"], "auto"),
        ("qwen3-0.6b", "4xrtx4090", 4, 4096, 16, ["roundpipe"], "auto"),  # (4, 8) stages: a count grain
        ("qwen3-0.6b", "4xrtx4090", 4, 4096, 16, ["roundpipe", "1f1b", "interleaved"], "auto"),
        ("qwen3-1.7b", "8xrtx4090", 8, 2048, 16, ["roundpipe"], 4),  # the model's head shards, kept
        ("qwen3-1.7b", "8xrtx4090", 8, 4096, 8, ["roundpipe"], 4),  # (16, 16) stages
    ],
)
def test_roundpipe_plan_and_the_runtime_choice_pick_the_same_plan(
    monkeypatch, model, hardware, devices, seq_len, batch, policies, shards
):
    """The same model, server, batch and policies, judged as the runtime judges (compute only, no
    boundary refinement): ``roundpipe plan``'s tuner and the runtime's automatic choice agree on the
    policy, the microbatch count and both partitions. ``shards``: ``"auto"`` lets the tuner search
    the head's shards (the runtime is handed the count it found); an int is a wrapped model's count,
    which both keep."""
    monkeypatch.setattr(tune, "REFINE_PER_POLICY", 0)  # the runtime does not move boundaries
    tuned = tune.tune(
        model, hardware, seq_len=seq_len, global_batch=batch, num_devices=devices, policies=policies,
        options=RUNTIME_VIEW, time_budget_s=120, head_shards=shards,
    ).best  # fmt: skip
    assert shards == "auto" or tuned.head_shards == shards
    chosen = _runtime_choice(model, hardware, devices, seq_len, batch, policies, tuned.head_shards).best
    assert tuned.fits and tuned.refined == 0
    assert (chosen.policy, chosen.num_microbatches) == (tuned.policy, tuned.num_microbatches)
    assert (chosen.forward, chosen.backward) == (tuned.forward, tuned.backward)


def test_the_runtime_and_the_tuner_consider_the_same_policies_and_counts():
    policies = ["1f1b", "interleaved", "chimera"]
    chosen = _runtime_choice("qwen3-0.6b", "4xrtx4090", 4, 512, 12, policies, 1)
    tuned = tune.tune(
        "qwen3-0.6b", "4xrtx4090", seq_len=512, global_batch=12, num_devices=4, policies=policies,
        options=RUNTIME_VIEW, time_budget_s=120,
    )  # fmt: skip
    expected = {(p, m) for p in policies for m in microbatch_candidates(p, 4, 12)}
    assert {(c.policy, c.num_microbatches) for c in chosen.ranked} == expected
    assert {
        (c.policy, c.num_microbatches)
        for c in tuned.ranked
        if c.stages[0] == POLICIES[c.policy].default_stages(4)
    } == expected


def test_the_runtime_tries_every_stage_grain_the_tuner_tries():
    """Interleaved's 2 and 4 stages per device, roundpipe's objective grains, its (1, 2) and (2, 2)
    stages per device and its finest recompute grain (one layer per backward stage beside 1, 2 and 3
    forward stages per device): the runtime's candidates hold every stage option of
    ``search.stage_options``, as the tuner's grid does."""
    policies = ["roundpipe", "interleaved"]
    chosen = _runtime_choice("qwen3-0.6b", "4xrtx4090", 4, 4096, 16, policies, 1)
    tried = {(c.policy, c.stages) for c in chosen.ranked}
    layers = 28 + 2  # embed, the blocks, the head
    assert {("interleaved", (8, 8)), ("interleaved", (16, 16))} <= tried
    assert {("roundpipe", (4, 8)), ("roundpipe", (8, 8))} <= tried
    finest = {(4, layers), (8, layers), (12, layers)}
    assert {("roundpipe", f) for f in finest} <= tried
    objective = {s for p, s in tried if p == "roundpipe"} - {(4, 8), (8, 8)} - finest
    assert objective  # the objective's own grains besides the count grains
    assert search.stage_options("interleaved", 4) == [8, 16]
    assert search.stage_options("roundpipe", 4) == [
        None, (4, 8), (8, 8), (4, EVERY_LAYER), (8, EVERY_LAYER), (12, EVERY_LAYER)
    ]  # fmt: skip


def test_the_tuner_refines_only_its_refine_top_best_policies(monkeypatch):
    refined: list[str] = []
    real = tune.refine

    def spy(prep, *args, **kwargs):
        refined.append(prep.scenario.policy)
        return real(prep, *args, **kwargs)

    monkeypatch.setattr(tune, "refine", spy)
    tune.tune(
        "qwen3-0.6b", "4xrtx4090", seq_len=1024, global_batch=8, num_devices=4,
        policies=["1f1b", "gpipe", "zb"], options=RUNTIME_VIEW, time_budget_s=120, refine_top=1,
    )  # fmt: skip
    assert len(set(refined)) == 1, refined
