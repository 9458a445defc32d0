"""The RoundPipe policy: stages dealt round-robin to stateless workers.

Forward stages, then backward stages from last to first, are dealt to devices in turn; each deal
runs its stage for every microbatch. The last forward stage and the last backward stage (both end
with the head + loss) go to the same device, interleaved per microbatch as ``F.j B.j``, so the
head runs forward and backward back to back without recompute. ``start_device`` rotates the deal
so that consecutive iterations start on different workers.

Bubble: a device idles only while the stage dealt to it waits for the previous deal's first
microbatch, so with enough microbatches the pipeline stays full for any number of stages; the fill
and drain at the ends of a step remain (see docs/design.md §3, optimizer modes). Memory: a device
holds one stage's weights (plus the prefetched next one) and one microbatch's activations at a
time; saved stage inputs live on the CPU. Weights stream from the CPU per deal, so tables are not
``weight_bound``.

Constraints: none beyond partitions of the same model, >= 1 device and microbatch; forward and
backward partitions may differ (backward stages are usually smaller because of the recompute).
Dealing in dependency order makes every table deadlock-free under strict in-order execution.
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.policies._common import check_counts
from roundpipe.schedule.table import Partition, ScheduleTable, Task

NAME = "roundpipe"


def roundpipe(
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    start_device: int = 0,
) -> ScheduleTable:
    """RoundPipe table: deal F stages, the fused head, then B stages from last to first.

    Raises:
        ScheduleError: bad counts, partitions of different models, or a negative ``start_device``.
    """
    check_counts(NAME, forward, backward, num_devices, num_microbatches)
    if isinstance(start_device, bool) or not isinstance(start_device, int) or start_device < 0:
        raise ScheduleError(f"{NAME}: start_device must be an integer >= 0, got {start_device!r}")
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
    table = ScheduleTable(
        tuple(tuple(r) for r in rows),
        forward,
        backward,
        num_microbatches,
        policy=NAME,
        options={"start_device": start_device, "weight_bound": False},
    )
    return table.validate()
