"""The schedule table: the one IR that the runtime executes and the simulator replays.

A *task* is ``(kind, stage, microbatch, device)``. Forward tasks (``F``) index stages of the
forward partition, backward tasks (``B``, backward with recompute; ``I``/``W`` when the backward is
split into input- and weight-gradient) index stages of the backward partition. The two partitions
cut the same layers but need not agree: backward stages are usually smaller.

Data flows through *boundaries* (layer indices): the forward stage ``[a, b)`` reads the activation
at boundary ``a`` and writes the one at ``b``; it also leaves behind (on the CPU) the activation at
every backward-stage start inside ``(a, b)``, because backward recomputes from there. The backward
stage ``[c, d)`` reads the activation at ``c`` and the gradient at ``d`` and writes the gradient at
``c``. The stage that holds the last layer (head + loss) needs no incoming gradient.

Pure Python: no torch import here (the simulator and tuner run without it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TASK_KINDS = ("F", "B", "I", "W")
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

    @classmethod
    def parse(cls, text: str, device: int = 0) -> Task:
        m = _TASK_RE.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse task {text!r}: expected e.g. 'F3.1' (kind, stage, microbatch)")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), device)


@dataclass(frozen=True)
class Partition:
    """Contiguous stages over ``num_layers`` layers: ``bounds = (0, b1, ..., num_layers)``."""

    bounds: tuple[int, ...]

    def __post_init__(self):
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"partition bounds must rise strictly from 0, got {b}")

    @classmethod
    def from_sizes(cls, sizes: list[int] | tuple[int, ...]) -> Partition:
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + int(s))
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
        raise ValueError(f"layer {layer} is outside a partition of {self.num_layers} layers")


@dataclass(frozen=True)
class ScheduleTable:
    """For every device the ordered list of its tasks, plus the partitions it was built for."""

    devices: tuple[tuple[Task, ...], ...]
    forward: Partition
    backward: Partition
    num_microbatches: int
    policy: str = "custom"
    options: dict = field(default_factory=dict, compare=False)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def tasks(self):
        """Every task of every device, device by device."""
        for row in self.devices:
            yield from row

    def to_text(self) -> str:
        return "\n".join(f"d{d}: " + " ".join(str(t) for t in row) for d, row in enumerate(self.devices))

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def from_text(
        cls,
        text: str,
        forward: Partition,
        backward: Partition,
        num_microbatches: int,
        policy: str = "custom",
    ) -> ScheduleTable:
        rows: dict[int, tuple[Task, ...]] = {}
        for line in text.strip().splitlines():
            if not line.strip():
                continue
            head, _, body = line.partition(":")
            if not head.strip().startswith("d") or not head.strip()[1:].isdigit():
                raise ValueError(f"bad row {line!r}: expected 'd<index>: F0.0 F0.1 ...'")
            d = int(head.strip()[1:])
            rows[d] = tuple(Task.parse(tok, d) for tok in body.split())
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"device rows must be d0..d{len(rows) - 1}, got {sorted(rows)}")
        return cls(tuple(rows[d] for d in range(len(rows))), forward, backward, num_microbatches, policy)
