"""Before a plan first runs: does every device have the memory the plan needs free?

The figure is the planner's own: the partitioner's memory rule (``partition/partitioner.py``:
a stage's weights, the largest other stage prefetched and another's gradients still downloading,
the fp32 gradient accumulators and saved activations of a backward stage, one layer's working set;
the device running the last forward and backward stages together holds their union) over the
layer bytes the planner estimates for the plan's largest microbatch (``Planner._layer_costs``: the
cost model's own estimate, ``partition.cost.model_costs``, with the store's weights and gradient
accumulators), which is what an automatic partition is cut to fit. A device's planned peak is the largest of the stages it runs; under a policy that rotates its
deal from step to step (roundpipe) every device runs every stage sooner or later, so each is
planned for the largest. Free memory is the backend's (``Device.free_bytes``: on CUDA what the
driver has free plus the allocator's unused cache; on ``cpu:N`` the capacity less what is alive).

A device that cannot hold its planned peak refuses the plan with ``DeviceMemoryError`` naming the
device, both figures, the stage and the levers that lower the peak, before any of its work starts.
The estimate is conservative for some models and not for others (within about 20% on the test
models, either way): ``ROUNDPIPE_DEVICE_MEMORY_CHECK=0`` starts anyway, and a device that really
runs out then fails the step with ``DeviceOutOfMemory``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from roundpipe.errors import DeviceMemoryError
from roundpipe.partition.cost import LayerCost
from roundpipe.partition.memory import last_stage_bytes, stage_bytes
from roundpipe.schedule import ScheduleTable, TaskKind
from roundpipe.schedule.deps import BACKWARD_KINDS

GIB = 1 << 30
SWITCH = "ROUNDPIPE_DEVICE_MEMORY_CHECK"  # "0": skip the check (start anyway)
ESTIMATE_ERROR = 0.2  # the planned peak is within about this much of what a device holds, either way


def enabled() -> bool:
    """False when ``ROUNDPIPE_DEVICE_MEMORY_CHECK`` is ``0`` (or ``false``, ``no``, ``off``)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class StagePeak:
    """The planned peak bytes of one stage (or of the last forward and backward stages run
    together), and which it is in words."""

    nbytes: int
    what: str
    layers: range


def device_peaks(costs: Sequence[LayerCost], table: ScheduleTable, rotates: bool) -> list[StagePeak | None]:
    """Per device of ``table``, its fullest stage by the partitioner's rule (None: it runs nothing).
    ``rotates``: the deal moves on every step, so every device is planned for every stage."""
    fwd, bwd = table.forward, table.backward
    names = [c.name for c in costs]

    def peak(what: str, layers: range, nbytes: int) -> StagePeak:
        first, last = names[layers.start], names[layers.stop - 1]
        return StagePeak(nbytes, f"{what} ({first if first == last else f'{first}..{last}'})", layers)

    stages = {
        (TaskKind.F, s): peak(f"forward stage {s}", fwd.layers(s), b)
        for s, b in enumerate(stage_bytes(costs, fwd, "forward"))
    } | {
        (TaskKind.B, s): peak(f"backward stage {s}", bwd.layers(s), b)
        for s, b in enumerate(stage_bytes(costs, bwd, "backward"))
    }
    last = ((TaskKind.F, fwd.num_stages - 1), (TaskKind.B, bwd.num_stages - 1))
    together = peak(
        "last forward and backward stages, run together",
        range(min(fwd.bounds[-2], bwd.bounds[-2]), len(costs)),
        last_stage_bytes(costs, fwd, bwd),
    )
    rows = []
    for row in table.devices:
        runs = sorted({(TaskKind.B if t.kind in BACKWARD_KINDS else TaskKind.F, t.stage) for t in row})
        rows.append([stages[k] for k in runs] + ([together] if all(k in runs for k in last) else []))
    if rotates:  # every device runs every stage sooner or later
        every = [p for runs in rows for p in runs]
        rows = [every if runs else [] for runs in rows]
    return [max(runs, key=lambda p: p.nbytes) if runs else None for runs in rows]


def room(peaks: Sequence[StagePeak | None], free: Sequence[int | None]) -> list[int | None]:
    """Per device, its free bytes beyond its planned peak counted with the estimate's error
    (``ESTIMATE_ERROR``), at least 0 (None: unbounded): what a call boundary may hold beyond a
    stage's own rule (``FlowPlan.room``)."""
    return [
        None if f is None else max(0, f - (int((1 + ESTIMATE_ERROR) * p.nbytes) if p is not None else 0))
        for p, f in zip(peaks, free)
    ]


def least_room(a: list[int | None] | None, b: list[int | None] | None) -> list[int | None] | None:
    """Per device, the smaller of two rooms (None: unknown, or for a device, unbounded)."""
    if a is None or b is None:
        return b if a is None else a
    return [y if x is None else x if y is None else min(x, y) for x, y in zip(a, b)]


def check(
    peaks: Sequence[StagePeak | None],
    free: Sequence[int | None],
    device_names: Sequence[str],
    *,
    plan: str,
    levers,
) -> None:
    """Raise ``DeviceMemoryError`` for the first device whose planned peak exceeds its free bytes
    (a device with ``free`` None is unbounded). ``plan`` describes the plan in words; ``levers``
    is called with the fullest stage and returns the levers' text."""
    for name, peak, room in zip(device_names, peaks, free):
        if peak is None or room is None or peak.nbytes <= room:
            continue
        raise DeviceMemoryError(
            f"{name} has {_size(room)} free but the plan needs {_size(peak.nbytes)} on it, at its "
            f"{peak.what} by the planner's estimate ({plan}). Levers: {levers(peak)}. "
            f"Set {SWITCH}=0 to start anyway (a device that runs out then fails the step with "
            "DeviceOutOfMemory).",
            device=name,
            planned=peak.nbytes,
            free=room,
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB ({nbytes:,} bytes)"


__all__ = ["ESTIMATE_ERROR", "SWITCH", "StagePeak", "check", "device_peaks", "enabled", "least_room", "room"]
