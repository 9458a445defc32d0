"""Work that varies at run time, for the simulator: per-task jitter and slow devices.

A table's tasks never take exactly their modelled time on real hardware: kernels vary, a GPU runs
hotter or shares its host, one card of a box is an older model. ``SimOptions(jitter=...)`` multiplies
each operation's compute time by its own random factor, log-normal with mean 1 (``exp(sigma * z -
sigma**2 / 2)``, ``z`` standard normal), drawn from ``jitter_seed`` in the order the engine builds the
operations, so a seed always gives the same step; ``SimOptions(slowdown=(1.0, 2.0))`` runs device 1 at
half speed (each of its operations takes twice its time). Uneven microbatches (sequences of
different lengths) are the workload's ``microbatch_sizes``. Pure Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from roundpipe.errors import ConfigError


class TaskNoise:
    """The compute-time factor of each operation as the engine builds it: its device's slowdown times
    its own jitter draw (1.0 for every operation when both are off, and no draw is made)."""

    def __init__(self, jitter: float, seed: int, slowdown: Sequence[float], num_devices: int):
        if len(slowdown) > num_devices:
            raise ConfigError(
                f"slowdown gives factors for {len(slowdown)} devices but the table has {num_devices}; "
                "give at most one factor per device (devices past the list run at 1.0)"
            )
        self.jitter = float(jitter)
        self.slowdown = [float(f) for f in slowdown] + [1.0] * (num_devices - len(slowdown))
        self._rng = random.Random(seed) if self.jitter > 0 else None

    def factor(self, device: int) -> float:
        f = self.slowdown[device]
        if self._rng is not None:
            s = self.jitter
            f *= math.exp(s * self._rng.gauss(0.0, 1.0) - s * s / 2)
        return f


def check_variability(jitter: float, slowdown: Sequence[float]) -> None:
    """Raise ConfigError unless ``jitter`` is a finite sigma >= 0 and every slowdown a finite factor > 0."""
    if not isinstance(jitter, (int, float)) or not (0.0 <= jitter < math.inf):
        raise ConfigError(
            f"jitter is the sigma of each task's log-normal time factor: a finite number >= 0 "
            f"(0.1 for about 10% noise), got {jitter!r}"
        )
    if isinstance(slowdown, (str, bytes)) or not isinstance(slowdown, Sequence):
        raise ConfigError(
            f"slowdown lists one compute-time factor per device, e.g. (1.0, 2.0) for device 1 at half "
            f"speed; got {slowdown!r}"
        )
    bad = [f for f in slowdown if not isinstance(f, (int, float)) or not (0.0 < f < math.inf)]
    if bad:
        raise ConfigError(
            f"slowdown factors must be finite numbers > 0 (2.0: the device takes twice as long), "
            f"got {bad[0]!r} in {tuple(slowdown)!r}"
        )


__all__ = ["TaskNoise", "check_variability"]
