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

Which task waits for which is defined once, in ``deps.py``; ``validate()`` (``check.py``) checks a
table against it. A table is *valid* when every required task appears exactly once and strict
in-order execution (each device runs its list in order, a task starts once its dependencies are
done) finishes. ``options["weight_bound"]`` tells the runtime whether devices keep their stages'
weights resident (classic pipelines) or stream them per task (RoundPipe).

Pure Python: no torch import here (the simulator and tuner run without it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from roundpipe.errors import ScheduleError
from roundpipe.schedule.check import dry_run, validate_table
from roundpipe.schedule.deps import TASK_KINDS, TaskKey, dependencies
from roundpipe.schedule.flow import fused_pairs
from roundpipe.schedule.tasks import Partition, Task

JSON_FORMAT = "roundpipe.schedule-table/1"


@dataclass(frozen=True)
class ScheduleTable:
    """For every device the ordered list of its tasks, plus the partitions it was built for.

    ``devices[d]`` is device ``d``'s task list, each task carrying ``device == d``. ``options`` holds
    the policy's options (JSON values only) and ``weight_bound``; it takes no part in equality.
    Build one with a policy (``roundpipe.schedule.build_table``) or parse one (``from_text``,
    ``from_json``); call ``validate()`` before running a hand-written one.
    """

    devices: tuple[tuple[Task, ...], ...]
    forward: Partition
    backward: Partition
    num_microbatches: int
    policy: str = "custom"
    options: dict = field(default_factory=dict, compare=False)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward is split into I (input gradient) and W (weight gradient) tasks."""
        return any(t.kind in ("I", "W") for t in self.tasks())

    @property
    def weight_bound(self) -> bool:
        """True when each device keeps its stages' weights resident (every classic pipeline policy);
        False when weights are streamed per task from the CPU (RoundPipe, and tables without the
        option)."""
        return bool(self.options.get("weight_bound", False))

    def tasks(self):
        """Every task of every device, device by device."""
        for row in self.devices:
            yield from row

    def locate(self) -> dict[TaskKey, tuple[int, int]]:
        """Where each task sits: ``TaskKey -> (device, position in that device's list)``."""
        return {t.key: (d, i) for d, row in enumerate(self.devices) for i, t in enumerate(row)}

    def dependencies(self, task: Task | TaskKey) -> list[TaskKey]:
        """The tasks ``task`` waits for in this table (see ``deps.py`` for the rules)."""
        return dependencies(task, self.forward, self.backward, split_backward=self.split_backward)

    def fused_pairs(self) -> list[tuple[Task, Task]]:
        """The (last F, last B or I) pairs the runtime may run as one forward+backward, no recompute.

        The rule lives in ``flow.py``: ``F(last, j)`` immediately followed, on the same device, by
        the last backward stage's ``B(last, j)`` (or ``I(last, j)``), when the last forward stage
        starts at or before the last backward stage. Fusing is an execution detail: it changes no
        dependency.
        """
        return fused_pairs(self)

    def validate(self) -> ScheduleTable:
        """Check that the table can run; return it unchanged.

        Raises:
            ScheduleError: the first problem, precisely: a malformed or out-of-range task, a task in the
                wrong row, a task listed twice, a required task missing, or a deadlock of strict
                in-order execution (with the waiting cycle: who waits at which task for what, held by
                whom).
        """
        if not self.__dict__.get("_validated"):  # a table is immutable: once checked, always valid
            validate_table(self)
            self.__dict__["_validated"] = True
        return self

    def execution_order(self, *, in_order: bool = True) -> list[Task]:
        """A zero-time dry run: the tasks in one order they can complete (see ``check.dry_run``)."""
        return dry_run(self, in_order=in_order)

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
        """Parse rows like ``d0: F0.0 F0.1 B0.0``. Does not validate."""
        if not isinstance(text, str):
            raise ScheduleError(f"a schedule table's text is a string of rows 'd0: F0.0 ...', got {text!r}")
        rows: dict[int, tuple[Task, ...]] = {}
        for line in text.strip().splitlines():
            if not line.strip():
                continue
            head, _, body = line.partition(":")
            # isdecimal, not isdigit: int() refuses digits such as "³" that isdigit accepts
            if not head.strip().startswith("d") or not head.strip()[1:].isdecimal():
                raise ScheduleError(f"bad row {line!r}: expected 'd<index>: F0.0 F0.1 ...'")
            d = int(head.strip()[1:])
            if d in rows:
                raise ScheduleError(f"row d{d} appears twice")
            rows[d] = tuple(Task.parse(tok, d) for tok in body.split())
        if sorted(rows) != list(range(len(rows))):
            raise ScheduleError(f"device rows must be d0..d{len(rows) - 1}, got {sorted(rows)}")
        return cls(tuple(rows[d] for d in range(len(rows))), forward, backward, num_microbatches, policy)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: format tag, policy, options, counts, partition bounds, task rows."""
        return {
            "format": JSON_FORMAT,
            "policy": self.policy,
            "options": dict(self.options),
            "num_microbatches": self.num_microbatches,
            "forward": list(self.forward.bounds),
            "backward": list(self.backward.bounds),
            "devices": [[str(t) for t in row] for row in self.devices],
        }

    def to_json(self, indent: int | None = None) -> str:
        """The table as JSON; ``from_json`` reads it back to an equal table with equal options."""
        try:
            return json.dumps(self.to_dict(), indent=indent)
        except (TypeError, ValueError) as e:
            raise ScheduleError(
                f"table options must be JSON values (str, number, bool, list, dict): {e}"
            ) from e

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScheduleTable:
        if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ScheduleError(f"not a schedule table: expected format {JSON_FORMAT!r}, got {got!r}")
        try:
            forward = Partition(tuple(int(b) for b in data["forward"]))
            backward = Partition(tuple(int(b) for b in data["backward"]))
            rows = tuple(tuple(Task.parse(tok, d) for tok in row) for d, row in enumerate(data["devices"]))
            num_microbatches = int(data["num_microbatches"])
            policy = str(data.get("policy", "custom"))
            options = dict(data.get("options", {}))
        except KeyError as e:
            raise ScheduleError(f"schedule table JSON lacks the field {e.args[0]!r}") from e
        except ScheduleError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
            raise ScheduleError(f"malformed schedule table JSON: {e}") from e
        return cls(rows, forward, backward, num_microbatches, policy, options)

    @classmethod
    def from_json(cls, text: str) -> ScheduleTable:
        """Parse ``to_json`` output. Does not validate."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise ScheduleError(f"schedule table JSON does not parse: {e}") from e
        except RecursionError:
            raise ScheduleError("schedule table JSON does not parse: it is nested too deeply") from None
        return cls.from_dict(data)


__all__ = ["JSON_FORMAT", "TASK_KINDS", "Partition", "ScheduleTable", "Task", "TaskKey"]
