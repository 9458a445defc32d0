"""ZB-H1: zero-bubble 1F1B with the backward split into input and weight gradients.

Follows ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024). Each backward is split
into ``I`` (gradient w.r.t. the stage input, on the critical path) and ``W`` (gradient w.r.t. the
weights, needed only by the optimizer). Stage ``s`` lives on device ``s``. F and I follow the 1F1B
order (``D - 1 - d`` warm-up forwards on device ``d``, then one F one I, then the remaining I);
device ``d`` runs each ``W`` ``d`` steps late (at most ``d`` weight gradients pending after an
``I``), and the pending ones close the row. Deferring W on the later devices shortens the chain of
I's that the first devices wait for, and the deferred W's fill the drain.

Bubble: ``(D - 1) * (F + I - W)`` time units per device, a third of 1F1B's ``(D - 1) * (F + B)``
when F = I = W (this construction reaches it exactly on the unit grid). Memory: a device holds at
most ``D`` microbatches whose W has not run; that is 1F1B's peak (on its first device), as ZB-H1
requires, though later devices now reach it too. Weights: resident per device (``weight_bound``).

Constraints: forward partition == backward partition, exactly one stage per device.
"""

from __future__ import annotations

from collections import deque

from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import check_one_stage_per_device, finish
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "zb"


def zb(forward: Partition, backward: Partition, num_devices: int, num_microbatches: int) -> ScheduleTable:
    """ZB-H1 table: F, I and W tasks; stage ``s`` on device ``s``; W deferred by ``d`` on device ``d``.

    Raises:
        ScheduleError: partitions differ, or the number of stages is not ``num_devices``.
    """
    check_one_stage_per_device(NAME, forward, backward, num_devices, num_microbatches)
    m = num_microbatches
    rows = []
    for d in range(num_devices):
        warmup = min(num_devices - 1 - d, m)
        row = [TaskKey("F", d, j) for j in range(warmup)]
        pending: deque[int] = deque()
        for j in range(m):
            if warmup + j < m:
                row.append(TaskKey("F", d, warmup + j))
            row.append(TaskKey("I", d, j))
            pending.append(j)
            if len(pending) > d:
                row.append(TaskKey("W", d, pending.popleft()))
        row += [TaskKey("W", d, j) for j in pending]
        rows.append(row)
    return finish(NAME, rows, forward, backward, m, {"weight_bound": True})
