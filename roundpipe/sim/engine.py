"""Discrete-event simulation of training steps: a schedule table replayed on modelled hardware.

What is modelled, and why it matches the runtime (docs/design.md §3-§4):

- **Per device, three engines**: ``compute`` runs the device's operations strictly in table order
  (fused F+B pairs as one operation, see ``schedule/flow.py``); ``h2d`` and ``d2h`` copy engines
  move one copy at a time, choosing by priority: activations the next compute needs (0) > weights
  of the current/next stage (1) > weight gradients down (2) > saved stage inputs down (3). Weight
  uploads and weight-gradient downloads are cut into ``chunk_bytes`` pieces so an urgent copy can
  pass between pieces. The runtime gets the same effect by issue order (a real copy engine runs
  copies as issued): it issues bulk chunks a few per task, after the task's urgent copies
  (``runtime/paced_copies.py``), so an urgent copy there may still wait for the few chunks issued
  before it; the model lets it pass at the next piece.
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
- **Compute time**: what each operation costs is set before the replay (``operations.py``). Each
  operation with work starts ``Workload.task_s`` after it could (the host's gap between operations,
  idle device time, not compute).
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
from operator import attrgetter
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.presets import Server
from roundpipe.schedule.table import ScheduleTable
from roundpipe.schedule.timeline import HOST_DEVICE
from roundpipe.sim.host_traffic import accumulate_bytes, update_bytes
from roundpipe.sim.operations import P_ACT, P_WEIGHT, P_WGRAD, Operations, OpState
from roundpipe.sim.options import SimOptions
from roundpipe.sim.ready import ReadyOrder
from roundpipe.sim.workload import Workload

_INF = math.inf

# A device's memory classes (indexes of ``_Sim.mem[d]``): weights, activations, working sets, gradients.
_WEIGHTS, _ACTS, _WORK, _GRADS = 0, 1, 2, 3
# Event kinds. Events are ``(time, seq, kind, a, b)``; ``seq`` breaks ties in push order.
_COMPUTE_END, _LINK_DUE, _OPT_END, _FREE_COPY_END = 0, 1, 2, 3


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
    """One copy on a copy engine; weight uploads and gradient downloads move in ``chunk_bytes`` pieces."""

    __slots__ = ("dev", "lane", "name", "kind", "nbytes", "left", "prio", "done", "it", "t_pick", "size", "piece",
                 "key", "owner")  # fmt: skip

    def __init__(self, lane: _Lane, name: str, kind: str, nbytes: int, prio: tuple, done, it: int):
        self.dev, self.lane, self.name, self.kind = lane.dev, lane, name, kind
        self.nbytes = self.left = nbytes
        self.prio, self.done, self.it = prio, done, it
        self.t_pick = 0.0
        self.size = 0  # bytes of the piece on the wire
        self.piece = 0.0  # of which still to move
        self.key: Any = None  # a weight's (step, layer), or the hand-offs an output copy carries
        self.owner: Any = None  # the operation whose input or output this copy moves


_PIECE = attrgetter("piece")
_CHUNKED = ("upload", "download")  # weights up, weight gradients down: cut into ``chunk_bytes`` pieces


class _Sim:
    """One simulation: ``__init__`` builds per-operation state for every step (``operations.py``:
    per-stage costs computed once and shared), ``run`` replays the events; the result is read off
    the counters."""

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
        self.host_rate = hw.host_work_bw if opts.optimizer_time else _INF  # bytes/s (host_traffic.py)
        self.staleness = 1 if opts.optimizer == "async" else 0
        self.mem = [[0, 0, 0, 0] for _ in range(self.n_dev)]  # per device, bytes by _WEIGHTS, _ACTS, ...
        self.mem_peak = [0] * self.n_dev
        self.mem_peak_at: list[tuple[str, tuple[int, ...]]] = [("", (0, 0, 0, 0))] * self.n_dev
        self.host = self.host_peak = work.host_state_bytes
        self.stash = [0] * self.n_dev
        self.stash_peak = [0] * self.n_dev
        self.busy = [0.0] * self.n_dev
        self.opt_busy = 0.0  # the host thread's seconds: updates, gradient additions
        self.acc_busy = 0.0
        self.iter_end = [0.0] * len(tables)
        built = Operations(tables, work, opts)
        self.act_bytes, self.ops, self.groups = built.act_bytes, built.ops, built.groups
        self.consumers, self.host_waiters = built.consumers, built.host_waiters
        self.grad_count = built.grad_count
        # Per device, (step, layer) -> 1 once its upload is issued (or waits for its optimizer step),
        # 2 once the weights are on the device.
        self.resident: list[dict[tuple[int, int], int]] = [{} for _ in range(self.n_dev)]
        self.eligible = [0] * self.n_dev  # groups [0, eligible) have been made eligible
        # The host thread's jobs, (step, layer) each: gradient additions first (the runtime lets them
        # pass a queued update), then updates; ``accumulated``: the keys with a gradient added.
        self.acc_queue: deque[tuple[int, int]] = deque()
        self.opt_queue: deque[tuple[int, int]] = deque()
        self.accumulated: set[tuple[int, int]] = set()
        self.opt_running = False
        self.opt_start = 0.0
        self.step_done: set[tuple[int, int]] = set()
        self.deferred: dict[tuple[int, int], list[_Copy]] = defaultdict(list)
        self.cursor = [0] * self.n_dev
        self.ops_left = sum(len(o) for o in self.ops)
        self.ready = ReadyOrder(self) if opts.order == "ready" else None
        self.gap = work.task_s  # before each operation with work: the host's share, not compute

    # ------------------------------------------------------------------ event loop
    def _at(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        for d in range(self.n_dev):
            self.make_eligible(d, 2)
            if self.ready is not None:
                self.ready.fill(d)
            elif self.ops[d]:
                self.check_inputs(self.ops[d][0])
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
        del self.ops, self.consumers, self.host_waiters, self.groups

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
        c.piece = c.size = min(c.left, self.chunk) if c.kind in _CHUNKED else c.left
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
        done: list[_Copy] = []
        left: list[_Copy] = []
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
    def make_eligible(self, d: int, upto: int) -> None:
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

    def _after_op(self, d: int, st: OpState) -> None:
        """Free weights the device no longer needs and open the next group's uploads."""
        g = st.group
        res = self.resident[d]
        if st.last_of_iter and not self.stream[d]:
            for key in [k for k, v in res.items() if k[0] == st.it and v == 2]:
                del res[key]
                self._free(d, _WEIGHTS, self.w.layers[key[1]].param_bytes)
        if not st.ends_group:
            if st.last_of_iter:
                self.make_eligible(d, g + 3)
            return
        if self.stream[d]:
            keep: set[tuple[int, int]] = set()
            for k in (g + 1, g + 2):
                if k < len(self.groups[d]):
                    keep.update(self.groups[d][k])
            for key in [k for k, v in res.items() if v == 2 and k not in keep]:
                del res[key]
                self._free(d, _WEIGHTS, self.w.layers[key[1]].param_bytes)
        self.make_eligible(d, g + 3)

    # ------------------------------------------------------------------ inputs
    def check_inputs(self, st: OpState) -> None:
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
            self.check_inputs(nxt)
        self._at(self.now + (self.gap if st.cost.dur > 0 else 0.0) + st.dur, _COMPUTE_END, st)

    def _compute_end(self, st: OpState) -> None:
        d, cost, now, scale = st.dev, st.cost, self.now, st.scale
        self.busy[d] += st.dur
        if now > self.iter_end[st.it]:
            self.iter_end[st.it] = now
        if cost.dur > 0 and self.spans is not None:
            self.spans.append((d, "compute", st.label, st.kind, now - st.dur, now))
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
                self.check_inputs(st)

    def _wgrad_done(self, c: _Copy) -> None:
        self._free(c.dev, _GRADS, c.nbytes)
        self._grads_final(c.owner)

    def _grads_final(self, st: OpState) -> None:
        """A task's weight gradients are on the host: the host thread adds each layer's in."""
        self.acc_queue.extend(key for i in st.cost.trainable if (key := (st.it, i)) in self.grad_count)
        self._opt_next()

    # ------------------------------------------------------------------ the host thread
    def _opt_next(self) -> None:
        """Start the host thread's next job: an addition, else an update (``host_traffic.py``)."""
        if self.opt_running or not (self.acc_queue or self.opt_queue):
            return
        adding = bool(self.acc_queue)
        key = (self.acc_queue if adding else self.opt_queue).popleft()
        params = self.w.layers[key[1]].trainable_params
        if adding:
            nbytes = accumulate_bytes(params, first=key not in self.accumulated)
            self.accumulated.add(key)
        else:
            nbytes = update_bytes(params, self.w.dtype)
        self.opt_running = True
        self.opt_start = self.now
        dur = nbytes / self.host_rate if self.host_rate != _INF else 0.0
        self._at(self.now + dur, _OPT_END, (adding, key))

    def _opt_end(self, job: tuple[bool, tuple[int, int]]) -> None:
        adding, key = job
        self.opt_running = False
        if adding:
            self.acc_busy += self.now - self.opt_start
        else:
            self.opt_busy += self.now - self.opt_start
        if self.now > self.opt_start:
            what, kind = ("acc", "accumulate") if adding else ("step", "optim")
            self._span(
                HOST_DEVICE, "host", f"{what}:{self.w.layers[key[1]].name}", kind, self.opt_start, self.now
            )
        if adding:
            self.grad_count[key] -= 1
            if self.grad_count[key] == 0:
                self.opt_queue.append(key)
        else:
            self.step_done.add(key)
            self._end(key[0])
            for c in self.deferred.pop(key, ()):
                self._alloc(c.dev, _WEIGHTS, c.nbytes, c.name)
                self._enqueue(c)
        self._opt_next()
