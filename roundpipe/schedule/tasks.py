"""A task and the partitions its stage indexes: the plain data a schedule table is made of.

``Task`` is one entry of a device's row, printed ``F3.1`` (kind, stage, microbatch); ``Partition``
cuts the model's layers into contiguous stages. They sit below ``table.py`` so that the table's
checks (``check.py``) can name them without importing the table that runs the checks.

Pure Python: no torch import here.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from roundpipe.errors import ScheduleError
from roundpipe.schedule.deps import TaskKey

_TASK_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Task:
    """One entry of a device's list. Printed as ``F3.1`` (kind, stage, microbatch)."""

    kind: str
    stage: int
    microbatch: int
    device: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @property
    def key(self) -> TaskKey:
        """The task without its device: what dependencies name."""
        return TaskKey(self.kind, self.stage, self.microbatch)

    @classmethod
    def parse(cls, text: str, device: int = 0) -> Task:
        if not isinstance(text, str):
            raise ScheduleError(f"cannot parse task {text!r}: expected a string such as 'F3.1'")
        m = _TASK_RE.match(text.strip())
        if not m:
            raise ScheduleError(f"cannot parse task {text!r}: expected e.g. 'F3.1' (kind, stage, microbatch)")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), device)


@dataclass(frozen=True)
class Partition:
    """Contiguous stages over ``num_layers`` layers: ``bounds = (0, b1, ..., num_layers)``."""

    bounds: tuple[int, ...]

    def __post_init__(self):
        b = self.bounds
        if isinstance(b, (list, range)):  # the same bounds; a tuple keeps the partition hashable
            b = tuple(b)
            object.__setattr__(self, "bounds", b)
        if not isinstance(b, tuple) or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in b
        ):
            raise ScheduleError(f"partition bounds must be a tuple of layer indices (ints), got {b!r}")
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ScheduleError(
                f"partition bounds must rise strictly from 0, got {b}; e.g. (0, 2, 5) cuts 5 layers "
                f"into stages of 2 and 3"
            )

    @classmethod
    def from_sizes(cls, sizes: list[int] | tuple[int, ...]) -> Partition:
        bounds = [0]
        try:
            for s in sizes:
                bounds.append(bounds[-1] + int(s))
        except (TypeError, ValueError, OverflowError):
            raise ScheduleError(
                f"stage sizes must be layer counts (ints), e.g. [2, 3], got {sizes!r}"
            ) from None
        return cls(tuple(bounds))

    @classmethod
    def per_layer(cls, num_layers: int) -> Partition:
        return cls(tuple(range(num_layers + 1)))

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.bounds[-1]

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def sizes(self) -> list[int]:
        return [y - x for x, y in zip(self.bounds, self.bounds[1:])]

    def stage_of(self, layer: int) -> int:
        for s in range(self.num_stages):
            if layer < self.bounds[s + 1]:
                return s
        raise ScheduleError(f"layer {layer} is outside a partition of {self.num_layers} layers")


__all__ = ["Partition", "Task"]
