"""Argument checks and table assembly shared by the policies.

Every policy checks its arguments up front and raises ScheduleError saying what to change, then
returns a *validated* table whose options carry ``weight_bound``.
"""

from __future__ import annotations

from collections.abc import Iterable

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.table import Partition, ScheduleTable, Task

UNIT_TIMES = {"F": 1, "B": 2, "I": 1, "W": 1}
"""Task lengths of the published schedules' time grids: backward twice forward, I and W one each."""


def check_counts(
    policy: str, forward: Partition, backward: Partition, num_devices: int, num_microbatches: int
):
    """Types and counts every policy needs: partitions of the same model, >= 1 device and microbatch."""
    for name, part in (("forward", forward), ("backward", backward)):
        if not isinstance(part, Partition):
            raise ScheduleError(f"{policy}: {name} must be a Partition, got {type(part).__name__}")
    for name, value in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{policy}: {name} must be a positive integer, got {value!r}")
    if forward.num_layers != backward.num_layers:
        raise ScheduleError(
            f"{policy}: the forward partition cuts {forward.num_layers} layers but the backward one "
            f"{backward.num_layers}; partition the same model twice"
        )


def require_same_partition(policy: str, forward: Partition, backward: Partition) -> None:
    """Classic pipelines keep a stage's forward and backward on one device: one partition for both."""
    if forward != backward:
        raise ScheduleError(
            f"{policy} runs each stage's forward and backward on the same device, so it needs equal "
            f"forward and backward partitions; got forward {list(forward.bounds)} and backward "
            f"{list(backward.bounds)}. Pass the same partition twice, or use 'roundpipe', which "
            f"accepts different ones"
        )


def require_stages(policy: str, forward: Partition, expected: int, why: str) -> None:
    if forward.num_stages != expected:
        raise ScheduleError(
            f"{policy} needs {expected} stages ({why}), got {forward.num_stages}; partition the model "
            f"into {expected} stages, or use 'roundpipe', which deals any number of stages to any "
            f"number of devices"
        )


def check_one_stage_per_device(
    policy: str, forward: Partition, backward: Partition, num_devices: int, num_microbatches: int
) -> None:
    """The checks of the classic pipelines where stage ``s`` lives on device ``s`` (gpipe, 1f1b, zb)."""
    check_counts(policy, forward, backward, num_devices, num_microbatches)
    require_same_partition(policy, forward, backward)
    require_stages(policy, forward, num_devices, "stage s runs on device s")


def check_positive_option(policy: str, name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ScheduleError(f"{policy}: option {name} must be a positive integer, got {value!r}")


def finish(
    policy: str,
    rows: Iterable[Iterable[TaskKey]],
    forward: Partition,
    backward: Partition,
    num_microbatches: int,
    options: dict,
) -> ScheduleTable:
    """Attach devices to the task keys, build the table and validate it."""
    devices = tuple(tuple(Task(k.kind, k.stage, k.microbatch, d) for k in row) for d, row in enumerate(rows))
    table = ScheduleTable(devices, forward, backward, num_microbatches, policy=policy, options=options)
    return table.validate()
