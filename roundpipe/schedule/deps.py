"""Which tasks a task waits for: the one dependency rule shared by the runtime, the simulator and
the validator, so that all three agree on what "ready" means.

The rules follow the data flow of ``table.py`` (boundaries are layer indices):

- ``F(s, j)`` reads the activation at the start of forward stage ``s``, written by ``F(s-1, j)``;
  ``F(0, j)`` reads the batch and needs nothing.
- ``B(s, j)`` (and ``I(s, j)`` when the backward is split) reads the activation at the start ``c``
  of backward stage ``s``. That activation is left on the CPU by the forward stage that *covers*
  layer ``c - 1``: it either ends at ``c`` (writes it as its output) or contains ``c`` strictly
  inside (leaves it behind for the recompute). Boundary 0 is the batch itself and needs nothing.
- It also reads the gradient at its end ``d``, written by ``B(s+1, j)`` (``I(s+1, j)`` when split).
  The last backward stage holds the head + loss and needs no incoming gradient; it needs instead
  the last forward stage's ``F`` of the same microbatch (which ran the head).
- ``W(s, j)`` (weight gradient) needs ``I(s, j)`` (input gradient) of the same stage.

Whether the last F and the last B of a microbatch run fused (back to back on one device, without
recompute) is an execution detail: the dependencies above do not change.

Pure Python; the partitions are only read through ``bounds`` and ``num_stages``.
"""

from __future__ import annotations

from bisect import bisect_right
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, Protocol

from roundpipe.errors import ScheduleError

if TYPE_CHECKING:
    from roundpipe.schedule.table import Partition


class TaskKind(str, Enum):
    """What a task runs: ``F`` a forward stage, ``B`` a backward stage (recompute, input and weight
    gradients), or a split backward's two halves, ``I`` (input gradient) then ``W`` (weight gradient).

    A ``str``, so a member is its letter wherever a table's kinds are plain strings: ``TaskKind.F ==
    "F"``, it hashes and formats as ``"F"`` and JSON writes ``"F"``. Code outside ``schedule/`` names
    kinds through this enum, never by their letters.
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the published schedules' letter)
    W = "W"

    __str__ = str.__str__

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


TASK_KINDS = tuple(k.value for k in TaskKind)
"""The kinds as plain strings, in table order: ``("F", "B", "I", "W")``."""
BACKWARD_KINDS = frozenset({TaskKind.B, TaskKind.I, TaskKind.W})
"""Kinds that run (part of) a backward stage, on the backward partition."""


class TaskKey(NamedTuple):
    """A task without its device: what dependencies name, and what a table holds exactly once."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


class TaskLike(Protocol):
    """What :func:`dependencies` reads of a task: a ``Task`` or a ``TaskKey`` (read-only)."""

    @property
    def kind(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def microbatch(self) -> int: ...


def forward_stage_covering(boundary: int, forward: Partition) -> int | None:
    """The forward stage that leaves the activation at ``boundary`` on the CPU (None for boundary 0).

    That is the stage holding layer ``boundary - 1``: it ends at ``boundary`` or contains it.
    """
    if not 0 <= boundary <= forward.num_layers:
        raise ScheduleError(f"boundary {boundary} is outside a partition of {forward.num_layers} layers")
    if boundary == 0:
        return None
    return bisect_right(forward.bounds, boundary - 1) - 1


def boundaries_left_by(stage: int, forward: Partition, backward: Partition) -> list[int]:
    """Boundaries whose activation forward stage ``stage`` leaves on the CPU, in increasing order.

    Its output boundary (unless it is the end of the model) and every backward-stage start strictly
    inside it, which backward recomputes from. The inverse of :func:`forward_stage_covering`.
    """
    a, b = forward.bounds[stage], forward.bounds[stage + 1]
    inside = {c for c in backward.bounds[1:-1] if a < c < b}
    if b < forward.num_layers:
        inside.add(b)
    return sorted(inside)


def dependencies(
    task: TaskLike,
    forward: Partition,
    backward: Partition,
    *,
    split_backward: bool = False,
) -> list[TaskKey]:
    """The tasks ``task`` must wait for (same microbatch), in the order: activation, then gradient.

    Args:
        task: anything with ``kind``, ``stage`` and ``microbatch`` (a ``Task`` or a ``TaskKey``).
        forward, backward: the table's partitions; they must cut the same number of layers.
        split_backward: the backward is split into I and W, so gradients come from ``I`` tasks.

    Raises:
        ScheduleError: unknown kind, or a stage outside its partition.
    """
    kind, s, j = task.kind, task.stage, task.microbatch
    if kind not in TASK_KINDS:
        raise ScheduleError(
            f"task {kind}{s}.{j} has unknown kind {kind!r}; kinds are {', '.join(TASK_KINDS)}"
        )
    part, name = (forward, "forward") if kind == "F" else (backward, "backward")
    if not 0 <= s < part.num_stages:
        raise ScheduleError(
            f"task {kind}{s}.{j} names {name} stage {s}, but the {name} partition has "
            f"{part.num_stages} stages (0..{part.num_stages - 1})"
        )
    if kind == "F":
        return [TaskKey("F", s - 1, j)] if s > 0 else []
    if kind == "W":
        return [TaskKey("I", s, j)]
    deps: list[TaskKey] = []
    producer = forward_stage_covering(backward.bounds[s], forward)
    if producer is not None:
        deps.append(TaskKey("F", producer, j))
    if s == backward.num_stages - 1:
        head = TaskKey("F", forward.num_stages - 1, j)
        if head not in deps:
            deps.append(head)
    else:
        deps.append(TaskKey("I" if split_backward else "B", s + 1, j))
    return deps


def required_tasks(
    forward: Partition,
    backward: Partition,
    num_microbatches: int,
    *,
    split_backward: bool = False,
) -> list[TaskKey]:
    """Every task a complete table runs exactly once: F per forward stage and microbatch, then B (or
    I and W) per backward stage and microbatch."""
    out = [TaskKey("F", s, j) for s in range(forward.num_stages) for j in range(num_microbatches)]
    kinds = ("I", "W") if split_backward else ("B",)
    out += [
        TaskKey(k, s, j) for s in range(backward.num_stages) for j in range(num_microbatches) for k in kinds
    ]
    return out
