"""Measured per-layer costs: a profiling pass and a moving average kept up to date in training.

``profile`` runs the model one layer per stage, every forward before every backward and the head
not fused, so each compute span is exactly one layer for one microbatch: forward spans give forward
times; a backward span recomputes the layer's forward, so the backward alone is the span minus the
forward. Microbatch ``j`` runs on worker ``j % D``, so every worker is busy at once, as in training:
where workers share a machine (virtual cpu devices sharing cores, copy threads and the interpreter)
the times include that contention. Times are per microbatch of the profiled batch, in seconds, in
the form ``roundpipe.partition.cost.layer_times(times=...)`` takes. The same spans give the time a
worker spends building a microbatch's layer context (``context_seconds_from_spans``), which the
simulator charges as ``Workload.context_s``, and the gap a device stands idle between one
operation and the next while its worker gets the next one going (``task_gap_seconds_from_spans``),
``Workload.task_s``.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from roundpipe.schedule import Partition, ScheduleTable, Task, TaskKind

_TASK = re.compile(r"^([FB])(\d+)\.(\d+)")


def profiling_table(num_layers: int, num_devices: int, num_microbatches: int) -> ScheduleTable:
    """Worker ``d`` runs its microbatches (``j % D == d``) through F of every layer, then B from the
    last layer down; all workers at once."""
    rows: list[tuple[Task, ...]] = []
    for d in range(num_devices):
        mine = [j for j in range(num_microbatches) if j % num_devices == d]
        tasks = [Task(TaskKind.F, s, j, d) for s in range(num_layers) for j in mine]
        tasks += [Task(TaskKind.B, s, j, d) for s in reversed(range(num_layers)) for j in mine]
        rows.append(tuple(tasks))
    part = Partition.per_layer(num_layers)
    return ScheduleTable(tuple(rows), part, part, num_microbatches, policy="profile")


def layer_times_from_spans(spans, names: list[str]) -> dict[str, tuple[float, float]]:
    """Median forward and backward-alone seconds per layer from a profiling run's compute spans."""
    fwd: dict[int, list[float]] = defaultdict(list)
    bwd: dict[int, list[float]] = defaultdict(list)
    for _dev, lane, name, kind, start, end in spans:
        m = _TASK.match(name)
        if lane != "compute" or not m or kind not in (TaskKind.F, TaskKind.B):
            continue
        (fwd if kind == TaskKind.F else bwd)[int(m.group(2))].append(end - start)
    out = {}
    for i, name in enumerate(names):
        f = statistics.median(fwd[i]) if fwd[i] else 0.0
        b = statistics.median(bwd[i]) if bwd[i] else 0.0
        out[name] = (f, max(0.0, b - f))
    return out


def context_seconds_from_spans(spans) -> float:
    """Median seconds a worker spent building one microbatch's layer context (its ``ctx.*`` spans:
    masks, rotary tables, shifted labels), 0.0 when the spans hold none."""
    built = [
        end - start
        for _dev, lane, _name, kind, start, end in spans
        if lane == "compute" and kind == "context"
    ]
    return statistics.median(built) if built else 0.0


def task_gap_seconds_from_spans(steps) -> float:
    """Median seconds between the end of one operation on a device's compute lane and the start of
    the next (context builds left out: they are ``context_seconds_from_spans``'s), over ``steps``
    (each step's spans: a step's times start at its own zero), 0.0 when no device ran two. The
    profiling table's inputs and weights are small and issued ahead, so what the gap holds is the
    worker's own time: events, hooks and closures in Python."""
    gaps = []
    for spans in steps:
        by_device: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for dev, lane, _name, kind, start, end in spans:
            if lane == "compute" and kind != "context":
                by_device[dev].append((start, end))
        for ran in by_device.values():
            ran.sort()
            gaps += [max(0.0, nxt[0] - prev[1]) for prev, nxt in zip(ran, ran[1:])]
    return statistics.median(gaps) if gaps else 0.0


def update_moving_average(
    times: dict[str, tuple[float, float]],
    spans,
    forward: Partition,
    backward: Partition,
    names: list[str],
    microbatch_scale: float = 1.0,
    alpha: float = 0.1,
) -> None:
    """Fold a training step's compute spans into ``times`` (in place).

    A stage span covers several layers: its time is shared among them in proportion to their current
    estimates. ``microbatch_scale`` converts this run's microbatch size to the profiled one.
    """
    for _dev, lane, name, kind, start, end in spans:
        m = _TASK.match(name)
        if lane != "compute" or not m or kind not in (TaskKind.F, TaskKind.B):
            continue
        stage = int(m.group(2))
        layers = forward.layers(stage) if kind == TaskKind.F else backward.layers(stage)
        per_layer = [times[names[i]] for i in layers]
        est = [f if kind == TaskKind.F else f + b for f, b in per_layer]  # B spans recompute the forward
        total = sum(est)
        if total <= 0:
            continue
        measured = (end - start) * microbatch_scale
        for i, e, (f, b) in zip(layers, est, per_layer):
            share = measured * e / total
            if kind == TaskKind.F:
                times[names[i]] = ((1 - alpha) * f + alpha * share, b)
            else:
                new_b = max(0.0, share - f)
                times[names[i]] = (f, (1 - alpha) * b + alpha * new_b)
