"""RoundPipe's rounds: the deal goes round after round without a drain, every table stays valid and
deadlock-free, the host holds the saved inputs of at most two rounds, and the simulator replays it.

Pure Python (no torch). The runtime side (exactness, measured host memory) is
tests/test_rounds_runtime.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe.errors import ScheduleError
from roundpipe.presets import load_hardware
from roundpipe.schedule import POLICIES, Partition, ScheduleTable, Task, TaskKey, build_table, required_tasks
from roundpipe.sim import SimOptions, simulate, uniform_workload

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
P = Partition.per_layer
next_start_device = POLICIES["roundpipe"].next_start_device


@st.composite
def partitions(draw, num_layers: int) -> Partition:
    cuts = draw(st.sets(st.integers(1, num_layers - 1))) if num_layers > 1 else set()
    return Partition((0, *sorted(cuts), num_layers))


@st.composite
def round_tables(draw):
    """A roundpipe table with rounds: partitions, devices 1..8, microbatches 1..24, a valid round
    size (at least the device count unless it covers every microbatch) and a start device."""
    devices = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 24))
    layers = draw(st.integers(1, 12))
    forward, backward = draw(partitions(layers)), draw(partitions(layers))
    size = draw(st.integers(min(devices, microbatches), max(devices, microbatches)))
    start = draw(st.integers(0, 9))
    return build_table(
        "roundpipe", forward, backward, devices, microbatches, start_device=start, round_size=size
    )


def rounds_of(table: ScheduleTable) -> list[range]:
    size = table.options["round_size"] or table.num_microbatches
    m = table.num_microbatches
    return [range(a, min(a + size, m)) for a in range(0, m, size)]


def round_index(table: ScheduleTable, microbatch: int) -> int:
    size = table.options["round_size"] or table.num_microbatches
    return microbatch // size


def deals_per_round(table: ScheduleTable) -> int:
    return table.forward.num_stages + table.backward.num_stages - 1


def timed(table: ScheduleTable, cost) -> tuple[dict[TaskKey, float], dict[TaskKey, float]]:
    """Strict in-order execution with task lengths ``cost(task)``: start and finish of every task."""
    start, finish = {}, {}
    free = [0.0] * table.num_devices
    for t in table.execution_order():
        start[t.key] = max([free[t.device]] + [finish[k] for k in table.dependencies(t)])
        finish[t.key] = free[t.device] = start[t.key] + cost(t)
    return start, finish


def peak_microbatches_in_flight(table: ScheduleTable, cost) -> int:
    """Most microbatches at once between the start of their first task and the end of their last:
    the ones whose saved stage inputs (and gradients) the host may hold."""
    start, finish = timed(table, cost)
    events = []
    for j in range(table.num_microbatches):
        events.append((min(v for k, v in start.items() if k.microbatch == j), 1))
        events.append((max(v for k, v in finish.items() if k.microbatch == j), -1))
    live = peak = 0
    for _, delta in sorted(events):  # at equal times an end (-1) sorts before a start (+1)
        live += delta
        peak = max(peak, live)
    return peak


def layer_cost(forward_s: float, backward_s: float, weights: list[int]):
    def cost(t: Task, table: ScheduleTable) -> float:
        part, per = (table.forward, forward_s) if t.kind == "F" else (table.backward, backward_s)
        return per * sum(weights[i] for i in part.layers(t.stage))

    return cost


# ---------------------------------------------------------------- the deal


def test_without_round_size_the_table_is_the_one_round_deal():
    fwd, bwd = Partition((0, 2, 4)), Partition((0, 1, 2, 3, 4))
    one_round = build_table("roundpipe", fwd, bwd, 3, 2)
    assert one_round.to_text().splitlines() == [
        "d0: F0.0 F0.1 B1.0 B1.1",
        "d1: F1.0 B3.0 F1.1 B3.1 B0.0 B0.1",
        "d2: B2.0 B2.1",
    ]
    assert one_round.options == {"start_device": 0, "round_size": None, "weight_bound": False}
    for size in (2, 3, 100):  # a round that covers every microbatch is the same table
        assert build_table("roundpipe", fwd, bwd, 3, 2, round_size=size).devices == one_round.devices


def test_rounds_deal_round_after_round_continuing_on_the_next_device():
    # 4 deals per round (F0, F1, the fused head F2+B2, then B1, B0 -> 5 deals) on 2 devices
    table = build_table("roundpipe", P(3), P(3), 2, 5, round_size=2)
    assert table.to_text().splitlines() == [
        # round 0 starts on d0, round 1 on d1 (after round 0's 5 deals), round 2 on d0
        "d0: F0.0 F0.1 F2.0 B2.0 F2.1 B2.1 B0.0 B0.1 F1.2 F1.3 B1.2 B1.3 F0.4 F2.4 B2.4 B0.4",
        "d1: F1.0 F1.1 B1.0 B1.1 F0.2 F0.3 F2.2 B2.2 F2.3 B2.3 B0.2 B0.3 F1.4 B1.4",
    ]
    assert table.options["round_size"] == 2
    assert next_start_device(table) == (0 + 3 * 5) % 2  # three rounds of five deals
    assert len(table.fused_pairs()) == 5  # the head of every microbatch runs fused


@SETTINGS
@given(round_tables())
def test_every_round_table_is_complete_valid_and_deadlock_free_in_strict_order(table):
    assert sorted(t.key for t in table.tasks()) == sorted(
        required_tasks(table.forward, table.backward, table.num_microbatches)
    )
    assert len(table.execution_order(in_order=True)) == len(list(table.tasks()))
    table.validate()
    # every microbatch's head runs forward and backward back to back on one device
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    if table.forward.bounds[last_f] <= table.backward.bounds[last_b]:
        assert len(table.fused_pairs()) == table.num_microbatches


@SETTINGS
@given(round_tables())
def test_each_row_runs_its_rounds_in_order_and_each_round_continues_the_deal(table):
    n, k = table.num_devices, deals_per_round(table)
    start = table.options["start_device"]
    for row in table.devices:
        rounds = [round_index(table, t.microbatch) for t in row]
        assert rounds == sorted(rounds), "a device runs round r's tasks before round r + 1's"
    where = {t.key: t.device for t in table.tasks()}
    for r, microbatches in enumerate(rounds_of(table)):
        first, last = microbatches[0], microbatches[-1]
        # round r's first deal (forward stage 0) goes to the device after the previous round's last
        assert where[TaskKey("F", 0, first)] == (start + r * k) % n
        # and its last deal (backward stage 0) to the device k - 1 deals on
        assert where[TaskKey("B", 0, last)] == (start + r * k + k - 1) % n
    last_deal_device = where[TaskKey("B", 0, table.num_microbatches - 1)]
    assert next_start_device(table) == (last_deal_device + 1) % n


@st.composite
def tables_with_a_forward_and_a_backward_deal_per_device_and_round(draw):
    """Round tables with more forward stages than devices and at least as many backward stages."""
    devices = draw(st.integers(1, 6))
    layers = draw(st.integers(devices + 1, 12))
    inner = list(range(1, layers))
    forward = Partition((0, *sorted(draw(st.permutations(inner))[:devices]), layers))
    backward = Partition((0, *sorted(draw(st.permutations(inner))[: devices - 1]), layers))
    microbatches = draw(st.integers(1, 24))
    size = draw(st.integers(min(devices, microbatches), max(devices, microbatches)))
    start = draw(st.integers(0, 9))
    return build_table(
        "roundpipe", forward, backward, devices, microbatches, start_device=start, round_size=size
    )


@SETTINGS
@given(
    tables_with_a_forward_and_a_backward_deal_per_device_and_round(),
    st.lists(st.integers(1, 4), min_size=12, max_size=12),
    st.sampled_from([1, 2, 3]),
)
def test_rounds_bound_the_microbatches_in_flight_to_two_rounds(table, weights, backward_ratio):
    """With more forward stages than devices and at least as many backward stages, every device
    has a forward and a backward deal in every round, so round r + 1 starts only after round r's
    head, by when round r - 1 is done: the host holds the saved inputs of two rounds at most, for
    any stage times."""
    assert table.forward.num_stages > table.num_devices <= table.backward.num_stages
    cost = layer_cost(1, backward_ratio, weights)
    peak = peak_microbatches_in_flight(table, lambda t: cost(t, table))
    assert peak <= 2 * min(table.options["round_size"], table.num_microbatches)


def test_with_fewer_backward_stages_than_devices_a_forward_only_device_runs_ahead():
    """The bound needs every device to wait for each round's head: here device 0 only ever runs
    the head (forward stage 0 fused with backward stage 1) and device 1 backward stage 0, so device
    0 deals every round's head ahead of the slow backward and the rounds bound nothing."""
    table = build_table("roundpipe", Partition((0, 3)), Partition((0, 2, 3)), 2, 20, round_size=2)
    heavy_backward = {"F": 1, "B": 1}
    peak = peak_microbatches_in_flight(
        table, lambda t: 10 if (t.kind, t.stage) == ("B", 0) else heavy_backward[t.kind]
    )
    assert peak > 2 * 2


