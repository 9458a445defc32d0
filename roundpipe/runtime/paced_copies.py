"""Bulk copies kept on the host and issued a few chunks at a time, so that urgent copies pass them.

Stream priorities do not order copies: a copy engine runs the copies that reach it in the order they
were issued, whatever their streams' priorities (docs/design.md §4). A stage's weights (or its fp32
gradients) issued as one block would hold every activation copy issued after them until the whole
block had moved. So the worker hands such a transfer over as a *group* of chunk closures, and issues
the chunks over its next tasks (``pace``), each task's share after that task's own urgent copies: an
activation copy then waits at most for the chunks issued before it, not for a stage's worth. A group
that is needed now (its weights for the task being issued, its gradients for the host) is issued at
once (``finish``). Nothing here waits for the device: issuing is host work on the worker thread, and
groups are issued in the order they were added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from roundpipe.backend import Event, Stream

# A chunk: the closure that issues one copy, and its span label ``(name, kind)``.
Chunk = tuple[Callable[[], None], tuple[str, str]]


@dataclass(eq=False)
class CopyGroup:
    """One transfer: the events its stream waits for before its first chunk (``waits``), its chunk
    closures with their span labels, and ``issued``, called with the event recorded after the last
    chunk once that chunk has been issued."""

    waits: list[Event]
    chunks: deque[Chunk]
    issued: Callable[[Event], None]
    started: bool = False
    done: bool = False


class PacedCopies:
    """The groups of one copy stream not yet fully issued. Only the device's worker thread calls it."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.groups: deque[CopyGroup] = deque()

    def add(
        self,
        waits: list[Event],
        chunks: Sequence[Chunk],
        issued: Callable[[Event], None],
    ) -> CopyGroup:
        """Queue a transfer; nothing is issued yet."""
        group = CopyGroup(waits, deque(chunks), issued)
        self.groups.append(group)
        return group

    @property
    def pending(self) -> int:
        """Chunks added but not issued yet."""
        return sum(len(g.chunks) for g in self.groups)

    def pace(self, turns: int) -> None:
        """Issue this turn's share: the pending chunks spread evenly over ``turns`` turns, this one
        included (1: all of them)."""
        self._issue(-(-self.pending // max(1, turns)))

    def finish(self, group: CopyGroup) -> None:
        """Issue ``group``'s chunks now (and those of every group added before it)."""
        while not group.done:
            self._issue(1)

    def flush(self) -> None:
        self._issue(self.pending)

    def clear(self) -> None:
        """Forget every group without issuing it (after a failed step: the backend was reset)."""
        self.groups.clear()

    def _issue(self, n: int) -> None:
        """Issue up to ``n`` chunks, in order; a group whose last chunk goes records its event."""
        while self.groups and (n > 0 or not self.groups[0].chunks):
            group = self.groups[0]
            if not group.started:
                group.started = True
                for event in group.waits:
                    self.stream.wait_event(event)
            if group.chunks:
                fn, label = group.chunks.popleft()
                self.stream.submit(fn, label)
                n -= 1
            if not group.chunks:
                self.groups.popleft()
                group.done = True
                group.issued(self.stream.record_event())
