"""The operations of the simulated steps, built before the event engine (``engine.py``) replays them.

Each schedule table's tasks become per-device operations (``schedule/flow.py``: a fused F+B pair is
one), each with its cost (:class:`OpCost`: time, working set, weight gradients, hand-offs; shared
by every microbatch of a stage) and its state in the replay (:class:`OpState`), linked once: the
hand-offs an operation consumes and which operations wait for their downloads, the control
dependencies of ``deps.py``, which operations open and send down a gradient buffer, the weight
groups of a device.

**Compute time**: F runs its forward layers; B re-runs the forward (layers that recompute) and
backpropagates; a fused F+B runs the head once with autograd, no recompute; I is recompute + input
gradient and W the weight gradient (``w_fraction`` of the backward). ``jitter`` and ``slowdown``
scale each operation's time by a random factor and by its device's (``variability.py``). A device
that switches microbatch also builds the layer context (``Workload.context_s``).

Pure Python (no torch).
"""

from __future__ import annotations

from collections import defaultdict

from roundpipe.partition.memory import task_bytes
from roundpipe.schedule.deps import TaskKind
from roundpipe.schedule.flow import StageWork, device_flows, hand_off_first
from roundpipe.schedule.table import ScheduleTable, Task
from roundpipe.sim.options import SimOptions
from roundpipe.sim.variability import TaskNoise
from roundpipe.sim.workload import Workload, work_seconds

# Copy priorities (lower first): activations a compute needs, weights, weight gradients, saved inputs.
P_ACT, P_WEIGHT, P_WGRAD, P_STASH = 0, 1, 2, 3


class OpCost:
    """What an operation costs and moves, apart from its microbatch. Every microbatch of a stage has
    the same work, so one instance per :class:`StageWork` is computed and shared by all of them."""

    __slots__ = ("dur", "bwd", "trainable", "wgrad", "work", "hold", "release", "layers", "keys", "consumes",
                 "in_bytes", "out_groups", "waits_for")  # fmt: skip

    def __init__(self, dur, bwd, trainable, wgrad, work, hold, release, layers):
        self.dur = dur  # seconds on the compute engine
        self.bwd = bwd  # layers it backpropagates (empty for a frozen embedding alone)
        self.trainable = trainable  # layers whose weight gradients it produces
        self.wgrad = wgrad  # bytes of those gradients (fp32 accumulators on the device)
        self.work, self.hold = work, hold  # working set while it runs; bytes an I leaves for its W
        self.release = release  # bytes a W frees: what its I left
        self.layers = layers  # weights it needs on the device
        self.keys: dict[int, tuple] = {}  # step -> ((step, layer), ...): its weights in that step
        self.consumes: tuple[tuple[str, int], ...] = ()  # input hand-offs (name, boundary)
        self.in_bytes = 0  # their bytes
        self.out_groups: tuple = ()  # ((name, boundary)s, priority, copy kind, bytes) per download
        self.waits_for: tuple[tuple[str, int], ...] = ()  # (kind, stage) of other ops' tasks (deps.py)


class OpState:
    """One operation of one simulated step: its fixed links (built once) and its progress."""

    __slots__ = ("dev", "label", "kind", "it", "pos", "mb", "task", "cost", "keys", "in_bytes",
                 "ctx_bytes", "dependents", "group", "ends_group", "last_of_iter", "alloc", "flush", "stash_add",
                 "stash_drop", "deps", "host_wait", "up_wait", "lookahead_ok", "started", "scale", "dur", "run")  # fmt: skip

    def __init__(
        self, dev: int, work: StageWork, tasks: tuple[Task, ...], it: int, pos: int, cost: OpCost, keys
    ):
        self.dev, self.kind, self.task, self.cost, self.keys = dev, work.kind, tasks[0], cost, keys
        self.label = "+".join(map(str, tasks))
        self.it, self.pos, self.mb = it, pos, tasks[0].microbatch  # hand-offs: (name, boundary, mb)
        self.in_bytes = self.ctx_bytes = 0
        self.dependents: list[OpState] = []  # operations whose ``deps`` count this one
        self.group = -1  # index of its weight group on the device
        self.ends_group = False  # the group's last operation: the device's weights change after it
        self.last_of_iter = False  # the device's last operation of step ``it``
        self.alloc = self.flush = True  # opens / sends down a gradient buffer
        self.stash_add = self.stash_drop = True  # counts in the stash while it runs
        self.deps = 0  # operations it still waits for (deps.py)
        self.host_wait = len(cost.consumes)  # inputs not yet downloaded by their producers
        self.up_wait = -1  # inputs: -1 not issued, 1 uploading, 0 on the device
        self.lookahead_ok = pos == 0  # the operation before it on the device has started
        self.started = -1.0
        self.scale = 1.0  # its microbatch's size over the workload's (uneven microbatches)
        self.dur = 0.0  # seconds on the compute lane: its work, plus a context build when it needs one
        self.run: list[OpState] | None = None  # ready order: the ops summing one gradient buffer


