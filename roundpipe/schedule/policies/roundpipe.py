"""The RoundPipe policy: stages dealt round-robin to stateless workers.

Forward stages, then backward stages from last to first, are dealt to devices in turn; each deal
runs its stage for every microbatch. The last forward stage and the last backward stage (both end
with the head + loss) go to the same device, interleaved per microbatch as ``F.j B.j``, so the
head runs forward and backward back to back without recompute. ``start_device`` rotates the deal
so that consecutive iterations start on different workers.
"""

from __future__ import annotations

from roundpipe.schedule.table import Partition, ScheduleTable, Task


def roundpipe(
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    start_device: int = 0,
) -> ScheduleTable:
    rows: list[list[Task]] = [[] for _ in range(num_devices)]
    deal = start_device
    last_f, last_b = forward.num_stages - 1, backward.num_stages - 1
    for s in range(last_f):
        d = deal % num_devices
        rows[d].extend(Task("F", s, j, d) for j in range(num_microbatches))
        deal += 1
    d = deal % num_devices
    for j in range(num_microbatches):
        rows[d].append(Task("F", last_f, j, d))
        rows[d].append(Task("B", last_b, j, d))
    deal += 1
    for s in range(last_b - 1, -1, -1):
        d = deal % num_devices
        rows[d].extend(Task("B", s, j, d) for j in range(num_microbatches))
        deal += 1
    return ScheduleTable(
        tuple(tuple(r) for r in rows),
        forward,
        backward,
        num_microbatches,
        policy="roundpipe",
        options={"start_device": start_device},
    )
