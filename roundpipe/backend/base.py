"""The device protocol the runtime is written against (docs/design.md §4).

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
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch

from roundpipe.backend.issue_token import IssueToken, NoToken
from roundpipe.errors import DeviceOutOfMemory

# Copies go on separate streams by urgency: activations the next compute needs (h2d) and the next
# stage's weights (h2d_weights) on the way up; activations and losses (d2h) and weight gradients
# (d2h_grads) on the way down. On CUDA the priorities order kernels only: a copy engine runs copies
# in issue order, so the runtime paces the bulk streams' chunks behind the urgent copies by when it
# issues them (runtime/paced_copies.py); separate streams keep a copy from waiting on another's events.
STREAM_NAMES = ("compute", "h2d", "h2d_weights", "d2h", "d2h_grads")
# Lower number = more urgent, as in CUDA.
STREAM_PRIORITIES = {"compute": 0, "h2d": -1, "h2d_weights": 0, "d2h": -1, "d2h_grads": 0}


class TaskWork(NamedTuple):
    """What a compute closure runs, for a backend that models its duration instead of measuring
    it (the virtual server, ``backend/virtual.py``): the task's flow (``layers_fwd``,
    ``layers_bwd``, ``first_forward``, ``fused_with``: ``runtime/plan.TaskFlow``) and its
    microbatch's shape. Other backends ignore it."""

    flow: Any
    rows: int
    seq_len: int


def storage_key(t: torch.Tensor) -> int:
    """What identifies ``t``'s storage while it lives (shared by its views): its address, or for a
    tensor without one (meta: the virtual server's host tensors; empty) the storage itself."""
    s = t.untyped_storage()
    return s.data_ptr() or s._cdata


def host_seed(seed: int) -> int:
    """The seed of a seeded block's host (CPU) generator, another stream than its device's."""
    return (seed ^ 0x5DEECE66D_2545F491) & ((1 << 63) - 1)


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def as_device_error(e: BaseException, device: Device, what: str) -> BaseException:
    """``e`` as the caller should see it: the allocator's out-of-memory error (CUDA's, or the cpu
    backend's model of it) becomes ``DeviceOutOfMemory`` naming the device and what was placed;
    anything else is returned as it is. The one place both backends and the workers turn it."""
    if not isinstance(e, torch.OutOfMemoryError):
        return e
    memory = device.memory
    out = DeviceOutOfMemory(
        device.name,
        getattr(e, "what", None) or what,
        getattr(e, "nbytes", 0),
        memory.in_use,
        memory.capacity or 0,
    )
    out.__cause__ = e
    return out


def _as_list(tensors) -> list[torch.Tensor]:
    if isinstance(tensors, int):  # a byte count (the host's hand-off ledger books no tensors)
        return []
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for t in tensors if t is not None]


def _nbytes(tensors, as_list: list[torch.Tensor]) -> int:
    return tensors if isinstance(tensors, int) else sum(tensor_bytes(t) for t in as_list)


class MemoryLedger:
    """The runtime's plan of what a device holds: bytes by tag, reserved and released per tensor.

    The runtime reserves what it leaves on a device (weights, hand-offs, gradient accumulators,
    a microbatch's context) inside the closure that makes it, and releases it in stream order after
    its last use. The ledger is *not* the truth about memory: ``Device.memory`` measures what is
    alive. On the cpu backend a *watcher* (the stream sanitizer) checks the two against each other
    at the end of every closure (docs/design.md §5). ``peak`` is the plan's high-water mark;
    ``trace`` (when enabled) records ``(event, what, nbytes, in_use)`` for tests that check what was
    resident when. Thread-safe.
    """

    def __init__(self, device: str, watcher=None):
        self.device = device
        self.watcher = watcher
        self.in_use = 0
        self.peak = 0
        self.by_tag: dict[str, int] = {}
        self.trace: list[tuple[str, str, int, int]] | None = None
        self._lock = threading.Lock()

    def reserve(self, tensors, what: str, tag: str) -> None:
        """Account ``tensors`` (a tensor or several, booked as one entry; or a byte count) as held
        for ``what``."""
        nbytes = _nbytes(tensors, tensors := _as_list(tensors))
        if self.watcher is not None:
            self.watcher.reserved(tensors, True, what)
        with self._lock:
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.by_tag[tag] = self.by_tag.get(tag, 0) + nbytes
            if self.trace is not None:
                self.trace.append(("reserve", what, nbytes, self.in_use))

    def release(self, tensors, what: str, tag: str) -> None:
        """Give back what ``reserve`` booked; the tensors must die before the closure ends."""
        nbytes = _nbytes(tensors, tensors := _as_list(tensors))
        if self.watcher is not None:
            self.watcher.reserved(tensors, False, what)
        with self._lock:
            self.in_use -= nbytes
            self.by_tag[tag] = self.by_tag.get(tag, 0) - nbytes
            if self.trace is not None:
                self.trace.append(("release", what, nbytes, self.in_use))

    def clear(self) -> None:
        """Forget every reservation (after a failed step whose tensors are gone)."""
        with self._lock:
            self.in_use = 0
            self.by_tag.clear()

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
    def submit(
        self,
        fn: Callable[[], None],
        label: tuple[str, str] | None = None,
        name: str | None = None,
        work: TaskWork | None = None,
    ) -> None:
        """Run ``fn`` after everything submitted to this stream before it.

        ``label`` = ``(name, kind)`` (e.g. ``("F3.1", "F")``) records the work's start and end on
        this stream's lane of the device timeline while the backend is recording. ``name`` (default:
        the label's) names the work in the cpu backend's protocol errors and the tensors it makes.
        ``work``: what a compute task runs, for the virtual server's time model (``TaskWork``).
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


class DeviceMemory(ABC):
    """What a device really holds, as its caching allocator reports it (measured, never kept by hand):
    ``in_use`` / ``peak`` the bytes allocated to live tensors, ``reserved`` / ``reserved_peak`` the
    bytes the allocator holds from the device (allocated plus cached)."""

    capacity: int | None
    measured: bool = True

    @property
    @abstractmethod
    def in_use(self) -> int: ...

    @property
    @abstractmethod
    def peak(self) -> int: ...

    @property
    def reserved(self) -> int:
        return self.in_use

    @property
    def reserved_peak(self) -> int:
        return self.peak

    def stats(self) -> dict:
        """The allocator's figures (``torch.cuda.memory_stats`` names where there is one)."""
        return {}

    @abstractmethod
    def reset_peak(self) -> None: ...


