"""What a schedule table asks of the workers: per device, the tasks to issue and their hand-offs.

The rules (which F and B run fused, which hand-offs a task consumes and produces, how far a forward
runs) live in ``roundpipe/schedule/flow.py``, shared with the simulator; this module only puts its
ops into the form the workers read. Keys are ``("act", boundary, microbatch)`` (the input of layer
``boundary``) and ``("grad", boundary, microbatch)`` (the gradient w.r.t. that input).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from roundpipe.schedule import ScheduleTable, Task, TaskKind
from roundpipe.schedule.flow import FlowOp, consumer_counts, device_flows, layers_of

EXECUTED_KINDS = (TaskKind.F, TaskKind.B)  # I and W (a split backward) are simulated, not run yet


@dataclass
class TaskFlow:
    task: Task
    fused_with: Task | None = None  # the B task run back to back with this F (head stage)
    layers_fwd: range = range(0)  # layers run forward without grad
    layers_bwd: range = range(0)  # layers run with grad and backpropagated
    consumes: list[tuple] = field(default_factory=list)
    produces: list[tuple] = field(default_factory=list)  # activations left on the CPU / gradients sent down
    first_forward: bool = False  # layers_bwd run their forward here for the first time (no F ran it)

    @property
    def layers(self) -> range:
        return layers_of(self.layers_fwd, self.layers_bwd)

    @classmethod
    def of(cls, op: FlowOp) -> TaskFlow:
        return cls(
            op.task,
            op.tasks[1] if op.fused else None,
            op.work.fwd_layers,
            op.work.bwd_layers,
            op.consumes,
            op.produces,
            op.work.first_forward or (bool(op.work.bwd_layers) and not op.work.recompute),
        )


@dataclass
class FlowPlan:
    table: ScheduleTable
    flows: list[list[TaskFlow]]  # per device, in execution order (fused pairs are one flow)
    consumers: Counter
    # Per device, the bytes its free memory held beyond 1.2x the plan's peak on it (the estimate's
    # error, ``memory_guard.room``) when the plan was checked (the least over the batch shapes
    # checked; None: unbounded); None: never checked. What a device may hold beyond a stage's own
    # rule at a call boundary (``Worker``).
    room: list[int | None] | None = None

    @property
    def num_layers(self) -> int:
        return self.table.forward.num_layers

    @functools.cached_property
    def forward_bounds(self) -> frozenset[int]:
        return frozenset(self.table.forward.bounds)


def build_flow_plan(table: ScheduleTable, fuse: bool = True, frozen: int = 0) -> FlowPlan:
    """``fuse=False`` (profiling, and a loss that needs every forward before any backward) runs the
    head's F and B as separate tasks even when adjacent, and every forward task over its whole
    stage. ``frozen``: the first layers that train nothing (``schedule.flow.stage_work``).

    Raises:
        NotImplementedError: the table has ``I`` or ``W`` tasks (a split backward).
    """
    for t in table.tasks():
        if t.kind not in EXECUTED_KINDS:
            raise NotImplementedError(f"task kind {t.kind} ({t}) is not executed by this runtime yet")
    ops = device_flows(table, fuse=fuse, full_forward=not fuse, frozen=frozen)
    return FlowPlan(table, [[TaskFlow.of(op) for op in row] for row in ops], consumer_counts(ops))
