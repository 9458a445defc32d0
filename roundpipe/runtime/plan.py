"""What a schedule table implies for data flow: which hand-offs each task consumes and produces.

Computed once per table from the partitions and the task order (pure bookkeeping, no tensors).
Keys are ``("act", boundary, microbatch)`` (the input of layer ``boundary``) and
``("grad", boundary, microbatch)`` (the gradient w.r.t. that input).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from roundpipe.schedule import ScheduleTable, Task


@dataclass
class TaskFlow:
    task: Task
    fused_with: Task | None = None  # the B task run back to back with this F (head stage)
    layers_fwd: range = range(0)  # layers run forward without grad
    layers_bwd: range = range(0)  # layers run with grad and backpropagated
    consumes: list[tuple] = field(default_factory=list)
    produces: list[tuple] = field(default_factory=list)  # activations left on the CPU / gradients sent down

    @property
    def layers(self) -> range:
        lo = min([r.start for r in (self.layers_fwd, self.layers_bwd) if len(r)], default=0)
        hi = max([r.stop for r in (self.layers_fwd, self.layers_bwd) if len(r)], default=0)
        return range(lo, hi)


@dataclass
class FlowPlan:
    table: ScheduleTable
    flows: list[list[TaskFlow]]  # per device, in execution order (fused pairs are one flow)
    consumers: Counter

    @property
    def num_layers(self) -> int:
        return self.table.forward.num_layers


def build_flow_plan(table: ScheduleTable, fuse: bool = True) -> FlowPlan:
    """``fuse=False`` (profiling) runs the head's F and B as separate tasks even when adjacent, and
    every forward task over its whole stage."""
    fwd, bwd = table.forward, table.backward
    num_layers = fwd.num_layers
    last_f, last_b = fwd.num_stages - 1, bwd.num_stages - 1
    bwd_starts = set(bwd.bounds[1:-1])
    flows: list[list[TaskFlow]] = []
    for row in table.devices:
        out: list[TaskFlow] = []
        i = 0
        while i < len(row):
            t = row[i]
            nxt = row[i + 1] if i + 1 < len(row) else None
            if t.kind == "F":
                a, e = fwd.bounds[t.stage], fwd.bounds[t.stage + 1]
                c = bwd.bounds[last_b]
                fused = (
                    fuse
                    and t.stage == last_f
                    and nxt is not None
                    and nxt.kind == "B"
                    and nxt.stage == last_b
                    and nxt.microbatch == t.microbatch
                    and a <= c
                )
                f = TaskFlow(t, fused_with=nxt if fused else None)
                if a > 0:
                    f.consumes.append(("act", a, t.microbatch))
                if fused:
                    f.layers_fwd = range(a, c)
                    f.layers_bwd = range(c, num_layers)
                    f.produces += [("act", b, t.microbatch) for b in sorted(bwd_starts) if a < b < c]
                    if c > 0:
                        f.produces.append(("grad", c, t.microbatch))
                    i += 2
                else:
                    outs = sorted({b for b in bwd_starts if a < b < e} | ({e} if e < num_layers else set()))
                    # Forward only as far as someone needs (the head's loss is made by its backward),
                    # except when profiling, which times every layer's forward.
                    f.layers_fwd = range(a, e if not fuse else (outs[-1] if outs else a))
                    f.produces += [("act", b, t.microbatch) for b in outs]
                    i += 1
                out.append(f)
            elif t.kind == "B":
                c, d = bwd.bounds[t.stage], bwd.bounds[t.stage + 1]
                f = TaskFlow(t, layers_bwd=range(c, d))
                if c > 0:
                    f.consumes.append(("act", c, t.microbatch))
                    f.produces.append(("grad", c, t.microbatch))
                if t.stage < last_b:
                    f.consumes.append(("grad", d, t.microbatch))
                out.append(f)
                i += 1
            else:
                raise NotImplementedError(f"task kind {t.kind} ({t}) is not executed by this runtime yet")
        flows.append(out)
    consumers = Counter(k for row in flows for f in row for k in f.consumes)
    return FlowPlan(table, flows, consumers)
