"""Discrete-event simulation of training steps: a schedule table replayed on modelled hardware.

What is modelled, and why it matches the runtime (DESIGN.md §3-§4):

- **Per device, three engines**: ``compute`` runs the device's operations strictly in table order
  (fused F+B pairs as one operation, see ``workload.device_ops``); ``h2d`` and ``d2h`` copy engines
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
- **Compute time**: F runs its forward layers; B re-runs the forward (layers that recompute) and
  backpropagates; a fused F+B runs the head once with autograd, no recompute; I is recompute +
  input gradient and W the weight gradient (``w_fraction`` of the backward).
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
from collections import defaultdict
from dataclasses import dataclass, field

from roundpipe.errors import ConfigError
from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.table import ScheduleTable
from roundpipe.schedule.timeline import HOST_DEVICE, Span, Timeline
from roundpipe.sim.presets import Server
from roundpipe.sim.workload import Op, Workload, device_ops

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
    classic_flow: bool = False  # textbook forward tasks (closed forms' setting), see workload.device_ops
    # Sum weight gradients on the device while the next task on the device backpropagates the same
    # layers and download them once (what the runtime does); False: download after every task.
    accumulate_grads: bool = True
    stream_weights: bool | None = None  # None: stream unless the table is weight-bound and fits

    def __post_init__(self):
        if self.optimizer not in ("sync", "async"):
            raise ConfigError(f"optimizer must be 'sync' or 'async', got {self.optimizer!r}")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.iterations is not None and self.iterations < 1:
            raise ConfigError(f"iterations must be >= 1, got {self.iterations}")


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs and holds. Times in seconds, memory in bytes.

    ``bubble_total`` is idle/total compute time over all devices, ``bubble_ideal`` idle/ideal
    (``iteration_s * D / busy - 1``). ``peak_gpu_bytes[d]`` includes the workspace reserve;
    ``peak_activations[d]`` counts stage inputs held between a forward and its backward on ``d``
    (the closed forms' unit). ``fits`` is False when a device or the host exceeds its memory, and
    ``reason`` then says where, by how much and at which task.
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
        }


class _Copy:
    """One copy on a device's h2d or d2h engine; weight uploads move in ``chunk_bytes`` pieces."""

    __slots__ = ("dev", "lane", "name", "kind", "nbytes", "left", "prio", "done", "it", "rate", "t0", "t_pick",
                 "ver", "piece", "key", "owner")  # fmt: skip

    def __init__(self, dev: int, lane: str, name: str, kind: str, nbytes: int, prio: tuple, done, it: int):
        self.dev, self.lane, self.name, self.kind = dev, lane, name, kind
        self.nbytes = self.left = nbytes
        self.prio, self.done, self.it = prio, done, it
        self.rate = self.t0 = self.t_pick = 0.0
        self.ver = 0
        self.piece = 0.0
        self.key = self.owner = None


class _OpState:
    """An operation plus its simulation state (one per op per simulated step)."""

    __slots__ = ("op", "it", "pos", "dur", "keys", "ins", "outs", "wgrad", "trainable", "work", "hold", "deps",
                 "dependents", "host_wait", "up_wait", "lookahead_ok", "started", "ended", "group", "ctx_bytes",
                 "stash_add", "stash_drop", "last_of_iter", "alloc", "flush", "in_bytes", "out_groups")  # fmt: skip