class Device(ABC):
    """One worker device. ``torch_device`` is where its tensors live (``cpu`` for virtual devices).

    ``memory`` measures what is alive on it (``DeviceMemory``); ``ledger`` is the runtime's plan of
    what it holds, by tag (``MemoryLedger``).
    """

    memory: DeviceMemory

    def __init__(
        self, backend: Backend, index: int, name: str, torch_device: torch.device, ledger_watcher=None
    ):
        self.backend = backend
        self.index = index
        self.name = name
        self.torch_device = torch_device
        self.ledger = MemoryLedger(name, ledger_watcher)
        self.streams: dict[str, Stream] = {}
        self.bytes_in = 0  # host -> device bytes copied (counted by to_device, copy_in)
        self.bytes_out = 0  # device -> host bytes copied (counted by to_host)
        # Several copy streams count at once (h2d and h2d_weights, d2h and d2h_grads): an unlocked
        # ``+=`` from two threads loses updates.
        self._copied_lock = threading.Lock()

    def count_in(self, t: torch.Tensor) -> None:
        """Count ``t``'s bytes as copied host -> device (thread-safe)."""
        with self._copied_lock:
            self.bytes_in += t.numel() * t.element_size()

    def count_out(self, t: torch.Tensor) -> None:
        """Count ``t``'s bytes as copied device -> host (thread-safe)."""
        with self._copied_lock:
            self.bytes_out += t.numel() * t.element_size()

    @abstractmethod
    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a host tensor onto this device (call inside an ``h2d`` closure)."""

    @abstractmethod
    def to_host(self, dev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a device tensor into (pinned) host memory (call inside a ``d2h`` closure)."""

    def free_bytes(self) -> int | None:
        """Bytes this device can take now for the next plan (None: no bound is known).

        Asked once before a plan first runs (``runtime/memory_guard.py``), between steps, when
        the stateless workers hold nothing. The cuda backend counts what the driver has free plus
        what PyTorch's caching allocator holds unused for this process; the cpu backend its
        configured capacity less what is alive on the device."""
        return None

    def waiting(self) -> AbstractContextManager:
        """Around a wait for another thread inside a closure of this device (the router statistics
        of the batch): the cpu backend lets the device's streams run meanwhile."""
        return nullcontext()

    def allocation_slack(self) -> int:
        """Bytes the device's caching allocator may reserve beyond what a plan counts (partly used
        segments); ``free_bytes`` has already taken them off, and a planner's budget should too."""
        return 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device (filled by ``copy_in`` chunks)."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a host (pinned) tensor into a device tensor or a slice of one (inside an h2d closure)."""
        self.count_in(src)
        dst.copy_(src, non_blocking=True)

    @abstractmethod
    def hand_over(self, t: torch.Tensor, stream: Stream) -> None:
        """Declare that ``t``, made on another stream of this device, is used on ``stream`` too.

        CUDA: ``record_stream``, so the caching allocator does not reuse its block before
        ``stream`` is done with it. cpu: the stream sanitizer records it and rejects a use on a
        stream ``t`` was not handed to. Call it once ``t`` exists (inside the closure that makes it).
        """

    @abstractmethod
    def seeded(self, seed: int) -> AbstractContextManager:
        """A context in which every generator work issued inside can draw from is seeded from
        ``seed``: this device's (kernels: dropout masks, router noise) and the host's (what a
        layer draws on the CPU at issue time, such as peft LoHa's ``torch.rand(1)``, seeded with
        ``host_seed(seed)``); the generators are left as they were afterwards.

        The runtime issues every training-mode layer's forward inside one, keyed by (seed, step,
        layer, microbatch, rank), so a recomputed forward draws what the original one drew, on
        whichever device or thread it runs.
        """

    def __repr__(self) -> str:
        return f"Device({self.name})"