@pytest.mark.parametrize(("devices", "layers"), [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_rounds_of_twice_the_devices_cost_no_time_on_balanced_stages(devices, layers):
    """No drain between rounds: with a head no heavier than a backward stage (F 1, B 2 per layer,
    the head's forward free), rounds of 2N microbatches take no longer than one round of all."""

    def balanced(t: Task) -> float:
        if t.kind == "F":
            return 0 if t.stage == layers - 1 else 1
        return 2

    def makespan(size):
        table = build_table("roundpipe", P(layers), P(layers), devices, 32, round_size=size)
        return max(timed(table, balanced)[1].values())

    assert makespan(2 * devices) <= makespan(None)


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (1, "round_size=1 is below the 2 devices.*use round_size >= 2"),
        (0, "round_size must be a positive integer or None"),
        (True, "round_size must be a positive integer or None"),
        (2.0, "round_size must be a positive integer or None"),
    ],
)
def test_bad_round_sizes_raise_schedule_error_saying_what_to_use(size, message):
    with pytest.raises(ScheduleError, match=message):
        build_table("roundpipe", P(3), P(3), 2, 6, round_size=size)


def test_a_round_below_the_device_count_is_fine_when_it_covers_every_microbatch():
    table = build_table("roundpipe", P(3), P(3), 4, 2, round_size=3)
    assert table.devices == build_table("roundpipe", P(3), P(3), 4, 2).devices