class _Sim:
    def __init__(
        self, tables: list[ScheduleTable], work: Workload, hw: Server, opts: SimOptions, stream: list[bool]
    ):
        self.w, self.hw, self.opts, self.tables, self.stream = work, hw, opts, tables, stream
        self.n_dev = tables[0].num_devices
        self.n_layers = work.num_layers
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.spans: list[tuple] | None = [] if opts.record_timeline else None  # Span fields
        self.link_bw = hw.gpu.host_link_bw_effective if opts.transfers else _INF
        self.uplink_bw = hw.uplink_bw_effective if opts.transfers else _INF
        per_switch = max(1, hw.gpus_per_switch)
        self.switch = [d // per_switch for d in range(self.n_dev)]
        self.flows: dict[tuple[int, str], list[_Copy]] = defaultdict(list)  # in flight per switch direction
        self.sw_rate: dict[tuple[int, str], float] = {}
        self.sw_t0: dict[tuple[int, str], float] = {}
        self.sw_ver: dict[tuple[int, str], int] = {}
        self.lane_heap: dict[tuple[int, str], list] = {
            (d, ln): [] for d in range(self.n_dev) for ln in ("h2d", "d2h")
        }
        self.lane_busy = dict.fromkeys(self.lane_heap, False)
        self.moved = {"h2d": 0, "d2h": 0}
        rate = hw.host_memory_bw * hw.optimizer_efficiency / ADAMW_BYTES_PER_PARAM
        self.opt_rate = rate if opts.optimizer_time else _INF
        self.staleness = 1 if opts.optimizer == "async" else 0
        self.mem = [[0, 0, 0, 0] for _ in range(self.n_dev)]  # weights, activations, working sets, gradients
        self.mem_peak = [0] * self.n_dev
        self.mem_peak_at: list[tuple[str, tuple[int, ...]]] = [("", (0, 0, 0, 0))] * self.n_dev
        self.host = self.host_peak = work.host_state_bytes
        self.stash = [0] * self.n_dev
        self.stash_peak = [0] * self.n_dev
        self.busy = [0.0] * self.n_dev
        self.opt_busy = 0.0
        self.iter_end = [0.0] * len(tables)
        self._build()

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        layers = self.w.layers
        self.ops: list[list[_OpState]] = [[] for _ in range(self.n_dev)]
        by_task: dict[tuple, _OpState] = {}
        self.consumers: dict[tuple, int] = defaultdict(int)
        self.grad_count: dict[tuple[int, int], int] = defaultdict(int)
        shape_cache: dict[tuple, tuple] = {}  # every microbatch of a stage costs the same
        key_cache: dict[tuple, list] = {}
        for it, table in enumerate(self.tables):
            for d, ops in enumerate(device_ops(table, classic=self.opts.classic_flow)):
                for op in ops:
                    st = _OpState()
                    st.op, st.it, st.pos = op, it, len(self.ops[d])
                    shape = (
                        op.kind,
                        op.fwd_layers,
                        op.bwd_layers,
                        op.first_forward,
                        op.split,
                        op.weight_grads,
                    )
                    cached = shape_cache.get(shape)
                    if cached is None:
                        dur = self._duration(op)
                        bwd = op.bwd_layers
                        trainable = [
                            i for i in bwd if layers[i].grad_bytes > 0 or layers[i].trainable_params > 0
                        ]
                        if op.kind in ("B", "I") and bwd.start == 0 and not trainable and not op.produces:
                            dur, bwd = 0.0, range(0)  # frozen embedding alone: nothing to run
                        trainable = trainable if op.weight_grads else []
                        wgrad = sum(layers[i].grad_bytes for i in trainable)
                        cached = (
                            dur,
                            bwd,
                            trainable,
                            wgrad,
                            self._work_bytes(op),
                            list(op.layers) if dur > 0 else [],
                        )
                        shape_cache[shape] = cached
                    st.dur, op.bwd_layers, st.trainable, st.wgrad, (st.work, st.hold), lay = cached
                    kk = (it, shape)
                    st.keys = key_cache.get(kk)
                    if st.keys is None:
                        st.keys = key_cache[kk] = [(it, i) for i in lay]
                    st.ins = [(it, *k) for k in op.consumes]
                    st.outs = [(it, *k) for k in op.produces]
                    st.alloc = st.flush = True
                    st.deps, st.dependents = 0, []
                    st.host_wait, st.up_wait = len(st.ins), -1
                    st.lookahead_ok = st.pos == 0
                    st.started = st.ended = -1.0
                    st.ctx_bytes, st.group = 0, -1
                    st.stash_add, st.stash_drop = True, True
                    st.last_of_iter = False
                    for k in st.ins:
                        self.consumers[k] += 1
                    for t in op.tasks:
                        by_task[(it, *t)] = st
                    self.ops[d].append(st)
        self.host_waiters: dict[tuple, list[_OpState]] = defaultdict(list)
        for d in range(self.n_dev):
            if self.opts.accumulate_grads:
                # One gradient buffer per run of backward tasks over the same layers; forward tasks
                # in between (1F1B-style rows) leave it open, as the runtime's worker does.
                backward_ops = [st for st in self.ops[d] if st.op.bwd_layers]
                for a, b in zip(backward_ops, backward_ops[1:]):
                    if a.trainable and b.trainable and a.it == b.it and a.op.bwd_layers == b.op.bwd_layers:
                        a.flush = b.alloc = False
            for st in self.ops[d]:
                if st.flush:
                    for i in st.trainable:
                        if layers[i].trainable_params > 0:
                            self.grad_count[(st.it, i)] += 1
            for st in self.ops[d]:
                for k in st.ins:
                    self.host_waiters[k].append(st)
            for a, b in zip(self.ops[d], self.ops[d][1:]):
                a.last_of_iter = a.it != b.it
            if self.ops[d]:
                self.ops[d][-1].last_of_iter = True
        # Control dependencies (deps.py) and the stash a device keeps between F and B of a stage.
        for it, table in enumerate(self.tables):
            closing = "W" if table.split_backward else "B"
            dep_cache: dict[tuple[str, int], list[tuple[str, int]]] = {}
            for d in range(self.n_dev):
                for st in self.ops[d]:
                    if st.it != it:
                        continue
                    own = st.op.tasks
                    for t in own:
                        dk = (t.kind, t.stage)
                        deps = dep_cache.get(dk)
                        if deps is None:
                            deps = dep_cache[dk] = [(k.kind, k.stage) for k in table.dependencies(t)]
                        for kind, stage in deps:
                            k = TaskKey(kind, stage, t.microbatch)
                            if k not in own:
                                by_task[(it, *k)].dependents.append(st)
                                st.deps += 1
                    t = st.op.tasks[0]
                    if st.op.kind != "F" or t.stage >= table.backward.num_stages:
                        continue
                    peer = by_task.get((it, closing, t.stage, t.microbatch))
                    same = table.forward.bounds[t.stage] == table.backward.bounds[t.stage]
                    if (
                        table.weight_bound
                        and peer is not None
                        and peer is not st
                        and peer.op.device == d
                        and same
                    ):
                        st.stash_drop = False  # held from the forward until its backward ends
                        peer.stash_add = False
                        if table.split_backward:
                            inp = by_task.get((it, "I", t.stage, t.microbatch))
                            if inp is not None:
                                inp.stash_add = inp.stash_drop = False
        # Weight groups per device: consecutive operations over the same layers.
        self.groups: list[list[list[tuple[int, int]]]] = []
        self.group_last: list[list[int]] = []
        for d in range(self.n_dev):
            groups, last = [], []
            for st in self.ops[d]:
                if st.keys:
                    if not groups or groups[-1] != st.keys:
                        groups.append(st.keys)
                        last.append(st.pos)
                    last[-1] = st.pos
                st.group = len(groups) - 1
            self.groups.append(groups)
            self.group_last.append(last)
        self.resident: list[dict[tuple[int, int], int]] = [
            {} for _ in range(self.n_dev)
        ]  # 1 queued, 2 on device
        self.eligible = [0] * self.n_dev  # groups [0, eligible) have been made eligible
        self.opt_queue: list[tuple[int, int]] = []
        self.opt_running = False
        self.opt_start = 0.0
        self.step_done: set[tuple[int, int]] = set()
        self.deferred: dict[tuple[int, int], list[_Copy]] = defaultdict(list)
        self.cursor = [0] * self.n_dev
        self.ops_left = sum(len(o) for o in self.ops)
        ctx = layers[0].act_in_bytes if layers else 0
        for d in range(self.n_dev):
            prev = None
            for st in self.ops[d]:
                mb = (st.it, st.op.tasks[0].microbatch)
                if st.op.kind != "W" and (st.keys or st.ins) and mb != prev:
                    st.ctx_bytes, prev = ctx, mb
                st.in_bytes = sum(self._key_bytes(k) for k in st.ins) + st.ctx_bytes
                st.out_groups = []
                if st.outs:
                    bounds = self.tables[st.it].forward.bounds
                    urgent = [k for k in st.outs if k[1] == "grad" or k[2] in bounds]
                    later = [k for k in st.outs if not (k[1] == "grad" or k[2] in bounds)]
                    for keys, prio, kind in ((urgent, P_ACT, "act"), (later, P_STASH, "stash")):
                        if keys:
                            st.out_groups.append((keys, prio, kind, sum(self._key_bytes(k) for k in keys)))

    def _duration(self, op: Op) -> float:
        ly, wf = self.w.layers, self.w.w_fraction
        fwd = sum(ly[i].fwd_s for i in op.fwd_layers)
        if op.kind == "F":
            return fwd
        if op.kind == "FB":
            share = (1 - wf) if op.split else 1.0
            return fwd + sum(ly[i].fwd_s + ly[i].bwd_s * share for i in op.bwd_layers)
        recompute = sum(ly[i].fwd_s for i in op.bwd_layers if ly[i].recompute or op.first_forward)
        back = sum(ly[i].bwd_s for i in op.bwd_layers)
        if op.kind == "B":
            return recompute + back
        if op.kind == "I":
            return recompute + back * (1 - wf)
        return back * wf

    def _work_bytes(self, op: Op) -> tuple[int, int]:
        """(working set while ``op`` computes, bytes an I leaves on the device for its W)."""
        ly = self.w.layers
        fwd = max((ly[i].fwd_work_bytes for i in op.fwd_layers), default=0)
        saved = sum(ly[i].saved_bytes for i in op.bwd_layers)
        bwd = saved + max((ly[i].transient_bytes for i in op.bwd_layers), default=0)
        if op.kind == "F":
            return fwd, 0
        if op.kind == "W":
            return 0, 0
        return max(fwd, bwd), (saved if op.kind == "I" else 0)

    # ------------------------------------------------------------------ event loop
    def _at(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        for d in range(self.n_dev):
            self._make_eligible(d, 2)
            if self.ops[d]:
                self._check_inputs(self.ops[d][0])
        for d in range(self.n_dev):
            self._try_compute(d)
        ev = self.events
        while ev:
            t, _, kind, a, b = heapq.heappop(ev)
            self.now = t
            if kind == 0:
                self._compute_end(a)
            elif kind == 1:
                self._flow_end(a, b)
            else:
                self._opt_end(a)
        if self.ops_left:
            waiting = [
                f"d{d}: {self.ops[d][self.cursor[d]].op.label}"
                for d in range(self.n_dev)
                if self.cursor[d] < len(self.ops[d])
            ]
            raise ConfigError(f"internal: the simulation stalled; devices wait at {', '.join(waiting[:8])}")

    # ------------------------------------------------------------------ accounting
    def _mem(self, d: int, what: int, delta: int, label: str) -> None:
        m = self.mem[d]
        m[what] += delta
        if delta > 0:
            total = m[0] + m[1] + m[2] + m[3]
            if total > self.mem_peak[d]:
                self.mem_peak[d] = total
                self.mem_peak_at[d] = (label, tuple(m))

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
        heapq.heappush(self.lane_heap[(c.dev, c.lane)], (c.prio, self.seq, c))
        if not self.lane_busy[(c.dev, c.lane)]:
            self._kick(c.dev, c.lane)

    def _kick(self, d: int, lane: str) -> None:
        key = (d, lane)
        heap = self.lane_heap[key]
        if self.lane_busy[key] or not heap:
            return
        c = heapq.heappop(heap)[2]
        self.lane_busy[key] = True
        c.piece = min(c.left, self.opts.chunk_bytes) if c.kind == "upload" else c.left
        c.t_pick = self.now
        if self.link_bw == _INF or c.piece <= 0:
            self._at(self.now, 1, c, None)
            return
        sw = (self.switch[d], lane)
        flows = self.flows[sw]
        self._settle(sw, flows)
        flows.append(c)
        self._next_completion(sw, flows)

    def _settle(self, sw: tuple[int, str], flows: list[_Copy]) -> None:
        """Advance every copy in flight on switch direction ``sw`` to now (they share one rate)."""
        moved = self.sw_rate.get(sw, 0.0) * (self.now - self.sw_t0.get(sw, self.now))
        if moved:
            for f in flows:
                f.piece -= moved
        self.sw_t0[sw] = self.now

    def _next_completion(self, sw: tuple[int, str], flows: list[_Copy]) -> None:
        """Re-share ``sw`` among its copies and schedule the earliest completion (one event per switch)."""
        ver = self.sw_ver.get(sw, 0) + 1
        self.sw_ver[sw] = ver
        if not flows:
            self.sw_rate[sw] = 0.0
            return
        rate = min(self.link_bw, self.uplink_bw / len(flows))
        self.sw_rate[sw] = rate
        first = min(f.piece for f in flows)
        self._at(self.now + (first if first > 0 else 0.0) / rate, 1, sw, ver)

    def _flow_end(self, sw, ver) -> None:
        if ver is None:  # a free copy (no bandwidth modelled): ``sw`` is the copy itself
            self._copy_done(sw)
            return
        if ver != self.sw_ver.get(sw):
            return
        flows = self.flows[sw]
        self._settle(sw, flows)
        eps = 1e-6 * self.sw_rate[sw] * 1e-6 + 1.0  # within a byte (or a picosecond) counts as done
        done = [f for f in flows if f.piece <= eps]
        if not done:
            done = [min(flows, key=lambda f: f.piece)]
        for f in done:
            flows.remove(f)
        self._next_completion(sw, flows)
        for f in done:
            self._copy_done(f)

    def _copy_done(self, c: _Copy) -> None:
        d, lane = c.dev, c.lane
        moved = min(c.left, self.opts.chunk_bytes) if c.kind == "upload" else c.left
        c.left -= moved
        self.moved[lane] += moved
        if self.now > c.t_pick:
            self._span(d, lane, c.name, c.kind, c.t_pick, self.now)
        self._end(c.it)
        self.lane_busy[(d, lane)] = False
        if c.left > 0:
            self.seq += 1
            heapq.heappush(self.lane_heap[(d, lane)], (c.prio, self.seq, c))
        else:
            c.done(c)
        self._kick(d, lane)

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
                    d,
                    "h2d",
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
                    self._mem(d, 0, c.nbytes, c.name)
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
                self._mem(d, 0, -self.w.layers[key[1]].param_bytes, "")
        if g < 0 or self.group_last[d][g] != st.pos:
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
                self._mem(d, 0, -self.w.layers[key[1]].param_bytes, "")
        self._make_eligible(d, g + 3)

    # ------------------------------------------------------------------ inputs
    def _key_bytes(self, k: tuple) -> int:
        b = k[2]
        return self.w.layers[b].act_in_bytes if b < self.n_layers else 0

    def _check_inputs(self, st: _OpState) -> None:
        """Issue ``st``'s inputs (one copy) once its producers' outputs are on the host and lookahead allows."""
        if not st.lookahead_ok or st.host_wait > 0 or st.up_wait >= 0:
            return
        d = st.op.device
        if not st.ins and not st.ctx_bytes:
            st.up_wait = 0
            self._try_compute(d)
            return
        nbytes = st.in_bytes
        st.up_wait = 1
        c = _Copy(d, "h2d", f"in:{st.op.label}", "act", nbytes, (P_ACT, st.pos), self._input_done, st.it)
        c.key, c.owner = st.ins, st
        self._mem(d, 1, nbytes, st.op.label)
        self._enqueue(c)

    def _input_done(self, c: _Copy) -> None:
        st = c.owner
        st.up_wait = 0
        consumers = self.consumers
        for k in c.key:
            consumers[k] -= 1
            if consumers[k] == 0:
                self._host(-self._key_bytes(k))
        self._try_compute(st.op.device)

    # ------------------------------------------------------------------ compute
    def _try_compute(self, d: int) -> None:
        i = self.cursor[d]
        ops = self.ops[d]
        if i >= len(ops):
            return
        st = ops[i]
        if st.started >= 0 or st.deps or st.up_wait != 0:
            return
        res = self.resident[d]
        for k in st.keys:
            if res.get(k) != 2:
                return
        st.started = self.now
        self._mem(d, 2, st.work, st.op.label)
        if st.alloc:
            self._mem(d, 3, st.wgrad, st.op.label)
        if st.stash_add:
            self.stash[d] += 1
            if self.stash[d] > self.stash_peak[d]:
                self.stash_peak[d] = self.stash[d]
        if i + 1 < len(ops):
            nxt = ops[i + 1]
            nxt.lookahead_ok = True
            self._check_inputs(nxt)
        self._at(self.now + st.dur, 0, st)

    def _compute_end(self, st: _OpState) -> None:
        d, op = st.op.device, st.op
        st.ended = self.now
        self.busy[d] += st.dur
        self._end(st.it)
        if st.dur > 0:
            self._span(d, "compute", op.label, op.kind, st.started, self.now)
        if st.work:
            self._mem(d, 2, -st.work, "")
        if st.in_bytes:
            self._mem(d, 1, -st.in_bytes, "")
        if st.hold:
            self._mem(d, 1, st.hold, op.label)
        if op.kind == "W":
            self._mem(d, 1, -sum(self.w.layers[i].saved_bytes for i in op.bwd_layers), "")
        if st.stash_drop:
            self.stash[d] -= 1
        self.ops_left -= 1
        self.cursor[d] += 1
        for keys, prio, kind, nbytes in st.out_groups:
            c = _Copy(d, "d2h", f"out:{op.label}", kind, nbytes, (prio, st.pos), self._output_done, st.it)
            c.key = keys
            self._mem(d, 1, nbytes, op.label)
            self._enqueue(c)
        if st.wgrad and st.flush:
            c = _Copy(
                d, "d2h", f"grad:{op.label}", "download", st.wgrad, (P_WGRAD, st.pos), self._wgrad_done, st.it
            )
            c.owner = st
            self._enqueue(c)
        elif st.trainable and st.flush:
            self._grads_final(st)
        for dep in st.dependents:
            dep.deps -= 1
            if dep.deps == 0:
                self._try_compute(dep.op.device)
        self._after_op(d, st)
        self._try_compute(d)

    def _output_done(self, c: _Copy) -> None:
        self._mem(c.dev, 1, -c.nbytes, "")
        for k in c.key:
            if self.consumers.get(k, 0) > 0:
                self._host(self._key_bytes(k))
            for st in self.host_waiters.pop(k, ()):
                st.host_wait -= 1
                self._check_inputs(st)

    def _wgrad_done(self, c: _Copy) -> None:
        self._mem(c.dev, 3, -c.nbytes, "")
        self._grads_final(c.owner)

    def _grads_final(self, st: _OpState) -> None:
        for i in st.trainable:
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
        key = self.opt_queue.pop(0)
        self.opt_running = True
        self.opt_start = self.now
        dur = self.w.layers[key[1]].trainable_params / self.opt_rate if self.opt_rate != _INF else 0.0
        self._at(self.now + dur, 2, key)

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
            self._mem(c.dev, 0, c.nbytes, c.name)
            self._enqueue(c)
        self._opt_next()
