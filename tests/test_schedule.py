"""The schedule-table IR: dependencies, validation, dry runs, serialisation and every policy.

Pure Python (no torch). Property tests draw devices 1..8, microbatches 1..16 and random partitions.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe.errors import ScheduleError
from roundpipe.schedule import (
    POLICIES,
    Partition,
    ScheduleTable,
    Task,
    TaskKey,
    build_table,
    dependencies,
    dry_run,
    required_tasks,
)
from roundpipe.schedule.deps import boundaries_left_by, forward_stage_covering

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
P = Partition.per_layer
UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


# ---------------------------------------------------------------- helpers


@st.composite
def partitions(draw, num_layers: int, num_stages: int | None = None) -> Partition:
    """A random partition of ``num_layers`` layers (into ``num_stages`` stages if given)."""
    inner = list(range(1, num_layers))
    k = draw(st.integers(0, num_layers - 1)) if num_stages is None else num_stages - 1
    cuts = sorted(draw(st.permutations(inner))[:k]) if k else []
    return Partition((0, *cuts, num_layers))


@st.composite
def policy_args(draw, policy: str):
    """Arguments that ``policy`` accepts: (forward, backward, devices, microbatches, options)."""
    if policy == "chimera":
        devices = draw(st.sampled_from([2, 4, 6, 8]))
    else:
        devices = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 16))
    options: dict = {}
    if policy == "roundpipe":
        layers = draw(st.integers(1, 12))
        forward, backward = draw(partitions(layers)), draw(partitions(layers))
        options["start_device"] = draw(st.integers(0, 9))
        low, high = min(devices, microbatches), max(devices, microbatches)
        options["round_size"] = draw(st.none() | st.integers(low, high))
        return forward, backward, devices, microbatches, options
    stages = devices
    if policy == "interleaved":
        stages = devices * draw(st.integers(1, 3))
        microbatches = devices * draw(st.integers(1, 16 // devices))
    if policy == "hanayo":
        options["waves"] = draw(st.integers(1, 2))
        stages = 2 * options["waves"] * devices
    layers = stages + draw(st.integers(0, 4))
    forward = draw(partitions(layers, stages))
    return forward, forward, devices, microbatches, options


def any_policy_args():
    return st.sampled_from(sorted(POLICIES)).flatmap(lambda p: st.tuples(st.just(p), policy_args(p)))


def makespan(table: ScheduleTable) -> int:
    """Strict in-order execution on the unit grid (F = 1, B = 2, I = W = 1)."""
    finish: dict[TaskKey, int] = {}
    free = [0] * table.num_devices
    for t in table.execution_order():
        start = max([free[t.device]] + [finish[k] for k in table.dependencies(t)])
        finish[t.key] = free[t.device] = start + UNIT[t.kind]
    return max(free)


def peak_in_flight(row, closes: str = "B") -> int:
    """Most microbatches whose F ran on this row and whose ``closes`` task has not."""
    held = peak = 0
    for t in row:
        held += (t.kind == "F") - (t.kind == closes)
        peak = max(peak, held)
    return peak


def has_cycle(table: ScheduleTable) -> bool:
    """Reference check: do dependencies + "next in the same row" edges form a cycle? (Kahn)"""
    edges: dict[TaskKey, list[TaskKey]] = {t.key: [] for t in table.tasks()}
    indegree = dict.fromkeys(edges, 0)
    for row in table.devices:
        for a, b in zip(row, row[1:]):
            edges[a.key].append(b.key)
            indegree[b.key] += 1
    for t in table.tasks():
        for k in table.dependencies(t):
            edges[k].append(t.key)
            indegree[t.key] += 1
    queue = [k for k, n in indegree.items() if n == 0]
    seen = 0
    while queue:
        k = queue.pop()
        seen += 1
        for x in edges[k]:
            indegree[x] -= 1
            if indegree[x] == 0:
                queue.append(x)
    return seen < len(edges)


def with_rows(table: ScheduleTable, rows) -> ScheduleTable:
    devices = tuple(tuple(Task(t.kind, t.stage, t.microbatch, d) for t in row) for d, row in enumerate(rows))
    return ScheduleTable(devices, table.forward, table.backward, table.num_microbatches, table.policy)


def head_tasks(table: ScheduleTable, j: int) -> tuple[Task, Task]:
    """The last forward and the first backward-side task of the head stage for microbatch ``j``."""
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    by_key = {t.key: t for t in table.tasks()}
    back = by_key.get(TaskKey("B", last_b, j)) or by_key[TaskKey("I", last_b, j)]
    return by_key[TaskKey("F", last_f, j)], back


# ---------------------------------------------------------------- dependencies


def test_dependencies_follow_the_boundary_data_flow_with_different_partitions():
    forward, backward = Partition((0, 3, 6)), Partition((0, 2, 4, 6))

    def deps(kind: str, stage: int, split: bool = False) -> list[TaskKey]:
        return dependencies(TaskKey(kind, stage, 5), forward, backward, split_backward=split)

    assert deps("F", 0) == []
    assert deps("F", 1) == [TaskKey("F", 0, 5)]
    assert deps("B", 0) == [TaskKey("B", 1, 5)]  # boundary 0 is the batch
    assert deps("B", 1) == [TaskKey("F", 0, 5), TaskKey("B", 2, 5)]  # layer 2 is inside F0 = [0, 3)
    assert deps("B", 2) == [TaskKey("F", 1, 5)]  # head stage: activation at 4 and the head F are F1
    assert deps("I", 1, True) == [TaskKey("F", 0, 5), TaskKey("I", 2, 5)]
    assert deps("W", 1, True) == [TaskKey("I", 1, 5)]


def test_a_backward_starting_where_a_forward_stage_starts_waits_for_the_stage_before():
    forward, backward = Partition((0, 2, 4)), Partition((0, 2, 3, 4))
    assert dependencies(TaskKey("B", 1, 0), forward, backward) == [TaskKey("F", 0, 0), TaskKey("B", 2, 0)]
    assert dependencies(TaskKey("B", 2, 0), forward, backward) == [TaskKey("F", 1, 0)]
    assert forward_stage_covering(0, forward) is None
    assert [forward_stage_covering(b, forward) for b in (1, 2, 3, 4)] == [0, 0, 1, 1]


def test_a_small_head_backward_stage_still_waits_for_the_head_forward():
    forward, backward = Partition((0, 4)), Partition((0, 1, 4))
    assert dependencies(TaskKey("B", 1, 0), forward, backward) == [TaskKey("F", 0, 0)]
    forward, backward = Partition((0, 1, 2, 3)), Partition((0, 3))
    assert dependencies(TaskKey("B", 0, 2), forward, backward) == [TaskKey("F", 2, 2)]


def test_boundaries_left_by_a_forward_stage_are_its_output_and_inner_backward_starts():
    forward, backward = Partition((0, 3, 6)), Partition((0, 2, 4, 6))
    assert boundaries_left_by(0, forward, backward) == [2, 3]
    assert boundaries_left_by(1, forward, backward) == [4]


def test_dependencies_reject_unknown_kinds_and_stages():
    with pytest.raises(ScheduleError, match="unknown kind"):
        dependencies(TaskKey("X", 0, 0), P(2), P(2))
    with pytest.raises(ScheduleError, match="backward partition has 2 stages"):
        dependencies(TaskKey("B", 2, 0), P(2), P(2))


# ---------------------------------------------------------------- exact small tables


def rows(table: ScheduleTable) -> list[str]:
    return table.to_text().splitlines()


def test_1f1b_on_2_devices_and_4_microbatches():
    assert rows(build_table("1f1b", P(2), P(2), 2, 4)) == [
        "d0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3",
        "d1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3",
    ]


def test_gpipe_runs_backward_in_reverse_so_the_head_fuses():
    table = build_table("gpipe", P(2), P(2), 2, 3)
    assert rows(table) == ["d0: F0.0 F0.1 F0.2 B0.2 B0.1 B0.0", "d1: F1.0 F1.1 F1.2 B1.2 B1.1 B1.0"]
    assert [(str(f), str(b)) for f, b in table.fused_pairs()] == [("F1.2", "B1.2")]


def test_interleaved_matches_megatron_on_2_devices_2_chunks_4_microbatches():
    assert rows(build_table("interleaved", P(4), P(4), 2, 4)) == [
        "d0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        "d1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
    ]


def test_zb_defers_weight_gradients_on_later_devices():
    assert rows(build_table("zb", P(2), P(2), 2, 3)) == [
        "d0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2",
        "d1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2",
    ]


def test_chimera_sends_even_microbatches_down_and_odd_ones_up():
    assert rows(build_table("chimera", P(4), P(4), 4, 2)) == [
        "d0: F0.0 F3.1 B3.1 B0.0",
        "d1: F1.0 F2.1 B2.1 B1.0",
        "d2: F1.1 F2.0 B2.0 B1.1",
        "d3: F0.1 F3.0 B3.0 B0.1",
    ]


def test_hanayo_zig_zags_stages_and_turns_around_on_the_last_device():
    table = build_table("hanayo", P(8), P(8), 2, 2)
    stages_on = [sorted({t.stage for t in row}) for row in table.devices]
    assert stages_on == [[0, 3, 4, 7], [1, 2, 5, 6]]
    assert table.options == {"waves": 2, "weight_bound": True}


def test_roundpipe_deals_stages_round_robin_with_a_fused_head():
    table = build_table("roundpipe", Partition((0, 2, 4)), Partition((0, 1, 2, 3, 4)), 3, 2)
    assert rows(table) == [
        "d0: F0.0 F0.1 B1.0 B1.1",
        "d1: F1.0 B3.0 F1.1 B3.1 B0.0 B0.1",
        "d2: B2.0 B2.1",
    ]
    assert table.options == {"start_device": 0, "round_size": None, "weight_bound": False}
    assert len(table.fused_pairs()) == 2


# ---------------------------------------------------------------- every policy, property-based


@SETTINGS
@given(any_policy_args())
def test_every_policy_builds_a_valid_table_with_the_head_on_one_device(case):
    policy, (forward, backward, devices, microbatches, options) = case
    table = build_table(policy, forward, backward, devices, microbatches, **options)
    assert table.policy == policy and table.num_devices == devices
    assert table.options["weight_bound"] is (policy != "roundpipe")
    assert table.weight_bound is (policy != "roundpipe")
    assert all(t.device == d for d, row in enumerate(table.devices) for t in row)
    assert sorted(t.key for t in table.tasks()) == sorted(
        required_tasks(forward, backward, microbatches, split_backward=policy == "zb")
    )
    for j in range(microbatches):
        head_f, head_b = head_tasks(table, j)
        assert head_f.device == head_b.device
    assert len(table.execution_order()) == len(list(table.tasks()))


@SETTINGS
@given(
    st.sampled_from(sorted(POLICIES)),
    st.integers(1, 8),
    st.integers(1, 16),
    st.integers(1, 12).flatmap(lambda n: st.tuples(partitions(n), partitions(n))),
    st.booleans(),
)
def test_policies_either_build_a_valid_table_or_raise_schedule_error(
    policy, devices, microbatches, parts, same
):
    forward, backward = parts
    try:
        table = build_table(policy, forward, forward if same else backward, devices, microbatches)
    except ScheduleError as e:
        assert "; " in str(e) or ". " in str(e)  # the message says what to change
    else:
        table.validate()


@pytest.mark.parametrize(
    "policy, forward, backward, devices, microbatches, options, message",
    [
        ("gpipe", P(3), P(3), 2, 4, {}, "partition the model into 2 stages"),
        ("1f1b", P(2), Partition((0, 2)), 2, 4, {}, "equal forward and backward partitions"),
        ("zb", P(4), P(4), 2, 4, {}, "needs 2 stages"),
        ("interleaved", P(4), P(4), 2, 3, {}, "Use 2 or 4 microbatches"),
        ("interleaved", P(4), P(4), 4, 2, {}, "Use 4 microbatches"),
        ("interleaved", P(6), P(6), 4, 4, {}, "a multiple of 4 stages"),
        ("interleaved", P(4), P(4), 2, 4, {"virtual_stages": 3}, "3 \\* 2 = 6 stages"),
        ("chimera", P(3), P(3), 3, 4, {}, "even number of devices; got 3. Use 2 or 4 devices"),
        ("chimera", P(1), P(1), 1, 4, {}, "Use 2 devices"),
        ("hanayo", P(6), P(6), 2, 4, {}, "a multiple of 2 \\* num_devices = 4"),
        ("hanayo", P(4), P(4), 2, 4, {"waves": 2}, "2 \\* waves \\* num_devices = 8"),
        ("roundpipe", P(2), P(3), 2, 4, {}, "cuts 2 layers but the backward one 3"),
        ("roundpipe", P(2), P(2), 0, 4, {}, "num_devices must be a positive integer"),
        ("roundpipe", P(2), P(2), 2, 0, {}, "num_microbatches must be a positive integer"),
        ("roundpipe", P(2), P(2), 2, 1, {"start_device": -1}, "start_device must be"),
        ("1f1b", P(2), P(2), 2, 4, {"waves": 2}, "policy '1f1b' has no option waves; it takes no options"),
        ("hanayo", P(4), P(4), 2, 4, {"wave": 1}, "it takes waves"),
        ("pipedream", P(2), P(2), 2, 4, {}, "known policies: roundpipe, gpipe, 1f1b"),
    ],
)
def test_bad_arguments_raise_schedule_error_saying_what_to_change(
    policy, forward, backward, devices, microbatches, options, message
):
    with pytest.raises(ScheduleError, match=message):
        build_table(policy, forward, backward, devices, microbatches, **options)


# ---------------------------------------------------------------- broken tables


@SETTINGS
@given(any_policy_args(), st.data())
def test_a_backward_moved_before_its_forward_is_a_deadlock_naming_the_device(case, data):
    policy, (forward, backward, devices, microbatches, options) = case
    table = build_table(policy, forward, backward, devices, microbatches, **options)
    j = data.draw(st.integers(0, microbatches - 1))
    head_f, head_b = head_tasks(table, j)
    row = list(table.devices[head_f.device])
    row.remove(head_b)
    at = row.index(head_f)
    row.insert(at, head_b)
    broken = with_rows(table, [row if d == head_f.device else r for d, r in enumerate(table.devices)])
    with pytest.raises(ScheduleError) as err:
        broken.validate()
    msg = str(err.value)
    assert f"waiting cycle d{head_f.device} -> d{head_f.device}" in msg
    assert (
        f"blocked at {head_b} (position {at}) needing {head_f}, held by itself later at position {at + 1}"
        in msg
    )


def test_two_devices_waiting_on_each_other_are_reported_as_a_cycle():
    table = ScheduleTable.from_text(
        "d0: F0.0 B0.0 F0.1 B0.1\nd1: F1.1 F1.0 B1.0 B1.1", P(2), P(2), num_microbatches=2
    )
    with pytest.raises(ScheduleError) as err:
        table.validate()
    assert str(err.value).startswith(
        "strict in-order execution deadlocks, waiting cycle d0 -> d1 -> d0: "
        "d0 is blocked at B0.0 (position 1) needing B1.0, held by d1 at position 2 behind its blocked F1.1; "
        "d1 is blocked at F1.1 (position 0) needing F0.1, held by d0 at position 2 behind its blocked B0.0."
    )
    assert [str(t) for t in table.execution_order(in_order=False)][-1] == "B0.1"


@SETTINGS
@given(any_policy_args(), st.data())
def test_a_missing_or_duplicated_task_is_rejected_by_name(case, data):
    policy, (forward, backward, devices, microbatches, options) = case
    table = build_table(policy, forward, backward, devices, microbatches, **options)
    tasks = list(table.tasks())
    victim = data.draw(st.sampled_from(tasks))
    dropped = with_rows(table, [[t for t in row if t != victim] for row in table.devices])
    with pytest.raises(ScheduleError, match=f"missing: {victim}[ ,(]"):
        dropped.validate()
    d = data.draw(st.integers(0, devices - 1))
    at = data.draw(st.integers(0, len(table.devices[d])))
    rows_ = [list(r) for r in table.devices]
    rows_[d].insert(at, victim)
    with pytest.raises(ScheduleError, match=f"task {victim} is listed twice"):
        with_rows(table, rows_).validate()


def test_out_of_range_and_misplaced_tasks_are_rejected():
    def check(text: str, message: str):
        with pytest.raises(ScheduleError, match=message):
            ScheduleTable.from_text(text, P(2), P(2), num_microbatches=1).validate()

    check(
        "d0: F0.0 F2.0 B1.0 B0.0",
        "d0 position 1: task F2.0 names forward stage 2, but the forward partition has 2",
    )
    check("d0: F0.0 F1.0 F1.1 B1.0 B0.0", "names microbatch 1, but the table has 1 microbatches")
    check("d0: F0.0 F1.0 B1.0 I0.0 W0.0", "splits the backward into I and W but also has B tasks")
    check("d0: F0.0 F1.0 I1.0 I0.0 W0.0", "missing: W1.0")
    table = ScheduleTable(((Task("F", 0, 0, 1),),), P(1), P(1), 1)
    with pytest.raises(ScheduleError, match="task F0.0 says device 1 but sits in row d0"):
        table.validate()
    with pytest.raises(ScheduleError, match="cannot parse task 'X0.0'"):
        ScheduleTable.from_text("d0: X0.0", P(1), P(1), 1)
    with pytest.raises(ScheduleError, match="cut the same model"):
        ScheduleTable.from_text("d0: F0.0 B0.0", P(1), P(2), 1).validate()


# ---------------------------------------------------------------- random tables and dry runs


@st.composite
def random_tables(draw) -> ScheduleTable:
    """Every required task once, on random devices, in a random or a dependency-consistent order."""
    devices, microbatches = draw(st.integers(1, 8)), draw(st.integers(1, 16))
    layers = draw(st.integers(1, 6))
    forward, backward = draw(partitions(layers)), draw(partitions(layers))
    split = draw(st.booleans())
    rng = draw(st.randoms(use_true_random=False))
    keys = required_tasks(forward, backward, microbatches, split_backward=split)
    rows_: list[list[Task]] = [[] for _ in range(devices)]
    rng.shuffle(keys)
    if draw(st.booleans()):  # deal a random dependency order to the devices: never deadlocks
        probe = ScheduleTable((tuple(Task(*k, 0) for k in keys),), forward, backward, microbatches)
        keys = [t.key for t in probe.execution_order(in_order=False)]
    for k in keys:
        d = rng.randrange(devices)
        rows_[d].append(Task(*k, d))
    return ScheduleTable(tuple(tuple(r) for r in rows_), forward, backward, microbatches)


@SETTINGS
@given(random_tables())
def test_strict_validation_agrees_with_a_reference_cycle_check(table):
    cyclic = has_cycle(table)
    if cyclic:
        with pytest.raises(ScheduleError, match="strict in-order execution deadlocks, waiting cycle d"):
            table.validate()
    else:
        assert table.validate() is table


@SETTINGS
@given(random_tables())
def test_ready_first_dry_run_finishes_every_complete_table_in_dependency_order(table):
    order = dry_run(table, in_order=False)
    assert sorted(order) == sorted(table.tasks())
    done: set[TaskKey] = set()
    for t in order:
        assert set(table.dependencies(t)) <= done
        row = table.devices[t.device]
        skipped = [u for u in row[: row.index(t)] if u.key not in done]
        assert all(not set(table.dependencies(u)) <= done for u in skipped)  # earlier ready ones go first
        done.add(t.key)


# ---------------------------------------------------------------- round trips


@SETTINGS
@given(st.one_of(any_policy_args().map(lambda c: build_table(c[0], *c[1][:4], **c[1][4])), random_tables()))
def test_text_and_json_round_trips_are_identity(table):
    back = ScheduleTable.from_text(
        table.to_text(), table.forward, table.backward, table.num_microbatches, table.policy
    )
    assert back == table
    assert all(a.device == b.device for a, b in zip(back.tasks(), table.tasks()))
    again = ScheduleTable.from_json(table.to_json())
    assert again == table and again.policy == table.policy and again.options == table.options
    assert ScheduleTable.from_json(again.to_json(indent=2)).to_json() == table.to_json()


def test_json_errors_are_schedule_errors():
    with pytest.raises(ScheduleError, match="does not parse"):
        ScheduleTable.from_json("{")
    with pytest.raises(ScheduleError, match="not a schedule table"):
        ScheduleTable.from_json('{"format": "other"}')
    good = build_table("1f1b", P(2), P(2), 2, 2).to_dict()
    del good["backward"]
    with pytest.raises(ScheduleError, match="lacks the field 'backward'"):
        ScheduleTable.from_dict(good)
    table = ScheduleTable((), P(1), P(1), 1, options={"bad": object()})
    with pytest.raises(ScheduleError, match="JSON values"):
        table.to_json()


def test_tables_without_the_option_stream_their_weights():
    table = ScheduleTable.from_text("d0: F0.0 B0.0", P(1), P(1), 1)
    assert table.weight_bound is False and table.fused_pairs() == [(Task("F", 0, 0), Task("B", 0, 0))]


def test_no_fused_pair_when_the_head_backward_reaches_below_the_head_forward():
    table = ScheduleTable.from_text("d0: F0.0 F1.0 B0.0", Partition((0, 3, 4)), Partition((0, 4)), 1)
    assert table.validate().fused_pairs() == []


# ---------------------------------------------------------------- published behaviour on the unit grid


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16))
def test_1f1b_and_zb_reach_their_published_step_time_and_memory(devices, microbatches):
    one = build_table("1f1b", P(devices), P(devices), devices, microbatches)
    zero = build_table("zb", P(devices), P(devices), devices, microbatches)
    gpipe = build_table("gpipe", P(devices), P(devices), devices, microbatches)
    assert makespan(one) == makespan(gpipe) == 3 * (microbatches + devices - 1)
    assert makespan(zero) <= makespan(one)
    if microbatches >= devices:  # ZB-H1: bubble (D - 1)(F + I - W) = D - 1 units
        assert makespan(zero) == 3 * microbatches + devices - 1
    assert [peak_in_flight(r) for r in one.devices] == [
        min(devices - d, microbatches) for d in range(devices)
    ]
    assert max(peak_in_flight(r, closes="W") for r in zero.devices) <= devices
    assert [peak_in_flight(r) for r in gpipe.devices] == [microbatches] * devices


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([2, 4, 6, 8]), st.integers(1, 8))
def test_chimera_is_no_slower_than_1f1b_and_holds_at_most_d_plus_1_stage_inputs(devices, pairs):
    microbatches = 2 * pairs
    chimera = build_table("chimera", P(devices), P(devices), devices, microbatches)
    assert makespan(chimera) <= makespan(build_table("1f1b", P(devices), P(devices), devices, microbatches))
    assert max(peak_in_flight(r) for r in chimera.devices) <= devices + 1


def test_interleaved_and_hanayo_beat_1f1b_with_as_many_stages_per_device():
    one = makespan(build_table("1f1b", P(4), P(4), 4, 16)) * 2  # stages twice as long
    assert makespan(build_table("interleaved", P(8), P(8), 4, 16)) < one
    assert makespan(build_table("hanayo", P(8), P(8), 4, 16)) < one


# ---------------------------------------------------------------- purity


def test_schedule_package_never_imports_torch():
    root = pathlib.Path(__file__).resolve().parents[1] / "roundpipe" / "schedule"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path
