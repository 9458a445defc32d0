"""Modulo scheduling: repeat one placed *unit* of microbatches with a fixed period.

A unit is the set of tasks of ``group`` consecutive microbatches (the template names them with
microbatches ``0..group-1``). Its tasks are placed once on the unit-time grid (F = 1, B = 2), in
order of their earliest possible start, each at the first time that its dependencies allow and
whose slots *modulo the period* ``R`` are still free on its device. Unit ``u`` then runs every task
at ``u * R + offset``. ``R`` starts at the busiest device's work per unit (no steady-state bubble)
and grows only when the slots cannot be packed.

Because every dependency ends before its dependant starts and the slots of different units never
overlap, the offsets form a feasible timetable; sorting each device's tasks by their time gives
rows that strict in-order execution runs without deadlock, with period ``R`` in the steady state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache

from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import UNIT_TIMES


def modulo_schedule(
    template: list[TaskKey],
    group: int,
    num_microbatches: int,
    num_devices: int,
    device: Callable[[TaskKey], int],
    deps: Callable[[TaskKey], list[TaskKey]],
    durations: Mapping[str, int] = UNIT_TIMES,
) -> list[list[TaskKey]]:
    """Per-device task orders of the template repeated over ``ceil(M / group)`` units.

    Args:
        template: every task of one unit; microbatch ``m`` in it stands for ``u * group + m``.
        device: the device of a template task (must not depend on the unit).
        deps: dependencies of a task; they must stay inside its microbatch.
    """

    @cache
    def earliest(key: TaskKey) -> int:
        return max((earliest(k) + durations[k.kind] for k in deps(key)), default=0)

    order = sorted(template, key=lambda k: (earliest(k), k.microbatch, k.kind != "B", k.stage))
    load = [0] * num_devices
    for key in template:
        load[device(key)] += durations[key.kind]
    period = max(load)
    while (offsets := _place(order, period, num_devices, device, deps, durations)) is None:
        period += 1
    timed = []
    for u in range(-(-num_microbatches // group)):
        for key in template:
            j = u * group + key.microbatch
            if j < num_microbatches:
                timed.append((u * period + offsets[key], TaskKey(key.kind, key.stage, j)))
    rows: list[list[TaskKey]] = [[] for _ in range(num_devices)]
    for _, key in sorted(timed):
        rows[device(key)].append(key)
    return rows


def _place(order, period, num_devices, device, deps, durations) -> dict[TaskKey, int] | None:
    """Offsets of the template tasks with period ``period``, or None if some task finds no slots."""
    busy: list[set[int]] = [set() for _ in range(num_devices)]
    offsets: dict[TaskKey, int] = {}
    for key in order:
        start, d, length = (
            max((offsets[k] + durations[k.kind] for k in deps(key)), default=0),
            device(key),
            durations[key.kind],
        )
        for _ in range(period):
            if all((start + i) % period not in busy[d] for i in range(length)):
                break
            start += 1
        else:
            return None
        offsets[key] = start
        busy[d].update((start + i) % period for i in range(length))
    return offsets
