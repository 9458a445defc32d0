"""Hanayo: wave-like stage placement, stages zig-zag down and up the devices.

Follows Hanayo (Liu et al., "Hanayo: Harnessing Wave-like Pipeline Parallelism for Enhanced Large
Model Training Efficiency", SC 2023). With ``W`` waves the model is cut into ``S = 2 * W * D``
stages placed in a zig-zag: stages ``0..D-1`` go down devices ``0..D-1``, stages ``D..2D-1`` come
back up ``D-1..0``, and so on ``W`` times (stage ``s`` -> ``r = s % 2D``; device ``r`` if
``r < D`` else ``2D - 1 - r``). A microbatch thus turns around on device ``D - 1`` without a
hand-off, and the first and last stage (embedding, head) share device 0. Like Chimera's two
directions but with a single model replica.

The order comes from list scheduling on the unit grid (F = 1, B = 2, see ``_list_schedule.py``):
an idle device starts a ready forward (oldest microbatch first) while fewer than ``2 * D``
microbatches are in flight there (between the forward of stage ``d``, the device's first stage,
and its backward), else a ready backward (oldest first). Forwards first fills the wave as early as
memory allows; the cap turns the steady state into one-forward-one-backward.

Bubble: with one wave (``S = 2D``) and ``M >= 2D`` the step is exactly the published
``(2M + D - 1)(f + b)`` (``(2WM + D - 1)(f + b)`` for ``W`` waves) at ``b = 2f``, the grid the table
is built on: interleaved 1F1B's step with ``v = 2`` chunks, without its ``D | M`` constraint. That is optimal for the placement: the
last device cannot start before ``(D - 1) f`` nor finish its work later than ``(D - 1) b`` before the
end. With fewer microbatches the chain of one microbatch binds instead: an exact solver (run outside
the repository on two to four devices) finds the optimum ``max((2WM + D - 1)(f + b),
2WD(f + b) + 2(M - 1) max(f, b))``, which the table reaches for ``M <= 2`` and overshoots by a few
units in between. With two or more waves the table runs above the published step, by no
regular amount (D = 8, W = 2, M = 64: 28 units over 789; W = 3: 52 over 1173).
Memory: at most ``2 * D`` microbatches in flight per device; with one wave each holds two stage
inputs there (stages ``d`` and ``2D - 1 - d``), so a device peaks at ``4D`` stage inputs once
``M >= 2D``, against interleaved's ``3D - 1`` (``v = 2``) and 1F1B's ``D``. The runtime keeps them
in host memory.

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
        priority=lambda k: (k.kind == "B", k.microbatch, k.stage),
        memory=MemoryCaps(  # stage d < D is device d's first stage: it admits and retires a microbatch
            acquire=lambda k: k.stage if k.kind == "F" and k.stage < n_dev else None,
            release=lambda k: k.stage if k.kind == "B" and k.stage < n_dev else None,
            cap=lambda d: 2 * n_dev,
        ),
    )
    options = {"waves": n_stages // (2 * n_dev), "weight_bound": True}
    return finish(NAME, rows, forward, backward, num_microbatches, options)
