"""How far the workers have issued one ``forward_backward`` call, and what waits for that.

With ``RunConfig(overlap_calls=True)`` a call returns while its workers may still be issuing its
backward, so whatever must come after *every* host job of the call (they are queued as the workers
issue, ``step.py``) waits here: the job that reads the call's finiteness flags into the optimizer,
the async update ``step()`` asked for, a learning-rate change. The last worker to finish issuing
runs them, in the order they were asked for, on its thread. The next call's gradient additions
wait for this too, so that they are queued behind that update (the host thread's ``touches``
order, ``hostqueue.py``). ``final_events`` are each device's stream events recorded after the
call's last closure: the call's device work is done when they have happened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from roundpipe.runtime.exchange import AbortedWait


class CallIssue:
    def __init__(self, workers: int):
        self.done = threading.Event()
        self.final_events: list = []
        self._left = workers
        self._after: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def after(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once every worker has issued the call: now if they have (caller's thread)."""
        with self._lock:
            if self._left:
                self._after.append(fn)
                return
        fn()

    def worker_done(self, events: list) -> None:
        """A worker has issued its last closure of the call (``events``: one per stream after it)."""
        with self._lock:
            self.final_events += events
            self._left -= 1
            if self._left:
                return
            after, self._after = self._after, []
            for fn in after:  # under the lock: a later ``after`` waits, so the order is kept
                fn()
        self.done.set()


def wait_unless_aborted(event: threading.Event, is_aborted: Callable[[], bool], what: str) -> None:
    """Block until ``event`` is set; raise ``AbortedWait`` if the pipeline aborts meanwhile."""
    while not event.wait(0.05):
        if is_aborted():
            raise AbortedWait(f"abandoned waiting for {what}")
