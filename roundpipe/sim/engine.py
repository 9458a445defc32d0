"""Discrete-event simulation of training steps: a schedule table replayed on modelled hardware.

What is modelled, and why it matches the runtime (docs/design.md §3-§4):

- **Per device, three engines**: ``compute`` runs the device's operations strictly in table order
  (fused F+B pairs as one operation, see ``schedule/flow.py``); ``h2d`` and ``d2h`` copy engines
  move one copy at a time, choosing by priority: activations the next compute needs (0) > weights
  of the current/next stage (1) > weight gradients down (2) > saved stage inputs down (3). Weight
  copies are cut into ``chunk_bytes`` pieces so an urgent copy can pass between pieces.
- **Shared host link**: GPUs behind one PCIe switch share its uplink, per direction. Copies in
  flight on a switch share it equally (fluid model), each also capped by its own link rate.
- **Data flow**: an operation's inputs (``act``/``grad`` hand-offs, and the microbatch's token ids
  when the device switches microbatch) come from host memory after their producer's download; an
  input upload starts once the operation before it on the device has started (one operation of
  lookahead, as the worker issues ahead). Outputs and activation gradients go down after the
  compute. Weight gradients are summed on the device in fp32 while the next task on the device
  backpropagates the same layers (a RoundPipe deal; a fused head run) and go down once when it does
  not (``accumulate_grads=False``: after every task). A task also waits for every task ``deps.py`` names.
- **Weights**: a device's operations form groups of the same layers. Streaming (``roundpipe``, and
  any table whose weights do not fit): the device holds at most the current and the next group; the
  upload of group ``k + 1`` waits until the compute that used group ``k - 1`` is done, which frees it.
  Weight-bound tables (``table.weight_bound``) keep every uploaded layer for the whole step when the
  device's layers fit its memory; otherwise they stream too (noted in the result).
- **Order**: strictly the table's by default; ``order="ready"`` lets a device run the first
  operation in table order whose inputs are ready, as ``RunConfig(order="ready")`` does (``ready.py``).
- **Compute time**: F runs its forward layers; B re-runs the forward (layers that recompute) and
  backpropagates; a fused F+B runs the head once with autograd, no recompute; I is recompute +
  input gradient and W the weight gradient (``w_fraction`` of the backward). ``jitter`` and
  ``slowdown`` scale each operation's time by a random factor and by its device's (``variability.py``).
- **Optimizer**: a layer's CPU AdamW step starts when the last weight gradient of the step for that
  layer has arrived on the host (steps run one at a time, in that order, at the server's step
  rate). ``sync``: the next step's weights for a layer are uploaded only after its update, so each
  step has its fill and drain; one step is simulated and ends with the last update. ``async``:
  step ``i`` uploads weights updated by step ``i - 2`` (one step stale), so consecutive steps
  overlap; three steps are simulated back to back and the step time is their average period after
  the first.
- **Memory**: per device, bytes of weights, activations on the device, working sets (a stage's
  saved autograd tensors and one layer's transient) and fp32 gradient accumulators, plus the
  workspace reserve; on the host, the model state plus every hand-off and saved input held.
  The simulation never blocks on memory: it reports the peaks and whether they fit.

Pure Python (no torch); one step of 8 devices x 64 microbatches x 100 stages takes well under a
second.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from operator import attrgetter

from roundpipe.errors import ConfigError
from roundpipe.partition.memory import task_bytes
from roundpipe.presets import Server
from roundpipe.schedule.deps import TaskKind
from roundpipe.schedule.flow import FUSED, StageWork, device_flows
from roundpipe.schedule.table import ScheduleTable, Task
from roundpipe.schedule.timeline import HOST_DEVICE, Span, Timeline
from roundpipe.sim.ready import ReadyOrder
from roundpipe.sim.variability import TaskNoise, check_variability
from roundpipe.sim.workload import Workload

ADAMW_BYTES_PER_PARAM = 30  # fused fp32 AdamW: read grad, master, m, v; write master, m, v, bf16 copy
DEFAULT_CHUNK_BYTES = 64 << 20  # weight copies are cut so urgent copies can pass (a runtime setting)
P_ACT, P_WEIGHT, P_WGRAD, P_STASH = 0, 1, 2, 3
_INF = math.inf


@dataclass(frozen=True)
class SimOptions:
    """How to simulate. The defaults model the hardware fully; the switches turn costs off.

    ``transfers=False`` makes every copy free and ``optimizer_time=False`` every optimizer step:
    with both off and uniform layers the result equals ``schedule.formulas`` exactly.
    ``iterations`` defaults to 1 (sync) or 3 (async).
    """

    optimizer: str = "sync"
    transfers: bool = True
    optimizer_time: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    iterations: int | None = None
    record_timeline: bool = True
    classic_flow: bool = False  # textbook forward tasks (closed forms' setting), see flow.stage_work
    # Sum weight gradients on the device while the next task on the device backpropagates the same
    # layers and download them once (what the runtime does); False: download after every task.
    accumulate_grads: bool = True
    stream_weights: bool | None = None  # None: stream unless the table is weight-bound and fits
    # "strict": each device runs its operations in table order; "ready": the first in table order
    # whose inputs are ready (RunConfig.order; see ready.py).
    order: str = "strict"
    # Work that varies (variability.py): each operation's time times a log-normal factor of mean 1
    # and this sigma, drawn from ``jitter_seed``; ``slowdown[d]``: device d's time factor (2.0: half
    # speed; devices past the tuple run at 1.0).
    jitter: float = 0.0
    jitter_seed: int = 0
    slowdown: tuple[float, ...] = ()

    def __post_init__(self):
        if self.optimizer not in ("sync", "async"):
            raise ConfigError(f"optimizer must be 'sync' or 'async', got {self.optimizer!r}")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.iterations is not None and self.iterations < 1:
            raise ConfigError(f"iterations must be >= 1, got {self.iterations}")
        if self.order not in ("strict", "ready"):
            raise ConfigError(f"order must be 'strict' or 'ready', got {self.order!r}")
        check_variability(self.jitter, self.slowdown)
        object.__setattr__(self, "slowdown", tuple(self.slowdown))  # a list from a caller: hashable


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs and holds. Times in seconds, memory in bytes.

    ``bubble_total`` is idle/total compute time over all devices, ``bubble_ideal`` idle/ideal
    (``iteration_s * D / busy - 1``). ``peak_gpu_bytes[d]`` includes the workspace reserve;
    ``peak_activations[d]`` counts stage inputs held between a forward and its backward on ``d``
    (the closed forms' unit). ``fits`` is False when a device or the host exceeds its memory, and
    ``reason`` then says where, by how much and at which task. ``reordered``: with
    ``order="ready"``, how many operations ran ahead of one that precedes them in the table.
    """

    policy: str
    num_devices: int
    num_microbatches: int
    iteration_s: float
    tokens_per_s: float
    mfu: float
    bubble_total: float
    bubble_ideal: float
    peak_gpu_bytes: tuple[int, ...]
    peak_host_bytes: int
    peak_activations: tuple[int, ...]
    compute_busy_s: tuple[float, ...]
    h2d_bytes: int
    d2h_bytes: int
    optimizer_busy_s: float
    weights_streamed: tuple[bool, ...]
    fits: bool
    reason: str = ""
    optimizer: str = "sync"
    notes: tuple[str, ...] = ()
    reordered: int = 0
    raw_spans: list | None = field(default=None, compare=False, repr=False)  # Span fields, built lazily
    timeline_meta: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def timeline(self) -> Timeline | None:
        """The simulated step(s) as a :class:`Timeline` (None when not recorded); built on each access."""
        if self.raw_spans is None:
            return None
        return Timeline([Span(*t) for t in self.raw_spans], dict(self.timeline_meta))

    @property
    def peak_gpu(self) -> int:
        return max(self.peak_gpu_bytes)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "num_devices": self.num_devices,
            "num_microbatches": self.num_microbatches,
            "iteration_s": self.iteration_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_total,
            "bubble_idle_over_ideal": self.bubble_ideal,
            "peak_gpu_bytes": self.peak_gpu,
            "peak_gpu_bytes_per_device": list(self.peak_gpu_bytes),
            "peak_host_bytes": self.peak_host_bytes,
            "peak_activations": list(self.peak_activations),
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "optimizer_busy_s": self.optimizer_busy_s,
            "optimizer": self.optimizer,
            "weights_streamed": list(self.weights_streamed),
            "fits": self.fits,
            "reason": self.reason,
            "notes": list(self.notes),
            "reordered": self.reordered,
        }


