"""Chimera: two pipelines in opposite directions over the same devices.

Follows Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with
Bidirectional Pipelines", SC 2021). The ``D`` stages run in two pipelines: *down* places stage ``s``
on device ``s``, *up* on device ``D - 1 - s``, so every device holds two stages (``s`` and
``D - 1 - s``) and each pipeline's fill and drain overlap the other's. Microbatch ``j`` goes down
when ``j`` is even and up when odd; its tasks keep their stage index and run on that pipeline's
device, so the head of a down microbatch is on device ``D - 1`` and of an up one on device 0 (last F
and last B of a microbatch always share a device and run fused).

Order: a pair of microbatches (one per direction) is placed once on the unit-time grid (F = 1,
B = 2) and repeated every ``6`` units (each device does one F and one B of each direction per pair),
see ``_modulo.py``; for ``M > D`` this plays the part of the paper's concatenation of basic units.

Bubble: none in the steady state; fill and drain are shared by the two directions, so on the unit
grid the step is no longer than 1F1B's for an even ``M`` (D = 4, M = 4: 19 vs 21 units; D = 8,
M = 8: 42 vs 45; D = 8, M = 32: 114 vs 117; D = 2 has no bubble at all). An odd ``M`` leaves the
last pair half empty and may cost a unit or two more than 1F1B. Memory: a direction keeps about
``(D - s) / 2`` microbatches in flight on the device holding its stage ``s``, so every device holds
between ``D / 2 + 1`` and ``D`` microbatches' stage inputs (measured: 6 at most for D = 8), where
1F1B's first device holds ``D``: the paper's balanced-memory property.

Weights: resident, two stages per device (``weight_bound``); both replicas of a stage share the CPU
master weights, so no extra gradient all-reduce is needed.

Constraints: forward partition == backward partition, an even number of devices, one stage per
device (per pipeline).
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey, dependencies
from roundpipe.schedule.policies._common import check_counts, finish, require_same_partition, require_stages
from roundpipe.schedule.policies._modulo import modulo_schedule
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "chimera"


def chimera_device(stage: int, microbatch: int, num_devices: int) -> int:
    """Down (even microbatch): stage ``s`` on device ``s``; up (odd): on device ``D - 1 - s``."""
    return stage if microbatch % 2 == 0 else num_devices - 1 - stage


def chimera(
    forward: Partition, backward: Partition, num_devices: int, num_microbatches: int
) -> ScheduleTable:
    """Chimera table: even microbatches down (stage s on device s), odd ones up (device D-1-s).

    Raises:
        ScheduleError: partitions differ, odd device count, or stages != devices.
    """
    check_counts(NAME, forward, backward, num_devices, num_microbatches)
    require_same_partition(NAME, forward, backward)
    n_dev = num_devices
    if n_dev % 2:
        fix = " or ".join(str(n) for n in sorted({max(2, n_dev - 1), n_dev + 1}))
        raise ScheduleError(
            f"{NAME} pairs every device with its mirror, so it needs an even number of devices; got "
            f"{n_dev}. Use {fix} devices, or the '1f1b' / 'roundpipe' policy"
        )
    require_stages(NAME, forward, n_dev, "stage s runs on device s down and on device D-1-s up")
    pair = [TaskKey(k, s, j) for s in range(n_dev) for j in (0, 1) for k in ("F", "B")]
    rows = modulo_schedule(
        pair,
        group=2,
        num_microbatches=num_microbatches,
        num_devices=n_dev,
        device=lambda k: chimera_device(k.stage, k.microbatch, n_dev),
        deps=lambda k: dependencies(k, forward, backward),
    )
    return finish(NAME, rows, forward, backward, num_microbatches, {"weight_bound": True})
