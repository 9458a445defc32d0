"""The data flow of a schedule table (``roundpipe/schedule/flow.py``): fused ops, hand-offs, layers,
the start-device rotation, and that the runtime and the simulator read the same ops.

Property tests over every registered policy, drawn from the facts on its registry entry (stage
counts, partitions, microbatch multiples, rotation).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import roundpipe.runtime.plan as runtime_plan
import roundpipe.sim.operations as sim_operations
import roundpipe.sim.workload as sim_workload
from roundpipe.schedule import POLICIES, Partition, ScheduleTable, build_table, flow, policy_options
from roundpipe.schedule.flow import device_flows
from roundpipe.schedule.rotation import next_start_device, rotation

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def partitions(draw, num_layers: int, num_stages: int | None = None) -> Partition:
    """A random partition of ``num_layers`` layers (into ``num_stages`` stages if given)."""
    k = draw(st.integers(0, num_layers - 1)) if num_stages is None else num_stages - 1
    cuts = sorted(draw(st.permutations(range(1, num_layers)))[:k]) if k else []
    return Partition((0, *cuts, num_layers))


@st.composite
def tables(draw) -> ScheduleTable:
    """A table of any policy, with arguments its registry entry says it accepts."""
    policy = draw(st.sampled_from(sorted(POLICIES)))
    spec = POLICIES[policy]
    devices = draw(st.sampled_from([2, 4, 6]) if spec.even_devices else st.integers(1, 6))
    unit = spec.microbatch_step(devices)
    microbatches = unit * draw(st.integers(1, max(1, 12 // unit)))
    if spec.stages_per_device is None:
        layers = draw(st.integers(1, 10))
        forward = draw(partitions(layers))
        backward = draw(partitions(layers)) if spec.separate_partitions else forward
    else:
        stages = spec.stages_per_device * devices * (1 if spec.exact_stages else draw(st.integers(1, 2)))
        forward = backward = draw(partitions(stages + draw(st.integers(0, 3)), stages))
    options = {}
    if spec.rotates:
        options["start_device"] = draw(st.integers(0, 9))
    if "round_size" in policy_options(policy) and draw(st.booleans()):
        options["round_size"] = draw(st.integers(devices, devices + 4))
    return build_table(policy, forward, backward, devices, microbatches, **options)


def all_ops(table: ScheduleTable, **kwargs):
    return [op for row in device_flows(table, **kwargs) for op in row]


# ----------------------------------------------------------------------------- hand-offs
@SETTINGS
@given(tables())
def test_every_consumed_hand_off_is_produced_once_by_an_op_that_finished_before(table):
    order = {t.key: i for i, t in enumerate(table.execution_order())}
    ops = all_ops(table)
    producer = {}
    for op in ops:
        for key in op.produces:
            assert key not in producer, f"{key} produced by {producer.get(key)} and {op.label}"
            producer[key] = op
    consumed = set()
    for op in ops:
        start = min(order[t.key] for t in op.tasks)
        for key in op.consumes:
            assert key[2] == op.microbatch
            assert key in producer, f"{op.label} consumes {key}, which no op produces"
            done = max(order[t.key] for t in producer[key].tasks)
            assert done < start, f"{op.label} consumes {key} before {producer[key].label} made it"
            consumed.add(key)
    assert consumed == set(producer), "every hand-off left on the host has a consumer"


@SETTINGS
@given(tables())
def test_each_op_runs_the_layers_its_hand_offs_bound(table):
    n = table.forward.num_layers
    backward_layers: dict[int, list[range]] = {}
    for op in all_ops(table):
        w = op.work
        acts_in = [b for name, b in w.consumes if name == "act"]
        if w.kind == "W":
            assert not op.consumes and not op.produces and w.weight_grads
            continue
        ran = w.fwd_layers if w.kind == "F" or w.fwd_layers else w.bwd_layers
        assert acts_in == ([ran.start] if ran.start > 0 else []), f"{op.label} starts at its input"
        for name, b in w.produces:
            if name == "act":
                assert w.fwd_layers.start < b <= w.fwd_layers.stop, f"{op.label} leaves act[{b}] it computed"
            else:
                assert b == w.bwd_layers.start > 0, f"{op.label} sends down the gradient at its start"
        if w.kind != "F":
            backward_layers.setdefault(op.microbatch, []).append(w.bwd_layers)
            grads_in = [b for name, b in w.consumes if name == "grad"]
            assert grads_in == ([w.bwd_layers.stop] if w.bwd_layers.stop < n else [])
        assert w.recompute == (w.kind != "FB")
    for j, spans in backward_layers.items():
        layers = sorted(i for r in spans for i in r)
        assert layers == list(range(n)), f"microbatch {j} backpropagates every layer once"


# ----------------------------------------------------------------------------- fusion
def _rule_says_fused(table: ScheduleTable, f, b) -> bool:
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    return (
        (f.kind, f.stage) == ("F", last_f)
        and b.kind in ("B", "I")
        and b.stage == last_b
        and b.microbatch == f.microbatch
        and table.forward.bounds[last_f] <= table.backward.bounds[last_b]
    )


@SETTINGS
@given(tables(), st.randoms(use_true_random=False))
def test_ops_are_fused_exactly_where_the_rule_says(table, rnd):
    # Shuffled rows too: the rule reads only adjacency, so it must hold for any order.
    shuffled = tuple(tuple(rnd.sample(row, len(row))) for row in table.devices)
    for t in (table, ScheduleTable(shuffled, table.forward, table.backward, table.num_microbatches)):
        rows = device_flows(t)
        for row, ops in zip(t.devices, rows):
            assert tuple(task for op in ops for task in op.tasks) == row, "ops keep the row's order"
            assert all(op.fused == (op.work.kind == "FB") for op in ops)
            # A fusable pair starts with an F and ends with a B or I, so two such pairs never share
            # a task: every adjacent pair the rule accepts is one op.
            expected = [(a, b) for a, b in zip(row, row[1:]) if _rule_says_fused(t, a, b)]
            assert [op.tasks for op in ops if op.fused] == expected
        assert t.fused_pairs() == [op.tasks for row in rows for op in row if op.fused]
        assert not any(op.fused for op in all_ops(t, fuse=False))


def test_the_head_pair_runs_apart_when_the_last_forward_stage_starts_after_the_last_backward_stage():
    # The fused forward would start at layer 3 but the backward needs layer 2's recompute too.
    table = build_table("roundpipe", Partition((0, 3, 4)), Partition((0, 2, 4)), 2, 2)
    assert ("F1.0", "B1.0") in [(str(a), str(b)) for row in table.devices for a, b in zip(row, row[1:])]
    ops = {op.label: op.work for op in all_ops(table)}
    assert not any(op.fused for op in all_ops(table)) and table.fused_pairs() == []
    assert ops["F1.0"].fwd_layers == range(3, 3) and ops["F0.0"].produces == (("act", 2), ("act", 3))
    assert ops["B1.0"].bwd_layers == range(2, 4) and ops["B1.0"].first_forward


@SETTINGS
@given(tables())
def test_ops_of_one_kind_and_stage_share_one_work(table):
    by_stage: dict[tuple, set[int]] = {}
    for op in all_ops(table):
        key = ("FB",) if op.fused else (op.task.kind, op.task.stage)
        by_stage.setdefault(key, set()).add(id(op.work))
    assert all(len(ids) == 1 for ids in by_stage.values())


def test_a_full_forward_runs_each_forward_stage_whole_and_no_backward_pays_a_forward():
    table = build_table("roundpipe", Partition((0, 2, 4)), Partition((0, 1, 3, 4)), 2, 2)
    lazy = {op.label: op.work for op in all_ops(table, fuse=False)}
    full = {op.label: op.work for op in all_ops(table, fuse=False, full_forward=True)}
    assert lazy["F1.0"].fwd_layers == range(2, 3)  # only up to the last backward start inside it
    assert full["F1.0"].fwd_layers == range(2, 4)
    assert lazy["B2.0"].first_forward and not full["B2.0"].first_forward


# ----------------------------------------------------------------------------- rotation
def _deals(table: ScheduleTable) -> int:
    """Runs of one stage over one round's microbatches on one device; the head pair (last F and last
    B, interleaved) is one deal."""
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    size = table.options.get("round_size") or table.num_microbatches
    runs = 0
    for row in table.devices:
        prev = None
        for t in row:
            head = (t.kind, t.stage) in (("F", last_f), ("B", last_b))
            key = ("head" if head else (t.kind, t.stage), t.microbatch // size)
            runs += key != prev
            prev = key
    return runs


@SETTINGS
@given(tables())
def test_the_next_step_starts_after_the_last_deal_for_rotating_policies_only(table):
    start = int(table.options.get("start_device", 0))
    if POLICIES[table.policy].rotates:
        d = table.num_devices
        last_deal = table.locate()[("B", 0, table.num_microbatches - 1)][0]
        assert rotation(table) == _deals(table) % d
        assert next_start_device(table) == (start + _deals(table)) % d == (last_deal + 1) % d
    else:
        assert rotation(table) == 0 and next_start_device(table) == start


# ----------------------------------------------------------------------------- runtime == simulator
@SETTINGS
@given(tables())
def test_the_runtime_flow_plan_and_the_simulator_ops_are_the_same_ops(table):
    assume(not table.split_backward)  # the runtime does not execute I/W yet
    plan = runtime_plan.build_flow_plan(table)
    sim_ops = sim_workload.device_ops(table)

    def runtime_view(f):
        label = str(f.task) + (f"+{f.fused_with}" if f.fused_with else "")
        return label, f.layers_fwd, f.layers_bwd, f.consumes, f.produces

    def sim_view(op):
        return op.label, op.fwd_layers, op.bwd_layers, op.consumes, op.produces

    assert [[runtime_view(f) for f in row] for row in plan.flows] == [
        [sim_view(o) for o in row] for row in sim_ops
    ]
    assert plan.consumers == Counter(k for row in sim_ops for op in row for k in op.consumes)


def test_the_runtime_and_the_simulator_read_one_flow_function():
    assert (
        runtime_plan.device_flows
        is sim_operations.device_flows
        is sim_workload.device_flows
        is flow.device_flows
    )


def test_the_runtime_refuses_a_split_backward_by_task():
    table = build_table("zb", Partition.per_layer(2), Partition.per_layer(2), 2, 2)
    with pytest.raises(NotImplementedError, match=r"task kind [IW] \([IW]\d\.\d\) is not executed"):
        runtime_plan.build_flow_plan(table)
