"""One worker per device: walks its task list and issues uploads, compute and downloads.

The worker thread only *issues* work: closures on the device's streams, ordered by events
(docs/design.md §4). It is built from a ``WorkerSetup`` (``worker_setup.py``), not the Pipeline,
and gives each job to the part that holds its state:

- ``WeightResidency`` (``residency.py``): the layers' weights on the device (current stage plus,
  with prefetch, the next one);
- ``MicrobatchContext`` (``microbatch_context.py``): the microbatch's inputs and layer context;
- ``transfers.upload`` and ``TaskOutputs`` (``transfers.py``): incoming hand-offs, and each task's
  outputs downloaded into the exchange;
- ``TaskCompute`` (``compute.py``): the forward, and the backward that recomputes from the saved
  input, on bound module shells (``shells.py``);
- ``GradientAccumulators`` (``gradients.py``): the stage's weight gradients, summed on the
  device and downloaded once per stage.

Weights up and gradients down are bulk copies: after each task's own copies the worker issues that
task's share of their chunks (``paced_copies.py``), since a copy engine runs copies in issue order.

CUDA's rules (docs/design.md §5) shape every closure: a tensor made on one stream and used on
another is handed over to it (``Device.hand_over``); whatever a closure leaves on the device is
reserved in the device's ledger and released, in stream order, after its last use; module shells
are unbound after each compute so they keep no weights alive; and the worker waits on the host for
the compute ``ISSUE_AHEAD`` tasks back before it issues another task, so that on CUDA, where a
closure runs at issue time, the memory allocated ahead of the GPU stays bounded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roundpipe.backend import Device, Event
from roundpipe.backend.base import TaskWork
from roundpipe.runtime.call_issue import wait_unless_aborted
from roundpipe.runtime.compute import TaskCompute, TaskSlots
from roundpipe.runtime.exchange import Slot
from roundpipe.runtime.gradients import GradientAccumulators
from roundpipe.runtime.microbatch_context import MicrobatchContext
from roundpipe.runtime.numerics import TaskChecks
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.residency import WeightResidency
from roundpipe.runtime.router_totals import router_layers, router_pairs
from roundpipe.runtime.shells import LayerShells
from roundpipe.runtime.transfers import TaskOutputs, free_uploads, upload
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.schedule import TaskKind
from roundpipe.schedule.flow import FUSED

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun

# How many tasks back the compute must have finished before a worker issues the next task. The
# streams already keep two tasks in flight; one more issued ahead lets a consumer on another device
# find its hand-offs issued in time (with 2 the cpu:2 scaling benchmark lost ~10%).
ISSUE_AHEAD = 3


class Worker:
    """Issues one device's tasks, step after step (``run`` on the worker thread). ``status`` says
    what it is doing or waiting for (the watchdog's report)."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.weights = WeightResidency(setup, device)
        self.shells = LayerShells(setup.adapter, setup.store)
        self.context = MicrobatchContext(setup, device)
        self.outputs = TaskOutputs(setup, device)
        self.grads = GradientAccumulators(setup, device)
        self.compute = TaskCompute(setup, device, self.shells)
        self._slots: list[Slot] = []  # what the current step's tasks fill (emptied by reset)
        # per task that read hand-offs, in issue order: its compute event and its uploads (slot, what)
        self._uploads: list[tuple[Event, list[tuple[Slot, str]]]] = []
        self.status = "idle"
        self.tasks_done = 0
        self._computed: list = []  # compute-done event of each issued task, in issue order
        # the call started after the one this worker issues (``follow``)
        self._following: tuple[StepRun, list[TaskFlow]] | None = None
        # (the list progress() last read, how many of its events had happened): one compute
        # stream, so they happen in issue order; written by the watchdog's thread only.
        self._seen: tuple[list, int] = (self._computed, 0)

    def progress(self) -> int:
        """Tasks whose compute the device has finished (the watchdog's measure of GPU progress).
        Queries from the first event not yet seen to happen: the watchdog polls every few
        milliseconds, so querying every event of the step each time would cost the host time
        quadratic in the step's tasks."""
        computed = self._computed  # the step's list (a new step starts a new one)
        seen, done = self._seen
        if seen is not computed:
            done = 0
        while done < len(computed) and computed[done].query():
            done += 1
        self._seen = (computed, done)
        return done

    def reset(self) -> None:
        """Forget all device state after a failed step (the backend has been drained and reset).

        Every slot the step's tasks filled is emptied as well: the error's traceback keeps the
        failed closures' frames, and through them what the closures captured, for as long as the
        caller keeps the error; emptied slots hold no device tensor.
        """
        self.weights.reset()
        for slot in self._slots:
            slot.value = None
        self._slots, self._uploads = [], []
        self.context.reset()
        self.grads.reset()
        # the failed call's compute events, some carrying its error: with overlapped calls the next
        # call's issue bound would wait on them (``run`` keeps the last ISSUE_AHEAD) and re-raise it
        # (``progress`` starts counting afresh on a new list)
        self._computed = []
        self._following = None
        self.status = "idle"

    def release_all(self) -> None:
        """End of a step: release every weight (the next call's first, uploaded during the last
        stage, stay for it: ``WeightResidency.end_call``), the microbatch context and the context
        module, so the device holds nothing until the next step (stateless workers)."""
        self.weights.end_call()
        self.context.release()

    def follow(self, step: StepRun, flows: list[TaskFlow]) -> None:
        """``step`` has been started after the call this worker may still be issuing (caller's
        thread, ``Executor.start``): that call's last stage may upload its first weights."""
        self._following = (step, flows)

    def _say(self, status: str) -> None:
        self.status = status

    # ----------------------------------------------------------------- tasks
    def run(self, step: StepRun, flows: list[TaskFlow]) -> None:
        """Issue every task of this device for one step (worker thread).

        ``order="strict"`` issues the table's order; ``order="ready"`` issues the first task in
        table order whose incoming hand-offs have all been issued by their producers (the table is
        a hint, readiness decides), so an order that would deadlock strictly still completes.
        """
        overlap = self.setup.config.overlap_calls
        if step.weights_ready is not None:
            self.status = "waiting for the update that writes this call's weights"
            wait_unless_aborted(step.weights_ready, step.exchange.is_aborted, "the previous update")
        remaining = list(flows)
        self._slots = []
        # overlapped: the issue-ahead bound counts the earlier call's last tasks too
        self._computed = self._computed[-ISSUE_AHEAD:] if overlap else []
        self.weights.read = step.read_buffer
        self.context.start()
        self.outputs.start()
        self.grads.start()
        ready = self.setup.config.order == "ready"
        while remaining:
            flow = remaining.pop(self._pick_ready(step, remaining) if ready else 0)
            upcoming, across = None, None
            if self.setup.config.prefetch:
                upcoming = next((f.layers for f in remaining if f.layers and f.layers != flow.layers), None)
                if upcoming is None:  # the call's last stage on this device
                    across = self._next_call_layers(step, flow)
            self._issue(step, flow, upcoming, remaining, across)
            self.tasks_done += 1
        self.grads.flush(step)
        self._free_uploads(keep=0)
        self.outputs.drop(keep=0)
        if overlap:  # every host job of the call is queued now; the next call frees what drains
            self.grads.carry()
        else:
            self.grads.drop(keep=0)
        self.release_all()
        self.status = "done"

    def end_of_calls(self) -> None:
        """No call follows (``Executor.settle``, after this worker's thread has ended): free the
        gradient accumulators the last overlapped call left draining, after their downloads, and
        any weights kept for a call that did not run."""
        self.grads.drop(keep=0, host_waits=False)
        self._following = None
        self.weights.release_all()

    def _next_call_layers(self, step: StepRun, flow: TaskFlow) -> tuple[range, int] | None:
        """The layers of the next call's first task and the compute copy they are read from, when
        the tasks of ``step``'s last stage on this device (``flow`` and those left) may upload them
        while they compute, as they would the next stage's within a call: that call has been
        started, its weights are written, and what they add fits the room the plan leaves on this
        device (a layer this stage holds is uploaded again when the next call reads another copy:
        both versions are on the device)."""
        following = self._following
        if following is None or following[0] is step:
            return None
        nxt, flows = following
        if nxt.weights_ready is not None and not nxt.weights_ready.is_set():
            return None
        first = next((f.layers for f in flows if f.layers), None)
        if first is None:
            return None
        same = nxt.read_buffer == step.read_buffer
        layer_bytes = self.setup.store.layer_bytes
        extra = sum(layer_bytes[i] for i in first if not (same and i in flow.layers))
        return (first, nxt.read_buffer) if self._has_room(step, extra) else None

    def _has_room(self, step: StepRun, nbytes: int) -> bool:
        """Whether ``nbytes`` fit beside the plan's peak on this device, with the estimate's error
        (``FlowPlan.room``)."""
        room = step.flow_plan.room
        if room is None:
            return False
        mine = room[self.device.index]
        return mine is None or nbytes <= mine

    def _pick_ready(self, step: StepRun, remaining: list[TaskFlow]) -> int:
        while True:
            for n, f in enumerate(remaining):
                if all(step.exchange.has(k) for k in f.consumes) and self._totals_ready(step, f):
                    return n
            self.status = "ready order: no task ready; waiting for " + ", ".join(
                f"{f.task}" for f in remaining[:4]
            )
            step.exchange.wait_for_change()

    def _totals_ready(self, step: StepRun, flow: TaskFlow) -> bool:
        """A backward over router layers is ready once every other op's statistics are put."""
        if step.router is None or not router_layers(self.setup.adapter, flow.layers_bwd):
            return True
        return step.router.ready(set(router_pairs(self.setup.adapter, flow)))

    def _wait_for_the_device(self, label: str) -> None:
        """Block the host until the compute ``ISSUE_AHEAD`` tasks back has finished.

        On CUDA a closure runs when it is issued, so what it allocates is allocated then: without
        this wait a worker could issue, and allocate for, any number of tasks ahead of the GPU.
        """
        if len(self._computed) >= ISSUE_AHEAD:
            self.status = f"{label}: waiting for the device to finish task -{ISSUE_AHEAD}"
            self._computed[-ISSUE_AHEAD].synchronize()

    def _issue(
        self,
        step: StepRun,
        flow: TaskFlow,
        upcoming: range | None,
        remaining: list[TaskFlow],
        across: tuple[range, int] | None = None,
    ) -> None:
        streams = self.streams
        t, mb = flow.task, flow.task.microbatch
        label = f"{t}" + (f"+{flow.fused_with}" if flow.fused_with else "")
        self.status = f"{label}: preparing"
        needs_grad = len(flow.layers_bwd) > 0 and self._backward_needed(flow)
        layers_all = flow.layers
        if len(layers_all) == 0 or (flow.task.kind == TaskKind.B and not needs_grad):
            self._issue_empty(step, flow)
            return
        self._wait_for_the_device(label)
        # The tasks of an overlapped call before its first backward: the last call's gradients are
        # freed once their download has ended, when the plan leaves room for them beside the
        # tasks; else after the first task's weights are allocated, or before when the device has
        # no room for those either (compute then waits for the download).
        carried = self.grads.carried
        if carried and self._has_room(step, self.grads.draining_bytes()):
            self.grads.drop_downloaded()
            carried = False
        if carried and not self._fits_beside_draining(layers_all):
            self.grads.drop(keep=0, host_waits=False)
        residents = self.weights.ensure(layers_all, upcoming, remaining, step.weight_bound)
        if carried:
            self.grads.drop(keep=0, host_waits=False)

        # At most two tasks in flight per device on the streams too: this compute starts once the
        # downloads two tasks back are done, and frees those outputs first (so the device holds the
        # outputs of two tasks at most). Its hand-offs are allocated on h2d, in blocks the task two
        # back has finished with, so they go up while the task before computes; the microbatch's
        # inputs are allocated on compute after them (h2d then waits for compute to get there).
        self.outputs.drop(keep=1)
        self._free_uploads(keep=1)
        incoming = self._issue_incoming(step, flow, label)
        inputs, ctx = self.context.get(step, mb)
        streams["compute"].wait_event(streams["h2d"].record_event())
        for r in residents:
            streams["compute"].wait_event(r.copied)
        if upcoming is not None:
            self.weights.prefetch(upcoming)
        if across is not None:
            self.weights.prefetch_next_call(*across)

        produced = {key: Slot() for key in flow.produces}
        param_grads = self.grads.open(step, flow, self._say) if flow.layers_bwd else Slot()
        slots = TaskSlots(incoming, produced, param_grads, TaskChecks(mb, self.device.name))
        self._slots += slots.all()
        self._slots += [r.slot for r in residents]
        self.status = f"{label}: issued"

        def compute():
            self.compute.run(step, flow, residents, inputs.value, ctx.value, slots, self._say)

        kind = FUSED if flow.fused_with else t.kind
        rows, seq_len = step.microbatches[mb].input_ids.shape
        streams["compute"].submit(compute, (label, kind), work=TaskWork(flow, rows, seq_len))
        computed = streams["compute"].record_event()
        self._computed.append(computed)
        if incoming:
            self._uploads.append((computed, [(s, _booked(key)) for key, s in incoming.items()]))
        streams["d2h"].wait_event(computed)
        self.outputs.download(step, flow, label, slots)
        if flow.layers_bwd:
            self.grads.issued(step, flow, remaining)
        # The bulk copies' share of this task goes after its urgent ones (paced_copies.py).
        self.weights.pace(remaining)
        self.grads.pace(remaining)

    def _fits_beside_draining(self, layers: range) -> bool:
        """Whether the device has room for ``layers``' weights beside the gradient accumulators the
        last call left draining (the allocator's free bytes now, on the host: no sync). If not,
        they are freed first, after their downloads, as at the end of a drained call."""
        free = self.device.free_bytes()
        need = sum(self.setup.store.layer_bytes[i] for i in layers if i not in self.weights.layers)
        return free is None or need <= free

    def _free_uploads(self, keep: int) -> None:
        """Free the hand-offs uploaded for all but the last ``keep`` tasks that read any, on ``h2d``
        after their computes (``transfers.free_uploads``). Before a task's uploads with ``keep=1``:
        the blocks of the tasks two back go to its hand-offs, whose copies then wait for those
        computes only, so they go up while the task before computes, and the device holds one task's
        hand-offs beside the running task's (``partition.memory.HELD_HAND_OFFS``)."""
        while len(self._uploads) > keep:
            read, uploads = self._uploads.pop(0)
            free_uploads(self.device, uploads, read, "activations")

    def _issue_incoming(self, step: StepRun, flow: TaskFlow, label: str) -> dict[tuple, Slot]:
        """Upload the task's incoming hand-offs (activation and/or gradient), in that order, into
        memory ``h2d`` allocates, each reserved until ``_free_uploads`` frees it (``transfers.upload``)."""
        h2d = self.streams["h2d"]
        incoming: dict[tuple, Slot] = {}
        for key in flow.consumes:
            self.status = f"{label}: waiting for {key[0]}[{key[1]}] of microbatch {key[2]}"
            host_slot, event = step.exchange.get(key)
            what = _booked(key)
            incoming[key] = upload(
                self.device,
                [host_slot.value],
                what,
                "activations",
                after=event,
                label=(what, "upload"),
                task=(step.index, label, key[2]),
                single=True,
                on_h2d=True,
            )
            host_slot.take(after=h2d.record_event())  # the copy's end frees the host buffer
        return incoming

    def _issue_empty(self, step: StepRun, flow: TaskFlow) -> None:
        """A task with nothing to compute (a forward whose outputs nobody needs, a backward the flow
        left empty): take its hand-offs so they are freed, and account a backward. A hand-off's host
        buffer goes back to the pool with an event after the download that fills it (the h2d stream
        waits for it): on CUDA the download may still be writing it when this is issued."""
        h2d = self.streams["h2d"]
        for key in flow.consumes:
            host_slot, event = step.exchange.get(key)
            if event is not None:
                h2d.wait_event(event)
            host_slot.take(after=h2d.record_event())
        if flow.task.kind == TaskKind.B:
            step.on_grads(flow.layers_bwd, Slot(), 1, None)

    def _backward_needed(self, flow: TaskFlow) -> bool:
        r = flow.layers_bwd
        return bool(flow.produces) or bool(self.setup.store.trainable_keys(r)) or flow.fused_with is not None


def _booked(key: tuple) -> str:
    """How the memory ledger books hand-off ``key`` (kind, layer, microbatch) on the device."""
    return f"{key[0]}[{key[1]}].{key[2]}"
