"""The host (optimizer) thread: runs CPU-side jobs after the device work they depend on.

Jobs are ``(event, fn)``: wait for the event (a download of gradients, say), then run ``fn``
(accumulate into fp32 buffers, step a layer). One thread, in submission order, with one exception:
a job may say what it ``touches`` (keys such as a layer group's gradients; None: everything), and a
``background`` job (the async optimizer's per-layer steps of the previous step) is passed by the
next other job when that touches nothing the background jobs before it touch. A worker waits for its
gradient additions (back-pressure), so they must not queue behind a whole model's update; the
other jobs keep their order among themselves. The first error is kept and re-raised by ``drain``; later jobs are skipped.

The jobs (fused AdamW, gradient accumulation, the refresh of the compute copies, the finiteness
checks and the gradient norm) are the CPU's share of training, so the thread runs them with
``threads`` intra-op threads (``RunConfig.host_threads``; default ``default_host_threads``): the
cores the workers do not need, where a single one would leave the others idle while the GPUs wait
for their next weights.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import cast

from roundpipe.backend import Event
from roundpipe.backend.threads import own_intra_op_threads

_STOP = object()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def default_host_threads(workers: int, cores: int | None = None) -> int:
    """Intra-op threads of the host thread when ``host_threads`` is None: the usable cores, shared
    among the ranks torchrun started on this node (``LOCAL_WORLD_SIZE``), less one per worker
    device (each worker's thread issues its device's work on a core of its own), at least 1."""
    cores = usable_cores() if cores is None else cores
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, cores // ranks_here - workers)


@dataclass(eq=False)
class _Job:
    fn: Callable[[], None] | object
    event: Event | None = None
    touches: frozenset | None = None  # None: everything
    background: bool = False
    over: threading.Event = field(default_factory=threading.Event)


def _next_job(jobs: list[_Job]) -> int:
    """Which queued job runs next. Jobs that are not ``background`` keep their order among
    themselves: the first of them runs next if it touches nothing a background job before it
    touches, once its event has happened (a background job runs meanwhile); otherwise the first
    job runs. A job touching everything neither passes nor is passed."""
    held: set = set()  # what the background jobs before it touch
    for i, job in enumerate(jobs):
        if not job.background:
            free = i == 0 or job.touches is not None and held.isdisjoint(job.touches)
            if free and (i == 0 or job.event is None or job.event.query()):
                return i
            return 0
        if job.touches is None:
            return 0
        held.update(job.touches)
    return 0


class HostQueue:
    def __init__(
        self,
        name: str = "roundpipe-host",
        threads: int = 1,
        context: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.threads = threads
        self._context = context  # what each job runs under (``Backend.host_work``)
        self._jobs: list[_Job] = []  # queued, in submission order (guarded by ``_idle``)
        self.error: BaseException | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[[], None],
        event: Event | None = None,
        *,
        touches: Iterable[Hashable] | None = None,
        background: bool = False,
    ) -> threading.Event:
        """Queue ``fn`` to run once ``event`` has happened; returns what is set once the job is over
        (run, failed, or skipped after an earlier failure): the back-pressure a producer waits on.
        ``touches``: what the job reads or writes that another job may too (None: everything);
        ``background``: later jobs that touch none of it may run first (see the module docstring)."""
        job = _Job(fn, event, None if touches is None else frozenset(touches), background)
        with self._idle:
            self._pending += 1
            self._jobs.append(job)
            self._idle.notify_all()
        return job.over

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished (the watchdog reads it as progress)."""
        return self._pending

    def drain(self, is_aborted=lambda: False) -> None:
        """Wait until every submitted job has run; re-raise the first error."""
        with self._idle:
            while self._pending:
                self._idle.wait(0.05)
                if is_aborted() and self.error is not None:
                    break
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        with self._idle:
            self._jobs.append(_Job(_STOP))
            self._idle.notify_all()
        self._thread.join()

    def _take(self) -> _Job:
        with self._idle:
            while not self._jobs:
                self._idle.wait()
            return self._jobs.pop(_next_job(self._jobs))

    def _loop(self) -> None:
        own_intra_op_threads(self.threads)
        while True:
            job = self._take()
            if job.fn is _STOP:
                return
            try:
                if self.error is None:
                    if job.event is not None:
                        job.event.synchronize()
                    with self._context():
                        cast(Callable[[], None], job.fn)()
            except BaseException as e:  # carried to the caller by drain()
                self.error = e
            finally:
                job.over.set()
                job.fn = job.event = None  # what the job captured (host gradient buffers) goes now
                del job
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
