"""The timeline of one training step: what ran where and when, from the simulator or a real run.

A :class:`Timeline` is a flat list of :class:`Span` records plus a ``meta`` dict. The simulator
(``roundpipe.sim``) writes one for every simulated step and the runtime records the same type from
real runs, so a prediction and a measurement can be saved, plotted and compared with the same code
(``to_chrome_trace`` for Perfetto, ``roundpipe.sim.gantt.save_gantt`` for a PNG).

Contract of a span (all fields plain values, so ``to_dict``/``from_dict`` round-trip through JSON):

- ``device``: worker index (0-based), or ``HOST_DEVICE`` (-1) for host-side work such as the CPU
  optimizer.
- ``lane``: which engine did the work: ``"compute"`` (the device's compute stream), ``"h2d"`` and
  ``"d2h"`` (its copy engines) or ``"host"`` (CPU work: optimizer steps, gradient accumulation).
- ``name``: what exactly: a task (``"F3.1"``, ``"B2.0"``, a fused pair ``"F7.0+B9.0"``), a weight
  copy (``"W:layers.4"``), a hand-off (``"act[12].3"``, ``"grad[12].3"``), weight gradients of a
  task (``"grad:B2.0"``) or an optimizer step (``"step:layers.4"``).
- ``kind``: the colour class: ``F``, ``B``, ``I``, ``W`` (compute), ``FB`` (fused forward+backward),
  ``upload`` (weights up), ``act`` (activations or activation gradients, either way), ``download``
  (weight gradients down), ``stash`` (saved stage inputs down), ``optim``, ``idle``.
- ``start``, ``end``: seconds from the start of the step, ``start <= end``.

``meta`` holds free-form JSON values: ``source`` (``"sim"`` or ``"runtime"``), ``policy``,
``num_devices``, ``iteration_s`` and whatever else the producer knows.

Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from roundpipe.errors import ConfigError

FORMAT = "roundpipe.timeline/1"
# h2d_weights / d2h_grads: the runtime's lower-priority copy streams (bulk weights up, weight
# gradients down); the simulator folds them into h2d / d2h.
LANES = ("compute", "h2d", "h2d_weights", "d2h", "d2h_grads", "host")
HOST_DEVICE = -1
COMPUTE_KINDS = ("F", "B", "I", "W", "FB")


@dataclass(frozen=True)
class Span:
    """One piece of work on one engine (see the module docstring for every field)."""

    device: int
    lane: str
    name: str
    kind: str
    start: float
    end: float

    def __post_init__(self):
        if self.lane not in LANES:
            raise ConfigError(
                f"span {self.name!r}: lane must be one of {', '.join(LANES)}, got {self.lane!r}"
            )
        if not (self.end >= self.start):  # also rejects NaN
            raise ConfigError(f"span {self.name!r} ends ({self.end}) before it starts ({self.start})")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """All spans of one step (in any order) plus free-form ``meta``."""

    spans: list[Span] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    @property
    def makespan(self) -> float:
        """End of the last span (seconds from the step start); 0 for an empty timeline."""
        return max((s.end for s in self.spans), default=0.0)

    @property
    def devices(self) -> list[int]:
        return sorted({s.device for s in self.spans})

    def lanes(self, device: int) -> list[str]:
        """The lanes ``device`` used, in the canonical order compute, h2d, d2h, host."""
        used = {s.lane for s in self.spans if s.device == device}
        return [lane for lane in LANES if lane in used]

    def busy(self, device: int, lane: str = "compute") -> float:
        """Seconds ``device``'s ``lane`` was busy: the length of the union of its spans (overlaps once)."""
        total, end = 0.0, -math.inf
        for s in sorted((s for s in self.spans if s.device == device and s.lane == lane), key=_by_start):
            if s.start >= end:
                total += s.duration
                end = s.end
            elif s.end > end:
                total += s.end - end
                end = s.end
        return total

    def bubble_fraction(self, lane: str = "compute") -> float:
        """Idle over total on ``lane`` across the devices that have it: ``1 - busy / (D * makespan)``."""
        devs = [d for d in self.devices if d != HOST_DEVICE and lane in self.lanes(d)]
        span = self.makespan
        if not devs or span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(d, lane) for d in devs) / (len(devs) * span)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "meta": dict(self.meta), "spans": [asdict(s) for s in self.spans]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(f"not a timeline: expected format {FORMAT!r}, got {got!r}")
        try:
            spans = [
                Span(
                    int(s["device"]),
                    str(s["lane"]),
                    str(s["name"]),
                    str(s["kind"]),
                    float(s["start"]),
                    float(s["end"]),
                )
                for s in data["spans"]
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed timeline span: {e!r}") from e
        return cls(spans, dict(data.get("meta", {})))

    def save(self, path: str) -> None:
        """Write ``to_dict()`` as JSON (``load`` reads it back)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str) -> Timeline:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (Perfetto and chrome://tracing open it).

        One process per device (``pid = device + 1``; the host is ``pid 0``), one thread per lane
        (``tid`` = index in ``LANES``), complete events (``ph: "X"``) in microseconds with the span's
        ``kind`` as category; metadata events name the processes and threads and keep their order.
        """
        events: list[dict[str, Any]] = []
        for d in self.devices:
            pid = d + 1
            pname = "host" if d == HOST_DEVICE else f"device {d}"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
            for lane in self.lanes(d):
                tid = LANES.index(lane)
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}}
                )
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": pid,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    }
                )
        for s in sorted(self.spans, key=_by_start):
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.kind,
                    "pid": s.device + 1,
                    "tid": LANES.index(s.lane),
                    "ts": s.start * 1e6,
                    "dur": s.duration * 1e6,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": _jsonable(self.meta)}

    def save_chrome_trace(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)


def _by_start(s: Span) -> tuple[float, float]:
    return s.start, s.end


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(meta, default=str))


__all__ = ["COMPUTE_KINDS", "FORMAT", "HOST_DEVICE", "LANES", "Span", "Timeline"]