class HostBuffers(Protocol):
    """A pool of host buffers that downloads land in (``host_memory.HostBufferPool`` is one)."""

    def acquire(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...

    def release(self, t: torch.Tensor, event: Event | None = None) -> None: ...


class Backend(ABC):
    name: str
    devices: list[Device]
    errors: list[BaseException]  # what the streams' work raised since the last reset
    aborted: bool = False
    recording: bool = False
    # Host syncs since the last reset (``cpu_host_syncs.HostSyncs``): counted by the cpu backend;
    # None where the backend cannot count them (CUDA: ``torch.cuda.set_sync_debug_mode`` reports
    # them).
    host_syncs = None
    # Where the run's host tensors live: the CPU; the virtual server's are meta (shapes, no data).
    host_device = torch.device("cpu")
    # Whose turn it is to issue (``issue_token``): the process's token where workers issue from
    # Python beside each other (CUDA, the virtual server); none on the cpu backend, whose per-device
    # issue gate orders its stream threads and workers itself.
    issue_token: IssueToken = NoToken()

    def attach(self, model_config: dict, settings: dict) -> None:  # noqa: B027 (optional hook)
        """The wrapped model's config and the run's cost settings, for a backend that models the
        time of its layers (the virtual server); others ignore them."""

    def host_work(self) -> AbstractContextManager:
        """What the host thread runs its jobs under (the virtual server times their meta work)."""
        return nullcontext()

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

    # Where downloads land: a ``HostBufferPool`` of (pinned) host buffers, set by the pipeline;
    # None: a fresh host tensor per download.
    host_buffers: HostBuffers | None = None

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for a download (from ``host_buffers`` when set). Its owner gives it back
        with ``host_buffers.release(t, event)`` once nothing reads it any more."""
        if self.host_buffers is not None:
            return self.host_buffers.acquire(tuple(shape), dtype)
        return torch.empty(shape, dtype=dtype)

    def completed_clock(self, event) -> dict | None:
        """What is known to have run once ``event`` has happened (None: what the calling thread has
        seen run), as a vector clock of issued work per stream; None where the backend cannot tell
        (CUDA). The host buffer pool checks releases against it."""
        return None

    def host_release(self, t: torch.Tensor, event=None) -> None:
        """Give a ``host_empty`` buffer back once ``event`` (None: now) says no copy reads it."""
        if self.host_buffers is not None:
            self.host_buffers.release(t, event)

    def register_host(self, t: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Page-lock an existing host allocation in place (``cudaHostRegister`` on CUDA), so that
        asynchronous copies from and to it are truly asynchronous. A no-op on the cpu backend."""

    def unregister_host(self, t: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Undo ``register_host`` before the allocation is freed. A no-op on the cpu backend."""

    def use_fp16_accumulation(self) -> None:
        """Let fp16 matmuls accumulate in fp16 while this backend is open (``RunConfig(
        fp16_accumulation=True)``). The cpu backend has no such mode: it warns and computes as usual."""
        warnings.warn(
            f"fp16_accumulation has no effect on the {type(self).__name__}: CPU matmuls accumulate in fp32",
            RuntimeWarning,
            stacklevel=2,
        )

    def synchronized(self) -> None:  # noqa: B027 (optional hook)
        """Called once the host has waited for every stream: the cpu backend orders all work issued
        so far before what comes next (its sanitizer's clocks)."""

    def step_completed(self) -> None:  # noqa: B027 (optional hook)
        """Called after a step has completed: every training-mode layer has been issued in a
        ``Device.seeded`` block at least once. The cuda backend then knows whether the model draws
        on the host (``cuda.GeneratorLocks``)."""

    def check_empty(self) -> None:  # noqa: B027 (optional hook)
        """After a step: raise ``StreamProtocolError`` if a device still holds a tensor (the
        workers are stateless). The cpu backend can tell; on CUDA this is a no-op."""

    def abort(self) -> None:
        """Make every pending and future wait fail fast (used when a worker has failed)."""
        self.aborted = True

    def report(self, error: BaseException) -> None:
        """Called by a stream whose work raised: remember the error and abort everything."""
        self.errors.append(error)
        self.abort()

    def reset(self) -> None:
        """Clear an abort and poisoned streams so the backend can run again."""
        self.aborted = False
        self.errors = []

    @abstractmethod
    def close(self) -> None:
        """Stop all streams; returns after every backend thread has ended."""
