"""What the last step did: its spans (device lanes and the host lane), wall time and byte counts.

The ``Recorder`` brackets each step (``with recorder.recording():``) on the caller's thread: it
resets the memory peaks and byte counters, has the backend record the labelled work of every
stream, and collects it at the end. The host thread times its own work (gradient accumulation,
optimizer steps) with ``host_span``. ``stats`` and ``timeline`` read the last finished recording.
"""

from __future__ import annotations

import contextlib
import time

from roundpipe.backend import Backend, MemoryLedger


class Recorder:
    """Spans and figures of the last recorded step.

    ``last_spans`` holds ``(device index, lane, name, kind, start s, end s)`` tuples, times from the
    recording origin; the host lane is device -1.
    """

    def __init__(self, backend: Backend, host_memory: MemoryLedger, host_stats=None):
        self.backend = backend
        self.host_memory = host_memory
        self.host_stats = host_stats  # () -> dict: host bytes requested and reserved (the store's)
        self.last_spans: list = []
        self.last_wall = 0.0
        self._origin: float | None = None  # set while recording
        self._host_spans: list = []
        self._bytes_at_start: dict = {}
        self._started = 0.0

    @contextlib.contextmanager
    def recording(self):
        """Record the step run inside the block (caller's thread); kept even if the step fails."""
        self.host_memory.reset_peak()
        for d in self.backend.devices:
            d.memory.reset_peak()
            d.ledger.reset_peak()
        if self.backend.host_syncs is not None:
            self.backend.host_syncs.reset()
        self._bytes_at_start = {d.index: (d.bytes_in, d.bytes_out) for d in self.backend.devices}
        self._host_spans = []
        self.backend.start_recording()
        self._origin = getattr(self.backend, "recording_origin", time.perf_counter())
        self._started = time.perf_counter()
        try:
            yield
        finally:
            self.last_wall = time.perf_counter() - self._started
            self.last_spans = self.backend.collect_spans() + self._host_spans
            self._origin = None

    @contextlib.contextmanager
    def host_span(self, name: str, kind: str):
        """Time host-side work (accumulation, optimizer steps) onto the timeline's host lane.
        Host thread; records nothing outside a recording."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._origin is not None:
                t0 = self._origin
                self._host_spans.append((-1, "host", name, kind, start - t0, time.perf_counter() - t0))

    def add_host_span(self, name: str, kind: str, start: float, stop: float) -> None:
        """Host-side work timed by its own thread (``time.perf_counter`` seconds), such as a
        gradient bucket's collective from issue to arrival; nothing outside a recording."""
        if self._origin is not None:
            self._host_spans.append((-1, "host", name, kind, start - self._origin, stop - self._origin))

    def stats(self) -> dict:
        """See ``Pipeline.stats``."""
        wall, spans = self.last_wall, self.last_spans
        devices = []
        for d in self.backend.devices:
            busy = sum(e - s for dev, lane, _, _, s, e in spans if dev == d.index and lane == "compute")
            start_in, start_out = self._bytes_at_start.get(d.index, (0, 0))
            devices.append(
                {
                    "device": d.name,
                    "busy_s": busy,
                    "idle_s": max(0.0, wall - busy),
                    "bubble_fraction": (max(0.0, wall - busy) / wall) if wall else 0.0,
                    "bytes_to_device": d.bytes_in - start_in,
                    "bytes_to_host": d.bytes_out - start_out,
                    # measured by the caching allocator (CUDA's, or the cpu backend's model of it):
                    # bytes allocated to live tensors, and bytes reserved from the device
                    "peak_bytes": d.memory.peak if d.memory.measured else None,
                    "reserved_peak_bytes": d.memory.reserved_peak if d.memory.measured else None,
                    "allocator": d.memory.stats(),
                    "planned_peak_bytes": d.ledger.peak,  # what the runtime booked in its ledger
                }
            )
        host = sum(e - s for dev, lane, _, _, s, e in spans if lane == "host")
        return {
            "step_s": wall,
            "devices": devices,
            "host_busy_s": host,
            "host_handoff_peak_bytes": self.host_memory.peak,
            "host_memory": self.host_stats() if self.host_stats is not None else {},
            # reads of device data on the host in the last step (each stalls the issuing thread until
            # its stream drains): how many and where; None where the backend cannot count them
            "host_syncs": None if self.backend.host_syncs is None else self.backend.host_syncs.report(),
        }

    def timeline(self, policy: str):
        """The last step as a ``roundpipe.schedule.timeline.Timeline``."""
        from roundpipe.schedule.timeline import Span, Timeline

        spans = [
            Span(dev, lane, name, kind, start, end) for dev, lane, name, kind, start, end in self.last_spans
        ]
        return Timeline(
            spans,
            {
                "source": "runtime",
                "backend": self.backend.name,
                "policy": policy,
                "devices": [d.name for d in self.backend.devices],
            },
        )
