"""The device protocol the runtime is written against (DESIGN.md §4).

A backend owns devices; a device owns three named streams (``compute``, ``h2d``, ``d2h``) and a
memory ledger. Work is *submitted* to a stream as a Python callable and runs in stream order:
on CUDA the callable runs at once on the caller's thread with the stream current (its kernels are
queued asynchronously); on the cpu backend a thread per stream runs it. Either way, code written as
"submit closures, order them with events" behaves the same, which is what lets the cpu backend find
protocol bugs.

Cross-stream and cross-device order is carried only by events: ``record_event(stream)`` marks the
point after everything submitted so far; ``wait_event(stream, ev)`` makes later work on ``stream``
wait for it; ``ev.synchronize()`` blocks the host. An exception raised by submitted work is
re-raised by ``synchronize()`` of any event recorded after it, on any stream that (transitively)
waited on it, so errors travel the same paths as data.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from roundpipe.errors import DeviceOutOfMemory

# Copies go on separate streams by urgency, so an urgent copy never queues behind a bulk one:
# activations the next compute needs (h2d) > the next stage's weights (h2d_weights, cut into
# chunks) on the way up; activations and losses (d2h) > weight gradients (d2h_grads) on the way down.
STREAM_NAMES = ("compute", "h2d", "h2d_weights", "d2h", "d2h_grads")
# Lower number = more urgent, as in CUDA.
STREAM_PRIORITIES = {"compute": 0, "h2d": -1, "h2d_weights": 0, "d2h": -1, "d2h_grads": 0}


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class MemoryLedger:
    """Bytes a device holds, by tag, against a capacity. Thread-safe.

    The runtime reserves before it places a tensor on a device and releases (in stream order)
    after the last use. ``peak`` is the high-water mark; ``trace`` (when enabled) records
    ``(event, tag, nbytes, in_use)`` for tests that check what was resident when.
    """

    def __init__(self, device: str, capacity: int | None):
        self.device = device
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self.by_tag: dict[str, int] = {}
        self.trace: list[tuple[str, str, int, int]] | None = None
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str, tag: str) -> None:
        with self._lock:
            if self.capacity is not None and self.in_use + nbytes > self.capacity:
                raise DeviceOutOfMemory(self.device, what, nbytes, self.in_use, self.capacity)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.by_tag[tag] = self.by_tag.get(tag, 0) + nbytes
            if self.trace is not None:
                self.trace.append(("reserve", what, nbytes, self.in_use))

    def release(self, nbytes: int, what: str, tag: str) -> None:
        with self._lock:
            self.in_use -= nbytes
            self.by_tag[tag] = self.by_tag.get(tag, 0) - nbytes
            if self.trace is not None:
                self.trace.append(("release", what, nbytes, self.in_use))

    def mark(self, what: str) -> None:
        """Record a point of interest (e.g. "compute F3.0 starts") in the trace."""
        with self._lock:
            if self.trace is not None:
                self.trace.append(("mark", what, 0, self.in_use))

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.in_use


class Event(ABC):
    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event has happened; re-raise the error of failed work before it."""

    @abstractmethod
    def query(self) -> bool:
        """True once the event has happened (successfully or not)."""


class Stream(ABC):
    def __init__(self, device: Device, name: str, priority: int):
        self.device, self.name, self.priority = device, name, priority

    @abstractmethod
    def submit(self, fn: Callable[[], None], label: tuple[str, str] | None = None) -> None:
        """Run ``fn`` after everything submitted to this stream before it.

        ``label`` = ``(name, kind)`` (e.g. ``("F3.1", "F")``) records the work's start and end on
        this stream's lane of the device timeline while the backend is recording.
        """

    @abstractmethod
    def record_event(self) -> Event: ...

    @abstractmethod
    def wait_event(self, event: Event) -> None: ...

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def describe(self) -> str:
        """What the stream is doing now (for error messages); backends that cannot tell say so."""
        return f"{self.name} (state not tracked)"


class Device(ABC):
    """One worker device. ``torch_device`` is where its tensors live (``cpu`` for virtual devices)."""

    def __init__(
        self, backend: Backend, index: int, name: str, torch_device: torch.device, capacity: int | None
    ):
        self.backend = backend
        self.index = index
        self.name = name
        self.torch_device = torch_device
        self.memory = MemoryLedger(name, capacity)
        self.streams: dict[str, Stream] = {}
        self.bytes_in = 0  # host -> device bytes copied (counted by to_device)
        self.bytes_out = 0  # device -> host bytes copied (counted by to_host)

    @abstractmethod
    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a host tensor onto this device (call inside an ``h2d`` closure)."""

    @abstractmethod
    def to_host(self, dev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a device tensor into (pinned) host memory (call inside a ``d2h`` closure)."""

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device (filled by ``copy_in`` chunks)."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a host (pinned) tensor into a device tensor or a slice of one (inside an h2d closure)."""
        self.bytes_in += src.numel() * src.element_size()
        dst.copy_(src, non_blocking=True)

    def hand_over(self, t: torch.Tensor, stream: Stream) -> None:  # noqa: B027 (optional hook)
        """Tell the allocator ``t`` (made on another stream) is used on ``stream``. No-op on cpu."""

    @abstractmethod
    def seeded(self, seed: int) -> AbstractContextManager:
        """A context in which this device's RNG is seeded with ``seed`` and restored afterwards.

        Used so that a recomputed forward draws the same dropout masks as the original one.
        """

    def __repr__(self) -> str:
        return f"Device({self.name})"


class Backend(ABC):
    name: str
    devices: list[Device]
    aborted: bool = False
    recording: bool = False

    def start_recording(self) -> None:
        """Begin a timeline: spans of labelled work are kept from now on (times from now)."""
        self._spans: list = []
        self.recording = True

    def collect_spans(self) -> list[tuple[int, str, str, str, float, float]]:
        """Stop recording; ``(device, lane, name, kind, start_s, end_s)`` of every labelled work.

        Call after every stream has finished the recorded work.
        """
        self.recording = False
        return sorted(getattr(self, "_spans", []), key=lambda s: (s[0], s[4]))

    @abstractmethod
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor ready for asynchronous copies (pinned on CUDA; the tensor itself on cpu)."""

    def abort(self) -> None:
        """Make every pending and future wait fail fast (used when a worker has failed)."""
        self.aborted = True

    def report(self, error: BaseException) -> None:
        """Called by a stream whose work raised: remember the error and abort everything."""
        self.errors.append(error)
        self.abort()

    def progress(self) -> int:
        """A counter that grows while streams do work (for the watchdog); 0 where not tracked."""
        return 0

    def reset(self) -> None:
        """Clear an abort and poisoned streams so the backend can run again."""
        self.aborted = False
        self.errors = []

    @abstractmethod
    def close(self) -> None:
        """Stop all streams; returns after every backend thread has ended."""
