"""Chimera: two pipelines in opposite directions over the same devices.

Follows Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with
Bidirectional Pipelines", SC 2021). The ``D`` stages run in two pipelines: *down* places stage ``s``
on device ``s``, *up* on device ``D - 1 - s``, so every device holds two stages (``s`` and
``D - 1 - s``) and each pipeline's fill and drain overlap the other's. Microbatch ``j`` goes down
when ``j`` is even and up when odd; its tasks keep their stage index and run on that pipeline's
device, so the head of a down microbatch is on device ``D - 1`` and of an up one on device 0 (last F
and last B of a microbatch always share a device and run fused).

Order: list scheduling on the unit grid (F = 1, B = 2, see ``_list_schedule.py``): an idle device
starts a ready forward (oldest microbatch first) while it holds fewer than ``D + 1`` stage inputs,
else a ready backward (oldest first). Forwards first fills both directions as early as memory allows;
the cap turns the steady state into one-forward-one-backward, as in the paper's concatenated basic
units.

Bubble: ``(D - 2) * max(f, b)`` per step once ``M >= 2D`` (``M`` even, ``b >= f``): the paper's
``D - 2`` bubbles (its ratio ``(D - 2) / (2N + D - 2)`` with equal forward and backward), each the
length of the longer pass. 1F1B leaves ``(D - 1)(f + b)``: on the unit grid, D = 8, M = 64: 204
units against 213. Checked against the simulator in ``tests/test_sim.py``. An exact solver (run
outside the repository on four devices, M = 8) finds no shorter step under a ``D``-input
memory cap; without a cap it reaches ``(D / 2 - 1)(f + b)`` by keeping up to ``M`` microbatches in
flight on the middle devices.
Memory: at most ``D + 1`` stage inputs per device (reached once ``M > D``), one more than 1F1B's
first device; both directions share the budget.

Weights: resident, two stages per device (``weight_bound``); both replicas of a stage share the CPU
master weights, so no extra gradient all-reduce is needed.

Constraints: forward partition == backward partition, an even number of devices, one stage per
device (per pipeline).
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey, dependencies
from roundpipe.schedule.policies._common import check_counts, finish, require_same_partition, require_stages
from roundpipe.schedule.policies._list_schedule import MemoryCaps, list_schedule
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
    placement = {
        TaskKey(kind, s, j): chimera_device(s, j, n_dev)
        for s in range(n_dev)
        for j in range(num_microbatches)
        for kind in ("F", "B")
    }
    rows = list_schedule(
        placement=placement,
        num_devices=n_dev,
        deps=lambda k: dependencies(k, forward, backward),
        priority=lambda k: (k.kind == "B", k.microbatch, k.stage),
        memory=MemoryCaps(  # a device's pool: the stage inputs it holds from a forward to its backward
            acquire=lambda k: placement[k] if k.kind == "F" else None,
            release=lambda k: placement[k] if k.kind == "B" else None,
            cap=lambda d: n_dev + 1,
        ),
    )
    return finish(NAME, rows, forward, backward, num_microbatches, {"weight_bound": True})
