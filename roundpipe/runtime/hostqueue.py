"""The host (optimizer) thread: runs CPU-side jobs after the device work they depend on.

Jobs are ``(event, fn)``: wait for the event (a download of gradients, say), then run ``fn``
(accumulate into fp32 buffers, step a layer). One thread, FIFO, so accumulation and steps of a layer
happen in issue order. The first error is kept and re-raised by ``drain``; later jobs are skipped.

The jobs (fused AdamW, gradient accumulation, the refresh of the compute copies, the finiteness
checks and the gradient norm) are the CPU's share of training, so the thread runs them with
``threads`` intra-op threads (``RunConfig.host_threads``; default ``default_host_threads``): the
cores the workers do not need, where a single one would leave the others idle while the GPUs wait
for their next weights.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

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


class HostQueue:
    def __init__(
        self,
        name: str = "roundpipe-host",
        threads: int = 1,
        context: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.threads = threads
        self._context = context  # what each job runs under (``Backend.host_work``)
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], event: Event | None = None) -> threading.Event:
        """Queue ``fn`` to run once ``event`` has happened; returns what is set once the job is over
        (run, failed, or skipped after an earlier failure): the back-pressure a producer waits on."""
        with self._idle:
            self._pending += 1
        over = threading.Event()
        self._queue.put((event, fn, over))
        return over

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
        self._queue.put((None, _STOP, None))
        self._thread.join()

    def _loop(self) -> None:
        own_intra_op_threads(self.threads)
        while True:
            event, fn, over = self._queue.get()
            if fn is _STOP:
                return
            try:
                if self.error is None:
                    if event is not None:
                        event.synchronize()
                    with self._context():
                        fn()
            except BaseException as e:  # carried to the caller by drain()
                self.error = e
            finally:
                over.set()
                del event, fn, over  # what the job captured (host gradient buffers) goes now
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