def _task_index(table: ScheduleTable) -> dict[str, list[list[OpState | None]]]:
    """An empty ``index[kind][stage][microbatch]`` for ``table``'s tasks (lists, not a dict keyed by
    tuples: built and looked up once per task, this is a large share of setting up a simulation)."""
    m = table.num_microbatches
    parts = {k.value: table.forward if k is TaskKind.F else table.backward for k in TaskKind}
    return {kind: [[None] * m for _ in range(part.num_stages)] for kind, part in parts.items()}


def _waits_for(table: ScheduleTable, tasks: tuple[Task, ...]) -> tuple[tuple[str, int], ...]:
    """``(kind, stage)`` of the tasks an operation running ``tasks`` waits for (deps.py), same
    microbatch, in order; a fused pair's backward waiting for its own forward is left out."""
    own = [(t.kind, t.stage) for t in tasks]
    return tuple(
        (k.kind, k.stage) for t in tasks for k in table.dependencies(t) if (k.kind, k.stage) not in own
    )


class Operations:
    """Every operation of the steps ``tables`` (one per simulated step), linked for the replay.

    What the engine reads: ``ops[d]`` (device ``d``'s operations of every step, in order),
    ``act_bytes[b]`` (the hand-off at boundary ``b``), ``consumers[it]`` and ``host_waiters[it]``
    (per hand-off of step ``it``: how many operations consume it, which wait for its download),
    ``grad_count`` (per ``(step, layer)``: the gradients its optimizer step waits for) and
    ``groups[d]`` (device ``d``'s weight groups).
    """

    def __init__(self, tables: list[ScheduleTable], work: Workload, opts: SimOptions):
        self.w, self.opts, self.tables = work, opts, tables
        self.n_dev = tables[0].num_devices
        # Bytes of the hand-off at each boundary; the model's end (the loss) moves nothing.
        self.act_bytes = [lw.act_in_bytes for lw in self.w.layers] + [0]
        self._make_ops()
        self._link_data()
        self._link_tasks()
        self._share_gradients()
        self._group_weights()

    def _make_ops(self) -> None:
        """Per device, one state per operation of every step, in order; ``by_task[it][kind][stage][mb]``
        is the operation running that task of step ``it`` (None: the table has no such task)."""
        self.ops: list[list[OpState]] = [[] for _ in range(self.n_dev)]
        self.by_task: list[dict[str, list[list[OpState | None]]]] = []
        plans: dict[int, list] = {}  # steps that replay the same table share its plan
        noise = TaskNoise(self.opts.jitter, self.opts.jitter_seed, self.opts.slowdown, self.n_dev)
        costs: dict[int, OpCost] = {}  # per StageWork (alive in ``plans`` meanwhile, so ids are unique)
        for it, table in enumerate(self.tables):
            plan = plans.get(id(table))
            if plan is None:
                plan = plans[id(table)] = device_flows(table, full_forward=self.opts.classic_flow)
            fwd_bounds = set(table.forward.bounds)
            by_task = _task_index(table)
            scales = self.w.scales(table.num_microbatches)
            for d, (ops, row) in enumerate(zip(self.ops, plan)):
                context_of = None  # the microbatch whose context the device holds (none at a step's start)
                for work, tasks in row:
                    cost = costs.get(id(work))
                    if cost is None:
                        cost = costs[id(work)] = self._cost(work, tasks, table, fwd_bounds)
                    keys = cost.keys.get(it)
                    if keys is None:
                        keys = cost.keys[it] = tuple((it, i) for i in cost.layers)
                    st = OpState(d, work, tasks, it, len(ops), cost, keys)
                    st.scale = scales[st.mb]
                    st.dur = cost.dur * st.scale
                    if cost.dur > 0 and st.mb != context_of:  # as the worker's ``_context``
                        st.dur += self.w.context_s * st.scale
                        context_of = st.mb
                    st.dur *= noise.factor(d)
                    for t in tasks:
                        by_task[t.kind][t.stage][t.microbatch] = st
                    ops.append(st)
            self.by_task.append(by_task)

    def _cost(
        self, work: StageWork, tasks: tuple[Task, ...], table: ScheduleTable, fwd_bounds: set[int]
    ) -> OpCost:
        """What ``work`` (an operation running ``tasks``, of any microbatch) costs, moves and waits for
        (``fwd_bounds``: the forward partition's bounds)."""
        layers, act = self.w.layers, self.act_bytes
        dur = self._duration(work)
        bwd = work.bwd_layers
        trainable = [i for i in bwd if layers[i].grad_bytes > 0 or layers[i].trainable_params > 0]
        if work.kind in (TaskKind.B, TaskKind.I) and bwd.start == 0 and not trainable and not work.produces:
            dur, bwd = 0.0, range(0)  # frozen embedding alone: nothing to run
        trainable = trainable if work.weight_grads else []
        wgrad = sum(layers[i].grad_bytes for i in trainable)
        work_bytes, hold = self._work_bytes(work)
        release = task_bytes(layers, (), work.bwd_layers)[1] if work.kind == TaskKind.W else 0
        cost = OpCost(
            dur, bwd, trainable, wgrad, work_bytes, hold, release, list(work.layers) if dur > 0 else []
        )
        cost.consumes = work.consumes
        cost.in_bytes = sum(act[b] for _, b in work.consumes)
        cost.out_groups = self._out_groups(work, fwd_bounds)
        cost.waits_for = _waits_for(table, tasks)
        return cost

    def _out_groups(self, work: StageWork, fwd_bounds: set[int]) -> tuple:
        """``work``'s downloads: hand-offs a compute waits for (gradients and forward-stage outputs)
        go first, saved stage inputs after; ``((name, boundary)s, priority, copy kind, bytes)`` each."""
        urgent = tuple(k for k in work.produces if hand_off_first(k, fwd_bounds))
        later = tuple(k for k in work.produces if not hand_off_first(k, fwd_bounds))
        return tuple(
            (keys, prio, kind, sum(self.act_bytes[b] for _, b in keys))
            for keys, prio, kind in ((urgent, P_ACT, "act"), (later, P_STASH, "stash"))
            if keys
        )

    def _link_data(self) -> None:
        """Per step, how many operations consume each hand-off and which wait for its download; per
        operation, the bytes it uploads: its inputs, plus the token ids when the device switches
        microbatch."""
        layers = self.w.layers
        self.consumers: list[dict[tuple, int]] = [defaultdict(int) for _ in self.tables]
        self.host_waiters: list[dict[tuple, list[OpState]]] = [defaultdict(list) for _ in self.tables]
        ctx = layers[0].act_in_bytes if layers else 0
        for ops in self.ops:
            prev = None
            for st in ops:
                consumes = st.cost.consumes
                if consumes:
                    consumers, waiters = self.consumers[st.it], self.host_waiters[st.it]
                    for name, b in consumes:
                        k = (name, b, st.mb)
                        consumers[k] += 1
                        waiters[k].append(st)
                if st.kind != TaskKind.W and (st.keys or consumes) and (st.it, st.mb) != prev:
                    st.ctx_bytes, prev = ctx, (st.it, st.mb)
                st.in_bytes = round((st.cost.in_bytes + st.ctx_bytes) * st.scale)

    def _link_tasks(self) -> None:
        """Control dependencies (deps.py) between operations, and the stash a device keeps between
        F and B of a stage (weight-bound tables)."""
        weight_bound = [table.weight_bound for table in self.tables]
        for d, ops in enumerate(self.ops):
            for st in ops:
                by_task = self.by_task[st.it]
                for kind, stage in st.cost.waits_for:
                    producer = by_task[kind][stage][st.mb]
                    assert producer is not None, "waits_for names only tasks of the table"
                    producer.dependents.append(st)
                    st.deps += 1
                if weight_bound[st.it] and st.kind == TaskKind.F:
                    self._keep_stash(self.tables[st.it], by_task, st, d)

    def _keep_stash(self, table: ScheduleTable, by_task: dict, st: OpState, d: int) -> None:
        """A weight-bound device holds a stage's input from its forward until its backward ends."""
        t = st.task
        if t.stage >= table.backward.num_stages:
            return
        closing = TaskKind.W if table.split_backward else TaskKind.B
        peer = by_task[closing][t.stage][t.microbatch]
        same = table.forward.bounds[t.stage] == table.backward.bounds[t.stage]
        if peer is not None and peer is not st and peer.dev == d and same:
            st.stash_drop = False
            peer.stash_add = False
            if table.split_backward:
                inp = by_task[TaskKind.I][t.stage][t.microbatch]
                if inp is not None:
                    inp.stash_add = inp.stash_drop = False

    def _share_gradients(self) -> None:
        """Which operations open and send down a gradient buffer, and how many gradients each
        layer's optimizer step waits for."""
        layers = self.w.layers
        self.grad_count: dict[tuple[int, int], int] = defaultdict(int)
        for ops in self.ops:
            if self.opts.accumulate_grads:
                # One gradient buffer per run of backward tasks over the same layers; forward tasks
                # in between (1F1B-style rows) leave it open, as the runtime's worker does.
                backward_ops = [st for st in ops if st.cost.bwd]
                for a, b in zip(backward_ops, backward_ops[1:]):
                    if a.cost.trainable and b.cost.trainable and a.it == b.it and a.cost.bwd == b.cost.bwd:
                        a.flush = b.alloc = False
                        if self.opts.order == "ready":  # which of them opens and sends is decided then
                            if a.run is None:
                                a.run = [a]
                            a.run.append(b)
                            b.run = a.run
            for st in ops:
                if st.flush:
                    for i in st.cost.trainable:
                        if layers[i].trainable_params > 0:
                            self.grad_count[(st.it, i)] += 1

    def _group_weights(self) -> None:
        """Weight groups per device (consecutive operations over the same layers), the last operation
        of each group, and the device's last operation of each step."""
        self.groups: list[list[tuple[tuple[int, int], ...]]] = []
        for ops in self.ops:
            groups: list[tuple[tuple[int, int], ...]] = []
            last: list[int] = []
            for st in ops:
                if st.keys:
                    if not groups or groups[-1] != st.keys:
                        groups.append(st.keys)
                        last.append(st.pos)
                    last[-1] = st.pos
                st.group = len(groups) - 1
            for st in ops:
                st.ends_group = st.group >= 0 and last[st.group] == st.pos
            self.groups.append(groups)
            for a, b in zip(ops, ops[1:]):
                a.last_of_iter = a.it != b.it
            if ops:
                ops[-1].last_of_iter = True

    def _duration(self, op: StageWork) -> float:
        return work_seconds(
            self.w, op.kind, op.fwd_layers, op.bwd_layers, first_forward=op.first_forward, split=op.split
        )

    def _work_bytes(self, op: StageWork) -> tuple[int, int]:
        """(working set while ``op`` computes, bytes an I leaves on the device for its W)."""
        if op.kind == TaskKind.W:
            return 0, 0
        if op.kind == TaskKind.F:
            return task_bytes(self.w.layers, op.fwd_layers, ())[0], 0
        work, saved = task_bytes(self.w.layers, op.fwd_layers, op.bwd_layers)
        return work, (saved if op.kind == TaskKind.I else 0)


__all__ = ["Operations", "OpCost", "OpState", "P_ACT", "P_STASH", "P_WEIGHT", "P_WGRAD"]
