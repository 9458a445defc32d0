"""Unit-time list scheduling: turn a task placement plus priorities into per-device task orders.

Published schedules are drawn on a time grid: F takes one unit, B two (F, I and W one each when the
backward is split). This module replays that grid: whenever a device is idle it starts the ready
task of best priority among those its memory cap allows, and the start order per device becomes
the table row. The rows are therefore an actual execution trace, so
strict in-order execution of them never deadlocks.

Memory caps bound the activations a device holds: a task that *acquires* a pool (a forward) may
start only while the pool holds fewer than its cap; the task that *releases* it (B, or W when split)
frees one slot when it ends. If caps ever leave every device idle with work remaining, the best
ready task starts anyway, so the schedule always completes.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import UNIT_TIMES


@dataclass(frozen=True)
class MemoryCaps:
    """``acquire(key)``/``release(key)`` name the pool a task fills at start / frees at end (or None)."""

    acquire: Callable[[TaskKey], Hashable | None]
    release: Callable[[TaskKey], Hashable | None]
    cap: Callable[[Hashable], int]


def list_schedule(
    placement: Mapping[TaskKey, int],
    num_devices: int,
    deps: Callable[[TaskKey], list[TaskKey]],
    priority: Callable[[TaskKey], tuple],
    memory: MemoryCaps | None = None,
    durations: Mapping[str, int] = UNIT_TIMES,
) -> list[list[TaskKey]]:
    """Per-device task orders from simulating ``placement`` on a unit-time grid.

    Args:
        placement: every task to run and its device.
        deps: the tasks a task waits for (all of them must be in ``placement``).
        priority: smaller runs first among a device's ready tasks; must be a total order.
        memory: optional activation caps.
        durations: time units per task kind.
    """
    dependents: dict[TaskKey, list[TaskKey]] = defaultdict(list)
    waiting_on: dict[TaskKey, int] = {}
    ready: list[list[TaskKey]] = [[] for _ in range(num_devices)]
    for key in placement:
        ds = deps(key)
        waiting_on[key] = len(ds)
        for k in ds:
            dependents[k].append(key)
        if not ds:
            ready[placement[key]].append(key)
    held: Counter = Counter()
    busy = [False] * num_devices
    rows: list[list[TaskKey]] = [[] for _ in range(num_devices)]
    running: list[tuple[int, tuple, int, TaskKey]] = []  # heap of (end time, priority, device, task)
    now, left = 0, len(placement)

    def fits(key: TaskKey) -> bool:
        if not memory:
            return True
        pool = memory.acquire(key)
        return pool is None or held[pool] < memory.cap(pool)

    def start(d: int, key: TaskKey) -> None:
        ready[d].remove(key)
        rows[d].append(key)
        busy[d] = True
        if memory and (pool := memory.acquire(key)) is not None:
            held[pool] += 1
        heapq.heappush(running, (now + durations[key.kind], priority(key), d, key))

    while left:
        for d in range(num_devices):
            if not busy[d]:
                allowed = [k for k in ready[d] if fits(k)]
                if allowed:
                    start(d, min(allowed, key=priority))
        if not running:  # every device idle: caps are too tight, run the best ready task anyway
            candidates = [(priority(k), d, k) for d in range(num_devices) for k in ready[d]]
            if not candidates:
                raise ScheduleError("internal: the task placement has a dependency cycle")
            _, d, k = min(candidates)
            start(d, k)
        now = running[0][0]
        while running and running[0][0] == now:
            _, _, d, key = heapq.heappop(running)
            busy[d] = False
            left -= 1
            if memory and (pool := memory.release(key)) is not None:
                held[pool] -= 1
            for k in dependents.get(key, ()):
                waiting_on[k] -= 1
                if waiting_on[k] == 0:
                    ready[placement[k]].append(k)
    return rows
