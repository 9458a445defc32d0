"""Checking a schedule table and dry-running it without time.

``validate_table`` is what ``ScheduleTable.validate`` runs: shape, task ranges, completeness (every
required task exactly once) and a strict in-order dry run that reports the waiting cycle of a
deadlock. ``dry_run`` is the zero-time execution itself, in either runtime mode:

- ``in_order=True`` (strict): each device runs its list in order; a task starts once all its
  dependencies are done. This is the contract every policy's table must satisfy.
- ``in_order=False`` (readiness-first): a device runs the first *ready* task of its list; the table
  is a hint. This completes on every complete table, because dependencies never form a cycle.

Pure Python: no torch, no timing.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TYPE_CHECKING

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TASK_KINDS, TaskKey, dependencies
from roundpipe.schedule.tasks import Partition, Task

if TYPE_CHECKING:
    from roundpipe.schedule.table import ScheduleTable

_SHOW = 8  # how many offending tasks an error message lists


def _where(device: int, position: int) -> str:
    return f"d{device} position {position}"


def _listing(keys: list) -> str:
    shown = ", ".join(str(k) for k in keys[:_SHOW])
    return shown + (f", ... ({len(keys) - _SHOW} more)" if len(keys) > _SHOW else "")


def check_shape(table: ScheduleTable) -> None:
    """Counts and partitions make sense on their own."""
    for name in ("forward", "backward"):
        part = getattr(table, name)
        if not isinstance(part, Partition):
            raise ScheduleError(
                f"the {name} partition must be a Partition (e.g. Partition.from_sizes([2, 3])), got {part!r}"
            )
    rows = table.devices
    if not isinstance(rows, (tuple, list)) or not all(isinstance(row, (tuple, list)) for row in rows):
        raise ScheduleError(
            f"a schedule table's devices must be one list of tasks per device, got {type(rows).__name__} "
            f"{str(rows)[:80]}"
        )
    if table.num_devices < 1:
        raise ScheduleError("a schedule table needs at least one device row")
    if not isinstance(table.num_microbatches, int) or table.num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be a positive integer, got {table.num_microbatches!r}")
    if table.forward.num_layers != table.backward.num_layers:
        raise ScheduleError(
            f"the forward partition cuts {table.forward.num_layers} layers but the backward one cuts "
            f"{table.backward.num_layers}; both must cut the same model"
        )


def check_tasks(table: ScheduleTable) -> dict[TaskKey, tuple[int, int]]:
    """Every task is well formed, in range, in its own device's row and listed once.

    Returns where each task sits: ``TaskKey -> (device, position)``.
    """
    fwd, bwd, m = table.forward, table.backward, table.num_microbatches
    seen: dict[TaskKey, tuple[int, int]] = {}
    for d, row in enumerate(table.devices):
        for i, t in enumerate(row):
            if not isinstance(t, Task):
                raise ScheduleError(
                    f"{_where(d, i)}: {t!r} is not a Task; write Task('F', stage, microbatch, device) or "
                    f"Task.parse('F0.1', device)"
                )
            bad = [f for f in ("stage", "microbatch", "device") if not isinstance(getattr(t, f), int)]
            if bad:
                raise ScheduleError(
                    f"{_where(d, i)}: task {t!r}: {' and '.join(bad)} must be int; e.g. Task('F', 0, 1, {d})"
                )
            if t.kind not in TASK_KINDS:
                raise ScheduleError(
                    f"{_where(d, i)}: task {t} has unknown kind {t.kind!r}; kinds are F, B, I, W"
                )
            part, name = (fwd, "forward") if t.kind == "F" else (bwd, "backward")
            if not 0 <= t.stage < part.num_stages:
                raise ScheduleError(
                    f"{_where(d, i)}: task {t} names {name} stage {t.stage}, but the {name} partition "
                    f"has {part.num_stages} stages (0..{part.num_stages - 1})"
                )
            if not 0 <= t.microbatch < m:
                raise ScheduleError(
                    f"{_where(d, i)}: task {t} names microbatch {t.microbatch}, but the table has "
                    f"{m} microbatches (0..{m - 1})"
                )
            if t.device != d:
                raise ScheduleError(f"{_where(d, i)}: task {t} says device {t.device} but sits in row d{d}")
            key = t.key
            if key in seen:
                raise ScheduleError(
                    f"task {key} is listed twice: {_where(*seen[key])} and {_where(d, i)}; "
                    f"every task runs exactly once"
                )
            seen[key] = (d, i)
    return seen


def check_complete(table: ScheduleTable, located: dict[TaskKey, tuple[int, int]]) -> None:
    """Every required task is present (the backward split into I/W everywhere or nowhere)."""
    split = table.split_backward
    if split:
        unsplit = [k for k in located if k.kind == "B"]
        if unsplit:
            raise ScheduleError(
                f"the table splits the backward into I and W but also has B tasks ({_listing(unsplit)}); "
                f"split every backward task or none"
            )
    # Every located task is in range and of the right kinds (check_tasks and the split check above),
    # so the missing ones are the difference in counts, found without listing every required task:
    # a table that claims 10**9 microbatches is refused at once instead of built up in memory.
    m, kinds = table.num_microbatches, (2 if split else 1)
    count = (table.forward.num_stages + kinds * table.backward.num_stages) * m
    if len(located) < count:
        missing = []
        for k in _required(table.forward, table.backward, m, split):
            if k not in located:
                missing.append(k)
                if len(missing) == _SHOW:
                    break
        rule = (
            "every forward stage needs F and every backward stage needs "
            + ("I and W" if split else "B")
            + " for each microbatch"
        )
        shown = ", ".join(str(k) for k in missing)
        more = count - len(located) - len(missing)
        shown += f", ... ({more} more)" if more else ""
        raise ScheduleError(f"{count - len(located)} required task(s) missing: {shown} ({rule})")


def _required(forward, backward, num_microbatches: int, split: bool):
    """``required_tasks``, in its order, one at a time."""
    for s in range(forward.num_stages):
        for j in range(num_microbatches):
            yield TaskKey("F", s, j)
    kinds = ("I", "W") if split else ("B",)
    for s in range(backward.num_stages):
        for j in range(num_microbatches):
            for k in kinds:
                yield TaskKey(k, s, j)


def validate_table(table: ScheduleTable, *, in_order: bool = True) -> None:
    """Raise ScheduleError with the first reason ``table`` cannot run: in strict in-order mode
    (default), or with ``in_order=False`` when tasks run ready-first (only a cycle in the dependency
    graph itself can then stop it)."""
    check_shape(table)
    located = check_tasks(table)
    check_complete(table, located)
    _dry_run(table, located, in_order=in_order)


def _deps_of(table: ScheduleTable) -> dict[TaskKey, list[TaskKey]]:
    split = table.split_backward
    return {
        t.key: dependencies(t, table.forward, table.backward, split_backward=split) for t in table.tasks()
    }


def dry_run(table: ScheduleTable, *, in_order: bool = True) -> list[Task]:
    """Execute ``table`` in zero time and return its tasks in one possible completion order.

    The table need not be complete: a task whose dependency no device runs is an error, a task
    nothing depends on is simply run.

    Raises:
        ScheduleError: a malformed or duplicated task (see ``check_tasks``), a task that depends on a
            task not in the table, or (strict mode) a deadlock; the message names the waiting cycle:
            which device is blocked at which task, which task it needs, and which device holds that
            task behind its own blocked one.
    """
    check_shape(table)
    return _dry_run(table, check_tasks(table), in_order=in_order)


def runs_forwards_first(table: ScheduleTable, *, in_order: bool = True) -> bool:
    """Whether ``table`` still runs when no backward may start before every forward of the step
    has run: what a loss over the whole batch's forward needs before any gradient can flow (a MoE
    router's load-balancing loss counts every layer's expert choices over every microbatch).

    In order: each device runs its row in order, and a task that is not an F waits for every F as
    well as its dependencies; False when that stops short. Ready-first: always True for a table
    that runs ready-first at all, since forwards depend only on forwards (every F can run before
    any B), and the rest then runs in dependency order.
    """
    check_shape(table)
    located = check_tasks(table)
    deps = _deps_of(table)
    try:
        _checked_run(table, located, deps, in_order=False)  # the table's own dependencies hold
    except ScheduleError:
        return False
    if not in_order:
        return True
    rows = table.devices
    forwards = sum(t.kind == "F" for t in table.tasks())
    done: set[TaskKey] = set()
    forwards_done = 0
    head = [0] * len(rows)
    moved = True
    while moved:
        moved = False
        for d, row in enumerate(rows):
            while head[d] < len(row):
                t = row[head[d]]
                if (t.kind != "F" and forwards_done < forwards) or any(k not in done for k in deps[t.key]):
                    break
                done.add(t.key)
                forwards_done += t.kind == "F"
                head[d] += 1
                moved = True
    return all(h == len(row) for h, row in zip(head, rows))


def _dry_run(table: ScheduleTable, located: dict[TaskKey, tuple[int, int]], *, in_order: bool) -> list[Task]:
    return _checked_run(table, located, _deps_of(table), in_order=in_order)


def _checked_run(table, located, deps, *, in_order: bool) -> list[Task]:
    for key, ds in deps.items():
        absent = [k for k in ds if k not in located]
        if absent:
            d, i = located[key]
            raise ScheduleError(f"{_where(d, i)}: task {key} needs {_listing(absent)}, which no device runs")
    return _run_in_order(table, deps, located) if in_order else _run_ready_first(table, deps)


def _run_in_order(
    table: ScheduleTable, deps: dict[TaskKey, list[TaskKey]], located: dict[TaskKey, tuple[int, int]]
) -> list[Task]:
    rows = table.devices
    done: set[TaskKey] = set()
    head = [0] * len(rows)
    waiting: dict[TaskKey, list[int]] = defaultdict(list)  # task -> devices blocked on it
    order: list[Task] = []
    runnable = list(range(len(rows)))
    while runnable:
        d = runnable.pop()
        while head[d] < len(rows[d]):
            t = rows[d][head[d]]
            need = next((k for k in deps[t.key] if k not in done), None)
            if need is not None:
                waiting[need].append(d)
                break
            done.add(t.key)
            order.append(t)
            head[d] += 1
            runnable.extend(waiting.pop(t.key, ()))
    if len(order) < sum(len(r) for r in rows):
        raise ScheduleError(_deadlock_message(rows, deps, done, head, located))
    return order


def _deadlock_message(rows, deps, done, head, located) -> str:
    """Follow "blocked device -> device holding what it needs" from the first blocked device until a
    device repeats; the repeated part is the waiting cycle."""
    blocked = {}
    for d, row in enumerate(rows):
        if head[d] < len(row):
            t = row[head[d]]
            need = next(k for k in deps[t.key] if k not in done)
            blocked[d] = (t, need, located[need])
    d = min(blocked)
    path: list[int] = []
    while d not in path:
        path.append(d)
        d = blocked[d][2][0]
    cycle = path[path.index(d) :]
    steps = []
    for d in cycle:
        t, need, (holder, pos) = blocked[d]
        who = "itself later" if holder == d else f"d{holder}"
        steps.append(
            f"d{d} is blocked at {t} (position {head[d]}) needing {need}, held by {who} at position {pos}"
            + ("" if holder == d else f" behind its blocked {rows[holder][head[holder]]}")
        )
    ring = " -> ".join(f"d{d}" for d in [*cycle, cycle[0]])
    return (
        f"strict in-order execution deadlocks, waiting cycle {ring}: "
        + "; ".join(steps)
        + ". Reorder the rows so every task comes after the tasks it needs on its own device."
    )


def _run_ready_first(table: ScheduleTable, deps: dict[TaskKey, list[TaskKey]]) -> list[Task]:
    """Round-robin over devices; each turn a device runs its ready task earliest in its list."""
    rows = table.devices
    missing = {key: len(ds) for key, ds in deps.items()}
    dependents: dict[TaskKey, list[TaskKey]] = defaultdict(list)
    for key, ds in deps.items():
        for k in ds:
            dependents[k].append(key)
    position = {t.key: (d, i) for d, row in enumerate(rows) for i, t in enumerate(row)}
    ready: list[list[int]] = [[] for _ in rows]  # per device, a heap of positions of ready tasks
    for d, row in enumerate(rows):
        for i, t in enumerate(row):
            if missing[t.key] == 0:
                heapq.heappush(ready[d], i)
    order: list[Task] = []
    total = sum(len(r) for r in rows)
    while any(ready):
        for d in range(len(rows)):
            if not ready[d]:
                continue
            i = heapq.heappop(ready[d])
            t = rows[d][i]
            order.append(t)
            for k in dependents.get(t.key, ()):
                missing[k] -= 1
                if missing[k] == 0:
                    kd, ki = position[k]
                    heapq.heappush(ready[kd], ki)
    if len(order) < total:
        stuck = [t.key for t in table.tasks() if missing[t.key] > 0]
        raise ScheduleError(f"readiness-first execution cannot finish: {_listing(stuck)} never become ready")
    return order
