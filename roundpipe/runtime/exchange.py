"""Host-side hand-offs between workers: activations and gradients by boundary and microbatch.

A producer *puts* ``(slot, event)`` when it has **issued** the copy that fills ``slot`` (not when the
copy is done); a consumer *gets* it, makes its stream wait on ``event``, and reads ``slot.value`` in
a closure that runs after that wait. The host blocks only for this handshake (docs/design.md §3.4).
Entries are dropped after their last consumer, so the CPU holds only what is still needed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from roundpipe.backend import Event


class Slot:
    """A box filled by a closure on one stream and read by closures that wait on its event."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None):
        self.value = value

    def fill(self, value: Any) -> None:
        self.value = value


class HandOff(Slot):
    """A host tensor handed from one task to its consumers (an activation or a gradient).

    The producer's download fills it and books its bytes on the host ledger; each consumer calls
    ``take(after)`` once it has queued the copy to its device, with an event that fires when that
    copy is done. After the last one the host memory is released: the buffer goes back to the host
    pool (``free``) once every consumer's copy is done, so a later download never overwrites it
    while an asynchronous copy still reads it.
    """

    __slots__ = ("uses", "ledger", "what", "free", "_after", "_lock")

    def __init__(self, uses: int, ledger, what: str, free=None):
        super().__init__()
        self.uses, self.ledger, self.what, self.free = uses, ledger, what, free
        self._after: list = []
        self._lock = threading.Lock()

    def fill(self, tensor) -> None:
        self.ledger.reserve(tensor.numel() * tensor.element_size(), self.what, "handoffs")
        self.value = tensor

    def take(self, after=None) -> None:
        with self._lock:
            self.uses -= 1
            if after is not None:
                self._after.append(after)
            if self.uses == 0 and self.value is not None:
                value, self.value = self.value, None
                self.ledger.release(value.numel() * value.element_size(), self.what, "handoffs")
                if self.free is not None:
                    self.free(value, AllDone(self._after) if self._after else None)


class AllDone:
    """An event-like ``query()`` that is True once every one of ``events`` has happened."""

    __slots__ = ("events",)

    def __init__(self, events: list):
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    @property
    def clock(self) -> dict | None:
        """What is known to have run once every event has happened (their clocks merged); None if
        one of them carries no clock."""
        merged: dict = {}
        for e in self.events:
            clock = getattr(e, "clock", None)
            if clock is None:
                return None
            for stream, t in clock.items():
                if t > merged.get(stream, 0):
                    merged[stream] = t
        return merged


class AbortedWait(RuntimeError):
    """Raised in a worker waiting for a hand-off when the pipeline aborts."""


@dataclass
class _Entry:
    slot: HandOff
    event: Event | None
    remaining: int


class Exchange:
    def __init__(self, is_aborted):
        self._entries: dict[tuple, _Entry] = {}
        self._cond = threading.Condition()
        self._is_aborted = is_aborted

    def is_aborted(self) -> bool:
        return self._is_aborted()

    def put(self, key: tuple, slot: HandOff, event: Event | None, consumers: int) -> None:
        if consumers <= 0:
            return
        with self._cond:
            self._entries[key] = _Entry(slot, event, consumers)
            self._cond.notify_all()

    def get(self, key: tuple) -> tuple[HandOff, Event | None]:
        """Block until ``key`` is put; count one consumer. Raises AbortedWait on abort."""
        with self._cond:
            while key not in self._entries:
                if self._is_aborted():
                    raise AbortedWait(f"abandoned waiting for {key}")
                self._cond.wait(0.05)
            e = self._entries[key]
            e.remaining -= 1
            if e.remaining == 0:
                del self._entries[key]
            return e.slot, e.event

    def wait_for_change(self, timeout: float = 0.05) -> None:
        """Block until something is put (or ``timeout``); raises AbortedWait on abort."""
        with self._cond:
            if self._is_aborted():
                raise AbortedWait("abandoned waiting for a ready task")
            self._cond.wait(timeout)

    def notify(self) -> None:
        """Wake the waits of ``wait_for_change`` (something else a ready task may need arrived)."""
        with self._cond:
            self._cond.notify_all()

    def has(self, key: tuple) -> bool:
        with self._cond:
            return key in self._entries

    def clear(self) -> None:
        with self._cond:
            self._entries.clear()
