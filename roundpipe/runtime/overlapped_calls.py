"""Consecutive ``forward_backward`` calls overlapped (``RunConfig(overlap_calls=True)``).

The RoundPipe paper's steps overlap: with the async optimizer a step reads weights one update old,
so nothing it uploads waits for the step before, and a device goes on to the next step's first
stage while the others still run the last one's backward. Drained calls lose that: each call's
pipeline fills at its start and drains at its end (the simulator's one call on its own against its
steady period, ``benchmarks/virtual_server.py``).

Here a call starts its workers behind the call in flight (``Executor.start``: each device's worker
thread issues after the earlier call's on that device, on the same streams) and returns once its
loss is on the host and the call before it has completed. What must come after every host job of
a call waits for the call to be issued (``CallIssue``): the job that reads its finiteness flags
into the optimizer (``settled``, after which the call counts as complete), the async update of
``step()``, a learning-rate change. The next call's gradient additions are queued behind that
update, and its uploads wait for the update that wrote the compute copy they read. A call's last
stage uploads the next call's first weights, and its last gradient accumulators stay on the device
into the next call (``GradientAccumulators.carry``), where the plan leaves room (``Worker``).

An error of a call that has returned is raised by the next call that waits: the next
``forward_backward``, or any other call of the pipeline, which completes every call in flight first
(``settle``). A non-finite value under ``nan_policy="stop"`` too (its step's update is dropped as
under "skip").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from roundpipe.errors import add_note
from roundpipe.runtime.executor import Executor
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.runtime.numerics import first_nonfinite, nonfinite_error
from roundpipe.runtime.optimizer_steps import OptimizerSteps
from roundpipe.runtime.step import StepRun


class OverlappedCalls:
    def __init__(self, executor: Executor, hostq: HostQueue, updates: OptimizerSteps, enabled: bool):
        self.executor, self.hostq, self.updates, self.enabled = executor, hostq, updates, enabled
        self.in_flight: StepRun | None = None  # the last call started, until it is found complete
        self._written: dict[int, threading.Event] = {}  # compute copy -> its update has ended

    def run(self, step: StepRun) -> None:
        """Start ``step`` behind the call in flight; return once that call has completed (its
        errors and non-finite values raised) and ``step``'s loss is on the host."""
        previous, self.in_flight = self.in_flight, step
        step.after_previous = previous.issue.done if previous is not None else None
        step.weights_ready = self._written.get(step.read_buffer % 2)
        step.issue.after(lambda: self._settle_after(step))
        try:
            self.executor.start(step)
            self.executor.wait(lambda: (previous is None or previous.complete()) and step.loss_ready())
        except BaseException as e:
            self.in_flight = None
            _name_the_call(e, previous)
            raise
        if previous is not None:
            self._check(previous)

    def settle(self) -> None:
        """Complete every call in flight (caller's thread); raise what it raised."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return
        try:
            self.executor.settle()
        except BaseException as e:
            _name_the_call(e, step)
            raise
        self._check(step)

    def after_issue(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (it queues host jobs) once the call in flight has queued all of its own."""
        if self.in_flight is None:
            fn()
        else:
            self.in_flight.issue.after(fn)

    def queue_update(self, publish_to: int) -> None:
        """``step()`` in async mode: the update of the gradients so far, behind the call in flight,
        writing compute copy ``publish_to`` (the one the call after next reads)."""
        written = threading.Event()
        self._written[publish_to % 2] = written
        self.after_issue(lambda: self.updates.queue_update(self.hostq, publish_to, written))

    def _settle_after(self, step: StepRun) -> None:
        """The job after every job of ``step`` (worker thread, once it is issued): its finiteness
        flags decide the update ``step()`` queues behind it (the first call of the step decides)."""

        # Queued after every job of ``step``, its finiteness checks included, each after its task's
        # compute: the update behind it writes the copy ``step`` read once no upload reads it.
        def settle() -> None:
            found = first_nonfinite(step.nonfinite)
            if found is not None and self.updates.nonfinite is None:
                self.updates.nonfinite = found

        step.settled = self.hostq.submit(settle, touches=())

    def _check(self, step: StepRun) -> None:
        """Raise a non-finite value of a completed call that stops the run."""
        found = first_nonfinite(step.nonfinite)
        if found is not None and self.updates.stops_on(found):
            self.settle()  # nothing left running when the caller gets the error
            err = nonfinite_error(found, step.index, len(step.nonfinite))
            add_note(err, _EARLIER.format(index=step.index))
            raise err


def _name_the_call(error: BaseException, earlier: StepRun | None) -> None:
    """Note on ``error``, when it is of ``earlier`` (a call that has returned), which call it is."""
    if earlier is not None and getattr(error, "step", None) == earlier.index:
        add_note(error, _EARLIER.format(index=earlier.index))


_EARLIER = (
    "this is of an earlier call (forward_backward {index}), which had already returned its loss "
    "(overlap_calls): its update is not applied; abandon_step() drops what its step left"
)
