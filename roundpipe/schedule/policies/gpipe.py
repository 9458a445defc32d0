"""GPipe: every device runs all its forwards, then all its backwards.

Follows GPipe (Huang et al., NeurIPS 2019) as executed by autograd-based pipelines such as
torchgpipe: stage ``s`` lives on device ``s``; each device runs ``F(s, 0..M-1)`` and then
``B(s, M-1..0)``, backward in reverse microbatch order, so that on the last device the final
forward and the first backward are the same microbatch and run fused (head forward + backward
without recompute).

Bubble: ``(D - 1) / (M + D - 1)`` of the step, as for 1F1B. Memory: each device holds the saved
inputs of all ``M`` microbatches at the turn from forward to backward (1F1B holds at most ``D - d``).
Weights: each device keeps its stage's weights resident (``weight_bound``).

Constraints: forward partition == backward partition, exactly one stage per device.
"""

from __future__ import annotations

from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import check_one_stage_per_device, finish
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "gpipe"


def gpipe(forward: Partition, backward: Partition, num_devices: int, num_microbatches: int) -> ScheduleTable:
    """GPipe table: device ``d`` runs ``F(d, 0..M-1)`` then ``B(d, M-1..0)``.

    Raises:
        ScheduleError: partitions differ, or the number of stages is not ``num_devices``.
    """
    check_one_stage_per_device(NAME, forward, backward, num_devices, num_microbatches)
    m = num_microbatches
    rows = [
        [TaskKey("F", d, j) for j in range(m)] + [TaskKey("B", d, j) for j in reversed(range(m))]
        for d in range(num_devices)
    ]
    return finish(NAME, rows, forward, backward, m, {"weight_bound": True})