# A device's memory classes (indexes of ``_Sim.mem[d]``): weights, activations, working sets, gradients.
_WEIGHTS, _ACTS, _WORK, _GRADS = 0, 1, 2, 3
# Event kinds. Events are ``(time, seq, kind, a, b)``; ``seq`` breaks ties in push order.
_COMPUTE_END, _LINK_DUE, _OPT_END, _FREE_COPY_END = 0, 1, 2, 3


class _OpCost:
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


class _OpState:
    """One operation of one simulated step: its fixed links (built once) and its progress."""

    __slots__ = ("dev", "label", "kind", "it", "pos", "mb", "task", "cost", "keys", "in_bytes",
                 "ctx_bytes", "dependents", "group", "ends_group", "last_of_iter", "alloc", "flush", "stash_add",
                 "stash_drop", "deps", "host_wait", "up_wait", "lookahead_ok", "started", "scale", "dur", "run")  # fmt: skip

    def __init__(
        self, dev: int, work: StageWork, tasks: tuple[Task, ...], it: int, pos: int, cost: _OpCost, keys
    ):
        self.dev, self.kind, self.task, self.cost, self.keys = dev, work.kind, tasks[0], cost, keys
        self.label = "+".join(map(str, tasks))
        self.it, self.pos, self.mb = it, pos, tasks[0].microbatch  # hand-offs: (name, boundary, mb)
        self.in_bytes = self.ctx_bytes = 0
        self.dependents: list[_OpState] = []  # operations whose ``deps`` count this one
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
        self.run: list[_OpState] | None = None  # ready order: the ops summing one gradient buffer


