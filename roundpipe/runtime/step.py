"""Per-call state of one ``forward_backward``: shared by the worker threads and the host thread.

Workers read the microbatches, the flow plan and the gradient seed, pass hand-offs through the
``exchange``, and report downloads with ``on_loss`` / ``on_grads`` (worker threads). Those queue
jobs on the host thread, which adds losses and gradients in issue order and steps every layer
group whose gradient became final (when stepping eagerly). The caller's thread reads ``loss_sum``
once the step has been synchronized (an overlapped call: once ``loss_ready``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from roundpipe.models.base import MicrobatchInputs
from roundpipe.runtime.call_issue import CallIssue, wait_unless_aborted
from roundpipe.runtime.exchange import Exchange, Slot
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.runtime.numerics import NonFinite, TaskChecks, host_float
from roundpipe.runtime.optimizer_steps import OptimizerSteps, grads_of
from roundpipe.runtime.plan import FlowPlan
from roundpipe.runtime.router_totals import RouterTotals


@dataclass(frozen=True)
class StepOutput:
    """What ``forward_backward`` returns: the batch loss (mean over label tokens) and that token count."""

    loss: float
    num_tokens: int


class StepRun:
    """State of one ``forward_backward`` call.

    Args:
        index: the step's number (with the layer and microbatch, it seeds the dropout that
            recompute replays).
        microbatches: the split batch (CPU tensors).
        total_tokens: label tokens of the whole batch; the backward seed is ``loss_scale / total``.
        flow_plan: what every device runs.
        eager: step each layer group on the host thread as soon as its gradient is final.
        exchange: the host-side hand-offs of this call (abandoned waits raise on abort).
        hostq: the host thread, which runs the jobs ``on_loss`` / ``on_grads`` queue.
        updates: the optimizer side: step groups, loss scale, the store whose fp32 gradient
            buffers receive the downloads, and the recorder that times host work.
    """

    def __init__(
        self,
        index: int,
        microbatches: list[MicrobatchInputs],
        total_tokens: int,
        flow_plan: FlowPlan,
        eager: bool,
        exchange: Exchange,
        hostq: HostQueue,
        updates: OptimizerSteps,
    ):
        self.index = index
        self.microbatches = microbatches
        self.flow_plan = flow_plan
        # Devices keep their stages' weights resident between tasks (every policy but roundpipe).
        self.weight_bound = flow_plan.table.weight_bound
        self.eager = eager
        self.exchange = exchange
        self.grad_seed = updates.loss_scale() / total_tokens
        # The batch's router statistics when the model adds a router load-balancing loss.
        self.router: RouterTotals | None = None
        # Data-parallel: the reduction each final step group is handed to (it issues the
        # collectives and, when eager, steps); None: a single process, or an accumulate=True call.
        self.reduction = None
        self.loss_sum = 0.0
        self.nonfinite: list[NonFinite] = []  # every non-finite value the tasks' checks found
        self._hostq, self._updates = hostq, updates
        # Which compute copy the uploads read (async mode: the one the update two calls back wrote).
        self.read_buffer = 0
        self.issue = CallIssue(len(flow_plan.flows))
        # Overlapped calls (``RunConfig.overlap_calls``, set by the Pipeline): the update that writes
        # ``read_buffer`` has ended; the call before has been issued (its update is queued ahead of
        # this call's additions); the host job after every job of this call (``Pipeline``).
        self.weights_ready: threading.Event | None = None
        self.after_previous: threading.Event | None = None
        self.settled: threading.Event | None = None
        num_layers = flow_plan.num_layers
        self._loss_tasks = sum(
            1 for row in flow_plan.flows for f in row if f.layers_bwd and f.layers_bwd.stop == num_layers
        )
        self._losses: list[threading.Event] = []
        store = updates.store
        # How many gradient contributions each trainable entry gets this call (one per backward stage
        # that uses it, per microbatch); a step group is final when all of its entries reach zero.
        self.remaining: dict[int, int] = {}
        bwd = flow_plan.table.backward
        for s in range(bwd.num_stages):
            for k in store.trainable_keys(bwd.layers(s)):
                self.remaining[k] = self.remaining.get(k, 0) + flow_plan.table.num_microbatches
        self.group_left = {
            owner: sum(1 for k in keys if self.remaining.get(k, 0) > 0)
            for owner, keys in updates.groups().items()
        }

    def router_totals(self) -> RouterTotals:
        """``router``, read where router statistics came back (so the model has routers)."""
        if self.router is None:
            raise TypeError("router statistics without a router load-balancing loss")
        return self.router

    def router_loss(self) -> float:
        """The batch's ``coef * aux`` (0.0 without a router load-balancing loss), as HF adds it."""
        return self.router.value() if self.router is not None else 0.0

    def on_loss(self, host_loss: Slot, event) -> None:
        """Worker thread: queue adding a microbatch's loss sum (downloaded with ``event``)."""
        self._losses.append(self._hostq.submit(lambda: self._add_loss(host_loss), event, touches=()))

    def loss_ready(self) -> bool:
        """Every microbatch's loss has been added into ``loss_sum`` (caller's thread)."""
        return len(self._losses) == self._loss_tasks and all(e.is_set() for e in self._losses)

    def complete(self) -> bool:
        """The call's device work and host jobs are done (an overlapped call: ``settled`` queued)."""
        return (
            self.issue.done.is_set()
            and self.settled is not None
            and self.settled.is_set()
            and all(ev.query() for ev in self.issue.final_events)
        )

    def _add_loss(self, host_loss: Slot) -> None:
        self.loss_sum += host_float(host_loss.value)
        self._updates.store.host.pool.release(host_loss.value)  # the host thread was its last reader

    def on_checks(self, checks: TaskChecks, host_flags: Slot, event) -> None:
        """Worker thread: queue reading a task's finiteness flags (downloaded with ``event``; the
        compute fills ``checks`` when it runs, which may be after this call)."""
        self._hostq.submit(lambda: self._read_checks(checks, host_flags), event, touches=())

    def _read_checks(self, checks: TaskChecks, host_flags: Slot) -> None:
        flags, host_flags.value = host_flags.value, None
        if flags is None:  # the task checked nothing (no float output, no gradient)
            return
        self.nonfinite += checks.found(flags, self._updates.names)
        self._updates.store.host.pool.release(flags)  # the host thread was its last reader

    def on_grads(self, layers: range, host_grads: Slot, contributions: int, event):
        """Worker thread: queue adding a backward stage's weight gradients, summed over
        ``contributions`` microbatches on the device, into the fp32 buffers; returns what is set
        once the host has done so (and given the download buffers back)."""
        store = self._updates.store
        if self.after_previous is not None:  # queued behind the update of the call before
            wait_unless_aborted(self.after_previous, self.exchange.is_aborted, "the previous call's issue")
        touches = [grads_of(store.entries[k].owner) for k in store.trainable_keys(layers)]
        return self._hostq.submit(
            lambda: self._accumulate(layers, host_grads, contributions), event, touches=touches
        )

    def _accumulate(self, layers: range, host_grads: Slot, contributions: int) -> None:
        """Host thread: add gradients into the fp32 buffers; step groups that became final.

        ``host_grads.value`` is keyed by piece ``(entry key, rows)``: a gradient of rows
        ``[start, stop)`` only (a chunk of the download, or a vocabulary shard's) goes into those
        rows of the whole buffer.
        """
        updates = self._updates
        with updates.recorder.host_span(f"acc:{updates.names[layers.start]}", "accumulate"):
            store = updates.store
            pieces: dict[int, list] = {}
            for (k, rows), g in (host_grads.value or {}).items():
                pieces.setdefault(k, []).append((rows, g))
            for k, got in pieces.items():
                store.entries[k].add_grads(got)  # autograd made one for it (a piece is absent otherwise)
                for _, g in got:
                    store.host.pool.release(g)  # added: the download buffer is free again
            for k in store.trainable_keys(layers):
                self.remaining[k] -= contributions
                if self.remaining[k] == 0:
                    owner = store.entries[k].owner
                    self.group_left[owner] -= 1
                    # Nothing is stepped once a non-finite value is known: not the layer it is in,
                    # and with "skip", whose updates are deferred, nothing at all.
                    if self.group_left[owner] == 0 and self.reduction is not None:
                        self.reduction.final(owner)
                    elif self.group_left[owner] == 0 and self.eager and not self.nonfinite:
                        updates.step_group(owner)
