"""The issue token: one thread at a time issues a closure's operations.

Every worker issues its device's work from Python, and all of them share one interpreter lock.
PyTorch lets go of that lock around each operation it dispatches, so with several workers issuing
at once the lock changes hands at nearly every operation: each hand-over wakes a waiting thread,
which mostly finds the lock taken again and goes back to sleep. On the virtual 8x RTX 4090 server
that churn cost more than the issue itself (Qwen3-1.7B: about 100 ms of host CPU per task, half of it
in the kernel's task switching, against 34 ms with the token). With the token, the workers take
turns a closure at a time: one issues, the others sleep on the token and are not woken by the
interpreter lock's hand-overs. A GPU loses nothing by it: the issuing worker runs at full speed,
and the time the others wait is time they would have spent fighting for the interpreter lock.

A closure that waits for another thread (``Device.waiting``: the router statistics of the batch, an
event on the cpu backend) gives the token back meanwhile, whatever its depth, so that whoever it
waits for can issue. Taking it gives up when the backend aborts, so no thread hangs on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from roundpipe.errors import Aborted

POLL_S = 0.05  # how often a thread waiting for the token looks whether the backend aborted


class IssueToken:
    """A process-wide turn to issue, held re-entrantly by one thread (a closure may submit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mine = threading.local()  # depth: closures entered; owns: whether it holds the lock
        self.enabled = True  # off: every thread issues at once (to measure what the token saves)

    def _take(self, aborted: Callable[[], bool]) -> None:
        while not self._lock.acquire(timeout=POLL_S):
            if aborted():
                raise Aborted("abandoned waiting for the turn to issue: the step was aborted")

    @contextmanager
    def held(self, aborted: Callable[[], bool]) -> Iterator[None]:
        """Around a closure's issue on the calling thread."""
        mine = self._mine
        depth, owns = getattr(mine, "depth", 0), getattr(mine, "owns", False)
        take = depth == 0 and self.enabled
        if take:
            self._take(aborted)
        mine.depth, mine.owns = depth + 1, owns or take
        try:
            yield
        finally:
            mine.depth = depth
            if take and mine.owns:
                mine.owns = False
                self._lock.release()

    @contextmanager
    def released(self, aborted: Callable[[], bool]) -> Iterator[None]:
        """Around a wait for another thread inside a closure: the token is free meanwhile."""
        mine = self._mine
        if not getattr(mine, "owns", False):
            yield
            return
        mine.owns = False
        self._lock.release()
        try:
            yield
        finally:
            self._take(aborted)
            mine.owns = True


class NoToken(IssueToken):
    """Every thread issues at once (the cpu backend: its per-device issue gate keeps its own order)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False


ISSUE_TOKEN = IssueToken()  # one interpreter lock per process: one token per process