class _Link:
    """One direction of a switch's uplink. Copies in flight on it share its rate equally (fluid
    model). ``due`` is the ``seq`` of the one completion event that stands (0: none); an event
    with another is stale. ``dirty``: re-shared by the event being handled, its event not yet pushed."""

    __slots__ = ("flows", "rate", "t0", "due", "dirty")

    def __init__(self):
        self.flows: list[_Copy] = []
        self.rate = self.t0 = 0.0
        self.due = 0
        self.dirty = False


class _Lane:
    """One copy engine of a device (``h2d`` or ``d2h``): copies queued by priority, one at a time."""

    __slots__ = ("dev", "name", "queue", "busy", "link")

    def __init__(self, dev: int, name: str, link: _Link):
        self.dev, self.name, self.link = dev, name, link
        self.queue: list[tuple] = []  # heap of (priority, seq, copy)
        self.busy = False


class _Copy:
    """One copy on a copy engine; weight uploads move in ``chunk_bytes`` pieces."""

    __slots__ = ("dev", "lane", "name", "kind", "nbytes", "left", "prio", "done", "it", "t_pick", "size", "piece",
                 "key", "owner")  # fmt: skip

    def __init__(self, lane: _Lane, name: str, kind: str, nbytes: int, prio: tuple, done, it: int):
        self.dev, self.lane, self.name, self.kind = lane.dev, lane, name, kind
        self.nbytes = self.left = nbytes
        self.prio, self.done, self.it = prio, done, it
        self.t_pick = 0.0
        self.size = 0  # bytes of the piece on the wire
        self.piece = 0.0  # of which still to move
        self.key = self.owner = None


_PIECE = attrgetter("piece")


def _task_index(table: ScheduleTable) -> dict[str, list[list[_OpState | None]]]:
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


