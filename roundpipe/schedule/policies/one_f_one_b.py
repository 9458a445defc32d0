"""1F1B: one forward, one backward, after a short warm-up (PipeDream-Flush).

Follows the non-interleaved 1F1B schedule of PipeDream-Flush (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021) and Megatron-LM: stage ``s`` lives on device ``s``;
device ``d`` runs ``min(D - 1 - d, M)`` warm-up forwards, then alternates one forward and one
backward (oldest microbatch first), then drains the remaining backwards. The last device therefore
runs ``F B F B ...`` and every head forward is fused with its backward.

Bubble: ``(D - 1) / (M + D - 1)`` of the step, like GPipe. Memory: device ``d`` holds the saved
inputs of at most ``D - d`` microbatches (GPipe: ``M``). Weights: resident per device
(``weight_bound``).

Constraints: forward partition == backward partition, exactly one stage per device.
"""

from __future__ import annotations

from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import check_one_stage_per_device, finish
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "1f1b"


def one_f_one_b(
    forward: Partition, backward: Partition, num_devices: int, num_microbatches: int
) -> ScheduleTable:
    """1F1B table: warm-up ``D - 1 - d`` forwards on device ``d``, then alternate F and B, then drain.

    Raises:
        ScheduleError: partitions differ, or the number of stages is not ``num_devices``.
    """
    check_one_stage_per_device(NAME, forward, backward, num_devices, num_microbatches)
    m = num_microbatches
    rows = []
    for d in range(num_devices):
        warmup = min(num_devices - 1 - d, m)
        row = [TaskKey("F", d, j) for j in range(warmup)]
        for j in range(m - warmup):
            row += [TaskKey("F", d, warmup + j), TaskKey("B", d, j)]
        row += [TaskKey("B", d, j) for j in range(m - warmup, m)]
        rows.append(row)
    return finish(NAME, rows, forward, backward, m, {"weight_bound": True})