def test_round_size_survives_the_json_round_trip():
    table = build_table("roundpipe", P(4), P(4), 2, 7, round_size=3, start_device=1)
    back = ScheduleTable.from_json(table.to_json())
    assert back == table and back.options == table.options


# ---------------------------------------------------------------- the simulator


def test_the_simulator_replays_rounds_holding_less_host_memory_for_more_weight_uploads():
    layers, act, param = 8, 10_000_000, 100 << 20
    work = uniform_workload(layers, 1e-2, 2e-2, param_bytes=param, act_in_bytes=act)
    hw = load_hardware("2xrtx4090")
    saved, uploads = {}, {}
    for size in (None, 2, 4):
        table = build_table("roundpipe", P(layers), P(layers), 2, 16, round_size=size)
        r = simulate(table, work, hw, SimOptions(iterations=3))  # three steps: rounds every step
        assert r.fits
        saved[size] = r.peak_host_bytes - work.host_state_bytes
        uploads[size] = r.h2d_bytes
    boundaries = layers - 1  # a microbatch leaves its input to every stage but the first
    assert saved[None] >= 12 * boundaries * act  # most of the step's 16 microbatches at once
    for size in (2, 4):
        assert saved[size] <= 2 * size * boundaries * act  # two rounds at most
    assert saved[2] < saved[4] < saved[None]
    assert uploads[None] < uploads[4] < uploads[2]  # a stage's weights go up once per round


def test_the_simulator_continues_the_deal_of_rounds_across_steps():
    """Step 2 of a simulation runs the table that starts where step 1's deal ended, with the same
    rounds: every task of step 2 is on the device of the rotated table."""
    table = build_table("roundpipe", P(3), P(3), 2, 5, round_size=2)
    hw = load_hardware("2xrtx4090")
    r = simulate(table, uniform_workload(3, 1.0, 2.0), hw, SimOptions(iterations=2, record_timeline=True))
    second = build_table("roundpipe", P(3), P(3), 2, 5, round_size=2, start_device=next_start_device(table))
    assert second.devices != table.devices  # the deal really moved on
    computes = sorted((s for s in r.raw_spans if s[1] == "compute"), key=lambda s: s[4])
    where: dict[str, list[int]] = {}
    for device, _lane, label, *_ in computes:
        where.setdefault(label.split("+")[0], []).append(device)
    for t in second.tasks():
        if str(t) in where:  # fused heads are labelled by their forward task
            assert where[str(t)][1] == t.device, t
