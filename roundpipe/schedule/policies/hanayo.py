"""Hanayo: wave-like stage placement, stages zig-zag down and up the devices.

Follows Hanayo (Liu et al., "Hanayo: Harnessing Wave-like Pipeline Parallelism for Enhanced Large
Model Training Efficiency", SC 2023). With ``W`` waves the model is cut into ``S = 2 * W * D``
stages placed in a zig-zag: stages ``0..D-1`` go down devices ``0..D-1``, stages ``D..2D-1`` come
back up ``D-1..0``, and so on ``W`` times (stage ``s`` -> ``r = s % 2D``; device ``r`` if
``r < D`` else ``2D - 1 - r``). A microbatch thus turns around on device ``D - 1`` without a
hand-off, and the first and last stage (embedding, head) share device 0. Like Chimera's two
directions but with a single model replica.

The order is 1F1B-style on the unit-time grid (F = 1, B = 2), replayed by list scheduling (see
``_list_schedule.py``): a device runs a ready backward first (oldest microbatch), else a ready
forward (oldest microbatch). A new microbatch enters device ``d`` (its forward of stage ``d``, the
device's first stage) only while fewer than ``2 * D`` microbatches are in flight there, i.e.
between that forward and the backward of stage ``d``.

Bubble: on the unit grid usually between interleaved 1F1B's (same stage count) and plain 1F1B's, e.g.
D = 8, W = 1, M = 32: 230 units against 213 (interleaved) and 234 (1F1B with D bigger stages), ideal
192; its gain over interleaved is fewer hand-offs (the turn-around on device ``D - 1``, and head and
embedding on device 0), which the grid does not count. Memory: at most ``2 * D`` microbatches in
flight per device, each holding up to ``2W`` stage inputs; measured, the peak stage inputs per
device are somewhat above interleaved's (D = 8, W = 1, M = 32: 28 vs 23) and grow towards the
last device.

Weights: resident, ``2W`` stages per device (``weight_bound``).

Constraints: forward partition == backward partition; ``S == 2 * waves * num_devices``.
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey, dependencies
from roundpipe.schedule.policies._common import (
    check_counts,
    check_positive_option,
    finish,
    require_same_partition,
)
from roundpipe.schedule.policies._list_schedule import MemoryCaps, list_schedule
from roundpipe.schedule.table import Partition, ScheduleTable

NAME = "hanayo"


def wave_device(stage: int, num_devices: int) -> int:
    """The device of ``stage`` in the zig-zag: down ``0..D-1``, up ``D-1..0``, repeated."""
    r = stage % (2 * num_devices)
    return r if r < num_devices else 2 * num_devices - 1 - r


def hanayo(
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    waves: int | None = None,
) -> ScheduleTable:
    """Hanayo table over ``S = 2 * waves * num_devices`` zig-zag stages.

    Args:
        waves: ``W``; if given it must equal ``forward.num_stages / (2 * num_devices)``.

    Raises:
        ScheduleError: partitions differ, or the stage count is not ``2 * waves * num_devices``.
    """
    check_counts(NAME, forward, backward, num_devices, num_microbatches)
    require_same_partition(NAME, forward, backward)
    check_positive_option(NAME, "waves", waves)
    n_dev, n_stages = num_devices, forward.num_stages
    if n_stages % (2 * n_dev) or (waves is not None and n_stages != 2 * waves * n_dev):
        want = (
            f"2 * waves * num_devices = {2 * waves * n_dev}"
            if waves
            else f"a multiple of 2 * num_devices = {2 * n_dev}"
        )
        raise ScheduleError(
            f"{NAME} zig-zags stages down and back up the devices, so it needs {want} stages; got "
            f"{n_stages}. Re-partition the model, or use 'roundpipe', which deals any number of stages"
        )
    keys = [TaskKey(k, s, j) for s in range(n_stages) for j in range(num_microbatches) for k in ("F", "B")]
    rows = list_schedule(
        placement={k: wave_device(k.stage, n_dev) for k in keys},
        num_devices=n_dev,
        deps=lambda k: dependencies(k, forward, backward),
        priority=lambda k: (k.kind != "B", k.microbatch, k.stage),
        memory=MemoryCaps(  # stage d < D is device d's first stage: it admits and retires a microbatch
            acquire=lambda k: k.stage if k.kind == "F" and k.stage < n_dev else None,
            release=lambda k: k.stage if k.kind == "B" and k.stage < n_dev else None,
            cap=lambda d: 2 * n_dev,
        ),
    )
    options = {"waves": n_stages // (2 * n_dev), "weight_bound": True}
    return finish(NAME, rows, forward, backward, num_microbatches, options)