class _Sim:
    """One simulation: ``__init__`` builds per-operation state for every step (per-stage costs
    computed once and shared), ``run`` replays the events; the result is read off the counters."""

    def __init__(
        self, tables: list[ScheduleTable], work: Workload, hw: Server, opts: SimOptions, stream: list[bool]
    ):
        self.w, self.hw, self.opts, self.tables, self.stream = work, hw, opts, tables, stream
        self.n_dev = tables[0].num_devices
        self.n_layers = work.num_layers
        self.chunk = opts.chunk_bytes
        self.events: list = []
        self.seq = 0
        self.dirty_links: list[_Link] = []
        self.now = 0.0
        self.spans: list[tuple] | None = [] if opts.record_timeline else None  # Span fields
        self.link_bw = hw.gpu.host_link_bw_effective if opts.transfers else _INF
        self.uplink_bw = hw.uplink_bw_effective if opts.transfers else _INF
        per_switch = max(1, hw.gpus_per_switch)
        links = {(d // per_switch, ln): _Link() for d in range(self.n_dev) for ln in ("h2d", "d2h")}
        self.h2d = [_Lane(d, "h2d", links[(d // per_switch, "h2d")]) for d in range(self.n_dev)]
        self.d2h = [_Lane(d, "d2h", links[(d // per_switch, "d2h")]) for d in range(self.n_dev)]
        self.moved = {"h2d": 0, "d2h": 0}
        rate = hw.host_memory_bw * hw.optimizer_efficiency / ADAMW_BYTES_PER_PARAM
        self.opt_rate = rate if opts.optimizer_time else _INF
        self.staleness = 1 if opts.optimizer == "async" else 0
        self.mem = [[0, 0, 0, 0] for _ in range(self.n_dev)]  # per device, bytes by _WEIGHTS, _ACTS, ...
        self.mem_peak = [0] * self.n_dev
        self.mem_peak_at: list[tuple[str, tuple[int, ...]]] = [("", (0, 0, 0, 0))] * self.n_dev
        self.host = self.host_peak = work.host_state_bytes
        self.stash = [0] * self.n_dev
        self.stash_peak = [0] * self.n_dev
        self.busy = [0.0] * self.n_dev
        self.opt_busy = 0.0
        self.iter_end = [0.0] * len(tables)
        self._build()
        # Per device, (step, layer) -> 1 once its upload is issued (or waits for its optimizer step),
        # 2 once the weights are on the device.
        self.resident: list[dict[tuple[int, int], int]] = [{} for _ in range(self.n_dev)]
        self.eligible = [0] * self.n_dev  # groups [0, eligible) have been made eligible
        self.opt_queue: deque[tuple[int, int]] = deque()
        self.opt_running = False
        self.opt_start = 0.0
        self.step_done: set[tuple[int, int]] = set()
        self.deferred: dict[tuple[int, int], list[_Copy]] = defaultdict(list)
        self.cursor = [0] * self.n_dev
        self.ops_left = sum(len(o) for o in self.ops)
        self.ready = ReadyOrder(self) if opts.order == "ready" else None

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
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
        self.ops: list[list[_OpState]] = [[] for _ in range(self.n_dev)]
        self.by_task: list[dict[str, list[list[_OpState | None]]]] = []
        plans: dict[int, list] = {}  # steps that replay the same table share its plan
        noise = TaskNoise(self.opts.jitter, self.opts.jitter_seed, self.opts.slowdown, self.n_dev)
        costs: dict[int, _OpCost] = {}  # per StageWork (alive in ``plans`` meanwhile, so ids are unique)
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
                    st = _OpState(d, work, tasks, it, len(ops), cost, keys)
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
    ) -> _OpCost:
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
        cost = _OpCost(
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
        urgent = tuple(k for k in work.produces if k[0] == "grad" or k[1] in fwd_bounds)
        later = tuple(k for k in work.produces if not (k[0] == "grad" or k[1] in fwd_bounds))
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
        self.host_waiters: list[dict[tuple, list[_OpState]]] = [defaultdict(list) for _ in self.tables]
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
                    by_task[kind][stage][st.mb].dependents.append(st)
                    st.deps += 1
                if weight_bound[st.it] and st.kind == TaskKind.F:
                    self._keep_stash(self.tables[st.it], by_task, st, d)

    def _keep_stash(self, table: ScheduleTable, by_task: dict, st: _OpState, d: int) -> None:
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
            groups, last = [], []
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
        ly, wf = self.w.layers, self.w.w_fraction
        fwd = sum(ly[i].fwd_s for i in op.fwd_layers)
        if op.kind == TaskKind.F:
            return fwd
        if op.kind == FUSED:
            share = (1 - wf) if op.split else 1.0
            return fwd + sum(ly[i].fwd_s + ly[i].bwd_s * share for i in op.bwd_layers)
        recompute = sum(ly[i].fwd_s for i in op.bwd_layers if ly[i].recompute or op.first_forward)
        back = sum(ly[i].bwd_s for i in op.bwd_layers)
        if op.kind == TaskKind.B:
            return recompute + back
        if op.kind == TaskKind.I:
            return recompute + back * (1 - wf)
        return back * wf

    def _work_bytes(self, op: StageWork) -> tuple[int, int]:
        """(working set while ``op`` computes, bytes an I leaves on the device for its W)."""
        if op.kind == TaskKind.W:
            return 0, 0
        if op.kind == TaskKind.F:
            return task_bytes(self.w.layers, op.fwd_layers, ())[0], 0
        work, saved = task_bytes(self.w.layers, op.fwd_layers, op.bwd_layers)
        return work, (saved if op.kind == TaskKind.I else 0)

    # ------------------------------------------------------------------ event loop
    def _at(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        for d in range(self.n_dev):
            self._make_eligible(d, 2)
            if self.ready is not None:
                self.ready.fill(d)
            elif self.ops[d]:
                self._check_inputs(self.ops[d][0])
        for d in range(self.n_dev):
            self._try_compute(d)
        ev, pop = self.events, heapq.heappop
        compute_end, link_due, opt_end, copy_done = (
            self._compute_end,
            self._link_due,
            self._opt_end,
            self._copy_done,
        )
        while True:
            if self.dirty_links:
                self._push_due()
            if not ev:
                break
            t, _, kind, a, b = pop(ev)
            if kind == _LINK_DUE:
                if b == a.due:  # else the link was re-shared since and a later event stands for it
                    self.now = t
                    link_due(a)
                continue
            self.now = t
            if kind == _COMPUTE_END:
                compute_end(a)
            elif kind == _FREE_COPY_END:
                copy_done(a)
            else:
                opt_end(a)
        if self.ops_left:
            waiting = [
                f"d{d}: {self.ops[d][self.cursor[d]].label}"
                for d in range(self.n_dev)
                if self.cursor[d] < len(self.ops[d])
            ]
            raise ConfigError(f"internal: the simulation stalled; devices wait at {', '.join(waiting[:8])}")

    def free_operations(self) -> None:
        """Drop the per-operation state once :meth:`run` is over; only the counters are read after.
        (``simulate`` calls it before the cycle collector resumes, which would scan all of it once.)"""
        self.ops = self.by_task = self.consumers = self.host_waiters = self.groups = None

    # ------------------------------------------------------------------ accounting
    def _alloc(self, d: int, what: int, nbytes: int, label: str) -> None:
        """Add ``nbytes`` to memory class ``what`` of device ``d``; a new peak remembers ``label``."""
        m = self.mem[d]
        m[what] += nbytes
        if nbytes > 0:
            total = m[0] + m[1] + m[2] + m[3]
            if total > self.mem_peak[d]:
                self.mem_peak[d] = total
                self.mem_peak_at[d] = (label, tuple(m))

    def _free(self, d: int, what: int, nbytes: int) -> None:
        self.mem[d][what] -= nbytes

    def _host(self, delta: int) -> None:
        self.host += delta
        if self.host > self.host_peak:
            self.host_peak = self.host

    def _span(self, dev: int, lane: str, name: str, kind: str, start: float, end: float) -> None:
        if self.spans is not None:
            self.spans.append((dev, lane, name, kind, start, end))

    def _end(self, it: int) -> None:
        if self.now > self.iter_end[it]:
            self.iter_end[it] = self.now

    # ------------------------------------------------------------------ copy engines and the shared link
    def _enqueue(self, c: _Copy) -> None:
        self.seq += 1
        lane = c.lane
        if lane.busy or lane.queue:
            heapq.heappush(lane.queue, (c.prio, self.seq, c))
            if not lane.busy:
                self._kick(lane)
        else:  # an idle engine with nothing queued: no need to go through the queue
            self._kick(lane, c)

    def _kick(self, lane: _Lane, c: _Copy | None = None) -> None:
        """Put the next piece of ``c`` (default: the most urgent queued copy) on idle engine ``lane``."""
        if c is None:
            c = heapq.heappop(lane.queue)[2]
        lane.busy = True
        c.piece = c.size = min(c.left, self.chunk) if c.kind == "upload" else c.left
        c.t_pick = self.now
        if self.link_bw == _INF or c.piece <= 0:
            self._at(self.now, _FREE_COPY_END, c)
            return
        link = lane.link
        self._settle(link)
        link.flows.append(c)
        self._next_completion(link)

    def _settle(self, link: _Link) -> None:
        """Advance every copy in flight on ``link`` to now (they share one rate)."""
        moved = link.rate * (self.now - link.t0)
        if moved:
            for f in link.flows:
                f.piece -= moved
        link.t0 = self.now

    def _next_completion(self, link: _Link) -> None:
        """Re-share ``link`` among its copies; its earliest completion becomes the one event due.

        The event is pushed when the current event is handled (:meth:`_push_due`): a copy done and
        the next piece started on the same link in one handler then push one event, not two of
        which the first is stale. Its ``seq`` is taken here, so events pop exactly as if pushed now.
        """
        flows = link.flows
        if not flows:
            link.rate = 0.0
            link.due = 0
            return
        share = self.uplink_bw / len(flows)
        link.rate = share if share < self.link_bw else self.link_bw
        self.seq += 1
        link.due = self.seq
        if not link.dirty:
            link.dirty = True
            self.dirty_links.append(link)

    def _push_due(self) -> None:
        """Push the completion event of each link re-shared while handling the last event (nothing
        has moved on it since, so the time is what it was at the re-share)."""
        for link in self.dirty_links:
            link.dirty = False
            if link.due:
                first = min(map(_PIECE, link.flows))
                t = self.now + (first if first > 0 else 0.0) / link.rate
                heapq.heappush(self.events, (t, link.due, _LINK_DUE, link, link.due))
        self.dirty_links.clear()

    def _link_due(self, link: _Link) -> None:
        """The earliest copy on ``link`` is due (and any other within rounding of it)."""
        self._settle(link)
        eps = 1e-6 * link.rate * 1e-6 + 1.0  # within a byte (or a picosecond) counts as done
        done, left = [], []
        for f in link.flows:
            (done if f.piece <= eps else left).append(f)
        if not done:
            done = [min(left, key=_PIECE)]
            left.remove(done[0])
        link.flows = left
        self._next_completion(link)
        for f in done:
            self._copy_done(f)

    def _copy_done(self, c: _Copy) -> None:
        """A piece of ``c`` has arrived: queue the rest, or hand the finished copy to its owner."""
        lane, now = c.lane, self.now
        c.left -= c.size
        self.moved[lane.name] += c.size
        if now > c.t_pick and self.spans is not None:
            self.spans.append((c.dev, lane.name, c.name, c.kind, c.t_pick, now))
        if now > self.iter_end[c.it]:
            self.iter_end[c.it] = now
        lane.busy = False
        if c.left > 0:
            self._enqueue(c)  # the rest of a weight upload queues again
        else:
            c.done(c)
            if lane.queue and not lane.busy:
                self._kick(lane)

    # ------------------------------------------------------------------ weights
    def _make_eligible(self, d: int, upto: int) -> None:
        """Let groups ``[eligible, upto)`` of device ``d`` upload what they miss."""
        groups = self.groups[d]
        while self.eligible[d] < min(upto, len(groups)):
            g = self.eligible[d]
            first_it = groups[g][0][0]
            cur = self.cursor[d]
            if not self.stream[d] and cur < len(self.ops[d]) and first_it > self.ops[d][cur].it:
                return  # resident weights of the next step replace this step's: wait for the step's end
            self.eligible[d] += 1
            res = self.resident[d]
            for order, key in enumerate(groups[g]):
                if key in res:
                    continue
                res[key] = 1
                it, i = key
                lw = self.w.layers[i]
                c = _Copy(
                    self.h2d[d],
                    f"W:{lw.name}",
                    "upload",
                    lw.param_bytes,
                    (P_WEIGHT, g, order),
                    self._weight_done,
                    it,
                )
                c.key = key
                need = (it - 1 - self.staleness, i)
                if need[0] >= 0 and need in self.grad_count and need not in self.step_done:
                    self.deferred[need].append(c)
                else:
                    self._alloc(d, _WEIGHTS, c.nbytes, c.name)
                    self._enqueue(c)

    def _weight_done(self, c: _Copy) -> None:
        self.resident[c.dev][c.key] = 2
        self._try_compute(c.dev)

    def _after_op(self, d: int, st: _OpState) -> None:
        """Free weights the device no longer needs and open the next group's uploads."""
        g = st.group
        res = self.resident[d]
        if st.last_of_iter and not self.stream[d]:
            for key in [k for k, v in res.items() if k[0] == st.it and v == 2]:
                del res[key]
                self._free(d, _WEIGHTS, self.w.layers[key[1]].param_bytes)
        if not st.ends_group:
            if st.last_of_iter:
                self._make_eligible(d, g + 3)
            return
        if self.stream[d]:
            keep = set()
            for k in (g + 1, g + 2):
                if k < len(self.groups[d]):
                    keep.update(self.groups[d][k])
            for key in [k for k, v in res.items() if v == 2 and k not in keep]:
                del res[key]
                self._free(d, _WEIGHTS, self.w.layers[key[1]].param_bytes)
        self._make_eligible(d, g + 3)

    # ------------------------------------------------------------------ inputs
    def _check_inputs(self, st: _OpState) -> None:
        """Issue ``st``'s inputs (one copy) once its producers' outputs are on the host and lookahead allows."""
        if not st.lookahead_ok or st.host_wait > 0 or st.up_wait >= 0:
            return
        if not st.cost.consumes and not st.ctx_bytes:
            st.up_wait = 0
            self._try_compute(st.dev)
            return
        st.up_wait = 1
        c = _Copy(
            self.h2d[st.dev], f"in:{st.label}", "act", st.in_bytes, (P_ACT, st.pos), self._input_done, st.it
        )
        c.owner = st
        self._alloc(st.dev, _ACTS, st.in_bytes, st.label)
        self._enqueue(c)

    def _input_done(self, c: _Copy) -> None:
        st = c.owner
        st.up_wait = 0
        consumers, act = self.consumers[st.it], self.act_bytes
        for name, b in st.cost.consumes:
            k = (name, b, st.mb)
            consumers[k] -= 1
            if consumers[k] == 0:
                self.host -= round(act[b] * st.scale)  # (a drop sets no peak)
        self._try_compute(st.dev)

    # ------------------------------------------------------------------ compute
    def _try_compute(self, d: int) -> None:
        i = self.cursor[d]
        ops = self.ops[d]
        if i >= len(ops) or (self.ready is not None and not self.ready.committed(d, i)):
            return
        st = ops[i]
        if st.started >= 0 or st.deps or st.up_wait != 0:
            return
        res = self.resident[d]
        for k in st.keys:
            if res.get(k) != 2:
                return
        st.started = self.now
        cost = st.cost
        self._alloc(d, _WORK, round(cost.work * st.scale), st.label)
        if st.alloc:
            self._alloc(d, _GRADS, cost.wgrad, st.label)
        if st.stash_add:
            self.stash[d] += 1
            if self.stash[d] > self.stash_peak[d]:
                self.stash_peak[d] = self.stash[d]
        if self.ready is not None:
            self.ready.fill(d)
        elif i + 1 < len(ops):
            nxt = ops[i + 1]
            nxt.lookahead_ok = True
            self._check_inputs(nxt)
        self._at(self.now + st.dur, _COMPUTE_END, st)

    def _compute_end(self, st: _OpState) -> None:
        d, cost, now, scale = st.dev, st.cost, self.now, st.scale
        self.busy[d] += st.dur
        if now > self.iter_end[st.it]:
            self.iter_end[st.it] = now
        if cost.dur > 0 and self.spans is not None:
            self.spans.append((d, "compute", st.label, st.kind, st.started, now))
        mem = self.mem[d]
        mem[_WORK] -= round(cost.work * scale)
        mem[_ACTS] -= st.in_bytes
        if cost.hold:  # an I leaves its saved tensors for its W ...
            self._alloc(d, _ACTS, round(cost.hold * scale), st.label)
        mem[_ACTS] -= round(cost.release * scale)  # ... which frees them
        if st.stash_drop:
            self.stash[d] -= 1
        self.ops_left -= 1
        self.cursor[d] += 1
        d2h = self.d2h[d]
        for hand_offs, prio, kind, nbytes in cost.out_groups:
            nbytes = round(nbytes * scale)
            c = _Copy(d2h, f"out:{st.label}", kind, nbytes, (prio, st.pos), self._output_done, st.it)
            c.key, c.owner = hand_offs, st
            self._alloc(d, _ACTS, nbytes, st.label)
            self._enqueue(c)
        if cost.wgrad and st.flush:
            c = _Copy(
                d2h, f"grad:{st.label}", "download", cost.wgrad, (P_WGRAD, st.pos), self._wgrad_done, st.it
            )
            c.owner = st
            self._enqueue(c)
        elif cost.trainable and st.flush:
            self._grads_final(st)
        for dep in st.dependents:
            dep.deps -= 1
            if dep.deps == 0:
                if self.ready is not None:
                    self.ready.fill(dep.dev)
                self._try_compute(dep.dev)
        if st.ends_group or st.last_of_iter:  # else the device's weights stay as they are
            self._after_op(d, st)
        self._try_compute(d)

    def _output_done(self, c: _Copy) -> None:
        """Hand-offs ``c.key`` (``(name, boundary)`` of the microbatch of ``c.owner``) are on the host."""
        self._free(c.dev, _ACTS, c.nbytes)
        consumers, waiters, mb = self.consumers[c.it], self.host_waiters[c.it], c.owner.mb
        for name, b in c.key:
            k = (name, b, mb)
            if consumers.get(k, 0) > 0:
                self._host(round(self.act_bytes[b] * c.owner.scale))
            for st in waiters.pop(k, ()):
                st.host_wait -= 1
                if self.ready is not None and st.host_wait == 0:
                    self.ready.fill(st.dev)
                self._check_inputs(st)

    def _wgrad_done(self, c: _Copy) -> None:
        self._free(c.dev, _GRADS, c.nbytes)
        self._grads_final(c.owner)

    def _grads_final(self, st: _OpState) -> None:
        for i in st.cost.trainable:
            key = (st.it, i)
            if key in self.grad_count:
                self.grad_count[key] -= 1
                if self.grad_count[key] == 0:
                    self.opt_queue.append(key)
        self._opt_next()

    # ------------------------------------------------------------------ optimizer
    def _opt_next(self) -> None:
        if self.opt_running or not self.opt_queue:
            return
        key = self.opt_queue.popleft()
        self.opt_running = True
        self.opt_start = self.now
        dur = self.w.layers[key[1]].trainable_params / self.opt_rate if self.opt_rate != _INF else 0.0
        self._at(self.now + dur, _OPT_END, key)

    def _opt_end(self, key: tuple[int, int]) -> None:
        self.opt_running = False
        self.opt_busy += self.now - self.opt_start
        if self.now > self.opt_start:
            self._span(
                HOST_DEVICE, "host", f"step:{self.w.layers[key[1]].name}", "optim", self.opt_start, self.now
            )
        self.step_done.add(key)
        self._end(key[0])
        for c in self.deferred.pop(key, ()):
            self._alloc(c.dev, _WEIGHTS, c.nbytes, c.name)
            self._enqueue(c)
        self._opt_next()
