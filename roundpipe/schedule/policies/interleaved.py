"""Interleaved 1F1B: each device holds ``v`` non-adjacent stages (Megatron-LM virtual pipeline).

Follows the interleaved schedule of Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC 2021), as implemented in Megatron-LM's
``forward_backward_pipelining_with_interleaving``. The ``S = v * D`` stages go round the devices:
stage ``s`` lives on device ``s % D`` (chunk ``s // D``). Each device walks ``M * v`` virtual
microbatches ``k``: microbatches are taken in groups of ``D``, and each group passes through chunk
0, 1, ..., v-1 in the forward order and v-1, ..., 0 in the backward order. Device ``d`` runs
``(D - 1 - d) * 2 + (v - 1) * D`` warm-up forwards (all of them when ``M == D``), then alternates
one forward and one backward, then drains.

Bubble: idle time / useful time ``= (D - 1) / (v * M)``, the 1F1B bubble divided by ``v``, paid
for with ``v`` times more stage hand-offs. Memory: device ``d`` holds up to its warm-up count + 1 stage
inputs, somewhat more than 1F1B's ``D - d`` microbatches' worth. Weights: resident per device
(``weight_bound``): ``v`` stages each.

Constraints: forward partition == backward partition; the stage count a multiple of the device
count; ``num_microbatches`` a multiple of ``num_devices`` (as Megatron-LM requires).
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.policies._common import (
    check_counts,
    check_positive_option,
    finish,
    require_same_partition,
)
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "interleaved"


def interleaved(
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
) -> ScheduleTable:
    """Megatron interleaved 1F1B table with ``v = num_stages / num_devices`` stages per device.

    Args:
        virtual_stages: ``v``; if given it must equal ``forward.num_stages / num_devices``.

    Raises:
        ScheduleError: partitions differ, the stage count is not ``v * num_devices``, or
            ``num_microbatches`` is not a multiple of ``num_devices``.
    """
    check_counts(NAME, forward, backward, num_devices, num_microbatches)
    require_same_partition(NAME, forward, backward)
    check_positive_option(NAME, "virtual_stages", virtual_stages)
    n_dev, m, n_stages = num_devices, num_microbatches, forward.num_stages
    if n_stages % n_dev or (virtual_stages is not None and n_stages != virtual_stages * n_dev):
        want = (
            f"{virtual_stages} * {n_dev} = {virtual_stages * n_dev}"
            if virtual_stages
            else f"a multiple of {n_dev}"
        )
        raise ScheduleError(
            f"{NAME} places stage s on device s % num_devices, so it needs {want} stages; got {n_stages}. "
            f"Re-partition the model, or use 'roundpipe', which deals any number of stages"
        )
    if m % n_dev:
        lo, hi = m - m % n_dev, m - m % n_dev + n_dev
        fix = f"{hi}" if lo == 0 else f"{lo} or {hi}"
        raise ScheduleError(
            f"{NAME} (Megatron-LM) needs num_microbatches divisible by num_devices; got {m} microbatches "
            f"for {n_dev} devices. Use {fix} microbatches, or the '1f1b' / 'roundpipe' policy"
        )
    v = n_stages // n_dev
    total = m * v

    def key(k: int, d: int, kind: str) -> TaskKey:
        chunk = (k // n_dev) % v
        if kind == "B":
            chunk = v - 1 - chunk
        microbatch = (k // (n_dev * v)) * n_dev + k % n_dev
        return TaskKey(kind, chunk * n_dev + d, microbatch)

    rows = []
    for d in range(n_dev):
        warmup = total if m == n_dev else min((n_dev - 1 - d) * 2 + (v - 1) * n_dev, total)
        row = [key(k, d, "F") for k in range(warmup)]
        for k in range(total - warmup):
            row += [key(k + warmup, d, "F"), key(k, d, "B")]
        row += [key(k, d, "B") for k in range(total - warmup, total)]
        rows.append(row)
    return finish(NAME, rows, forward, backward, m, {"virtual_stages": v, "weight_bound": True})
