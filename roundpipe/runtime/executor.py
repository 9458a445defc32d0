"""Running one step over the worker threads: start them, watch them, finish or recover.

``Executor.run`` is called on the caller's thread. It starts one thread per worker (each issues its
device's tasks, see ``worker.py``), then polls: once every worker has issued everything it records a
final event on every stream and waits for those and for the host queue. Progress is the tasks the
workers have issued, the stream work the backend has completed and the host jobs still pending; no
change in any of them for ``watchdog_s`` seconds is a stall, reported as ``WatchdogTimeout`` with
what every worker and stream is doing.

On any error it aborts the backend (every wait is cut short), joins the threads, drains the host
queue, resets the backend, the workers and the memory ledgers, and raises the root error: the
pipeline is reusable and nothing is left running.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from roundpipe.backend import Backend, MemoryLedger
from roundpipe.backend.cpu import Aborted
from roundpipe.backend.threads import own_intra_op_threads
from roundpipe.errors import PipelineStateError, RoundpipeError, StageError, WatchdogTimeout, add_note
from roundpipe.runtime.exchange import AbortedWait
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.runtime.step import StepRun
from roundpipe.runtime.worker import Worker


class Executor:
    """Runs steps on ``workers`` (one per device of ``backend``) with the host thread ``hostq``."""

    def __init__(
        self,
        backend: Backend,
        workers: list[Worker],
        hostq: HostQueue,
        host_memory: MemoryLedger,
        watchdog_s: float,
    ):
        self.backend = backend
        self.workers = workers
        self.hostq = hostq
        self.host_memory = host_memory
        self.watchdog_s = watchdog_s
        self.broken: str | None = None  # why no further step can run (see _recover)
        self._threads: dict[int, threading.Thread] = {}  # each device's latest worker thread
        self._errors: list[BaseException] = []  # what the worker threads raised

    def run(self, step: StepRun) -> None:
        """Run ``step`` to completion: every stream and host job done, or raise its root error."""
        self.start(step)
        self.settle()

    def start(self, step: StepRun) -> None:
        """Start issuing ``step`` on every worker, each behind its device's earlier call (if one
        is still being issued: ``RunConfig.overlap_calls``). Returns at once."""
        if self.broken is not None:
            raise PipelineStateError(
                f"this pipeline cannot run another step: {self.broken}. Save its state (state_dict, "
                "export_to), close it and wrap the model again"
            )
        errors = self._errors

        def worker_main(worker: Worker, flows, before: threading.Thread | None) -> None:
            try:
                own_intra_op_threads(1)  # a worker issues; its core is not the host thread's
                if before is not None:  # the device's earlier call: its worker issues first
                    before.join()
                    if self.backend.aborted:
                        return
                worker.run(step, flows)
                step.issue.worker_done([s.record_event() for s in worker.device.streams.values()])
            except BaseException as e:  # carried to the caller below
                errors.append(e)
                self.backend.abort()

        for i, w in enumerate(self.workers):
            w.follow(step, step.flow_plan.flows[i])
            t = threading.Thread(
                target=worker_main,
                args=(w, step.flow_plan.flows[i], self._threads.get(i)),
                name=f"roundpipe-worker-{i}",
                daemon=True,
            )
            self._threads[i] = t
            t.start()

    def wait(self, done: Callable[[], bool]) -> None:
        """Block the caller until ``done()`` (polled), watching the workers; on an error or a stall,
        recover (every call in flight is abandoned) and raise the root error."""
        timed_out = self._watch(done)
        if timed_out is None and not self._failed():
            return
        self._fail(timed_out)

    def settle(self) -> None:
        """Wait until every call started has completed, then check the devices are empty (the
        workers are stateless) and drain the host thread."""
        self.wait(lambda: not any(t.is_alive() for t in self._threads.values()))
        for w in self.workers:  # the workers' threads have ended: issued here, after all of theirs
            w.end_of_calls()
        final_events = [s.record_event() for d in self.backend.devices for s in d.streams.values()]
        self.wait(lambda: all(ev.query() for ev in final_events))
        try:
            for ev in final_events:
                ev.synchronize()
            self.backend.synchronized()
            self.hostq.drain()
            self.backend.check_empty()  # stateless workers: nothing stays on a device
            self.backend.step_completed()
        except BaseException as e:
            self._errors.append(e)
            self._fail(None)
        self._threads = {}

    def _failed(self) -> bool:
        return bool(self._errors or self.backend.errors or self.hostq.error is not None)

    def _fail(self, timed_out: WatchdogTimeout | None) -> NoReturn:
        threads, self._threads = list(self._threads.values()), {}
        errors, self._errors = list(self._errors), []
        late = self._recover(threads)
        for err in late + errors:
            _drop_frames(err)
        root = _root_error(timed_out, late + errors)
        if self.broken is not None:
            add_note(
                root,
                f"this pipeline cannot run another step: {self.broken}. The last completed step's "
                "weights and optimizer state are on the host: save them (state_dict, export_to), "
                "close the pipeline and wrap the model again, or restart the process",
            )
        raise root

    def _watch(self, done: Callable[[], bool]) -> WatchdogTimeout | None:
        """Poll until ``done()``, an error is reported, or nothing progresses for too long."""
        last_progress, last_change = None, time.monotonic()
        while True:
            if self._failed():
                return None
            if done():
                return None
            # Progress the devices report through events, not what the hosts have issued: on CUDA a
            # worker may finish issuing long before its GPU finishes the work.
            progress = (
                sum(w.tasks_done for w in self.workers),
                sum(w.progress() for w in self.workers),
                self.hostq.pending,
            )
            now = time.monotonic()
            if progress != last_progress:
                last_progress, last_change = progress, now
            elif now - last_change > self.watchdog_s:
                return WatchdogTimeout(
                    f"no progress for {self.watchdog_s:.0f}s; "
                    + "; ".join(
                        f"{w.device.name}: worker {w.status} ["
                        + "; ".join(st.describe() for st in w.device.streams.values())
                        + "]"
                        for w in self.workers
                    )
                )
            time.sleep(0.002)

    def _recover(self, threads) -> list[BaseException]:
        """After a failure: stop every wait, let threads end, and leave the pipeline reusable.
        Returns the errors the streams and the host thread reported meanwhile.

        Work already running cannot be stopped (a closure on the cpu backend, a kernel on a GPU):
        if some is still running ``recovery_grace(watchdog_s)`` after the abort (a stalled worker), the pipeline
        is marked ``broken`` and the caller gets the error then instead of waiting on it."""
        self.backend.abort()
        grace = recovery_grace(self.watchdog_s)
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        quiet = [s.record_event() for d in self.backend.devices for s in d.streams.values()]
        while not all(ev.query() for ev in quiet) or any(t.is_alive() for t in threads):
            if time.monotonic() > deadline:
                stuck = "; ".join(
                    f"{d.name}: " + ", ".join(st.describe() for st in d.streams.values())
                    for d in self.backend.devices
                )
                self.broken = (
                    f"work of a failed step is still running {grace:.0f}s after it was aborted ({stuck})"
                )
                return list(self.backend.errors)
            time.sleep(0.005)
        late: list[BaseException] = []
        try:
            self.hostq.drain(is_aborted=lambda: True)
        except BaseException as e:
            late.append(e)
        late = list(self.backend.errors) + late
        try:
            self.backend.reset()
        except BaseException as e:  # a sticky device error: the device itself is unusable now
            self.broken = f"the device cannot be reset ({type(e).__name__}: {e})"
        for w in self.workers:
            w.reset()
            w.device.ledger.clear()
        self.host_memory.clear()
        return late


def recovery_grace(watchdog_s: float) -> float:
    """Seconds a failed step's running work has to end after the abort (a stall the watchdog
    caught may still end by itself) before the pipeline is declared broken."""
    return max(5.0, 2.0 * watchdog_s)


def _drop_frames(error: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``error``'s tracebacks (its causes'
    too): they hold the failed step's device tensors, which would stay allocated on the GPU for as
    long as the caller keeps the exception. The tracebacks keep every line."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _root_error(timed_out: WatchdogTimeout | None, candidates: list[BaseException]) -> BaseException:
    """The error to raise: a timeout, else the first one that is not a side effect of aborting."""
    if timed_out is not None:
        return timed_out
    for e in candidates:
        if not isinstance(e, (Aborted, AbortedWait)):
            if isinstance(e, RoundpipeError):
                return e
            wrapped = StageError(f"{type(e).__name__}: {e}")
            wrapped.__cause__ = e  # the traceback says where it happened
            return wrapped
    return candidates[0] if candidates else StageError("the step failed for an unknown reason")
