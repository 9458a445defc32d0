"""Virtual devices on the CPU, on CUDA's clock: the backend every test runs on.

A closure submitted to a stream runs at once on the issuing thread, as on CUDA; the operations it
makes are queued, and each stream's thread runs them later, in order, after the stream's waits
(``cpu_clock.py``). So everything a closure does on the host (allocate, free, take or give back a
pinned buffer, book the ledger) happens when it is issued, while the "GPU" may be far behind, and a
host-side effect that would be wrong on CUDA is wrong here too. Device memory comes from a model of
CUDA's caching allocator (``cpu_allocator.py``): per-stream pools, ``record_stream``, reserved bytes,
the retry path and out-of-memory at the capacity. Reading device data on the host is a host sync:
it waits for the stream and is counted (``backend.host_syncs``). With checking on
(``sanitize=True`` or ``ROUNDPIPE_SANITIZE=1``, as in every test) the stream sanitizer
(``sanitizer.py``) rejects what CUDA's stream semantics would break.

Errors are sticky as on CUDA: an error of an issued closure or of a queued kernel poisons its
stream; later events recorded on it carry the error, streams that wait on those events inherit it,
and ``synchronize`` re-raises it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from roundpipe.backend.base import (
    STREAM_NAMES,
    STREAM_PRIORITIES,
    Backend,
    Device,
    Event,
    Stream,
    TaskWork,
    as_device_error,
    host_seed,
)
from roundpipe.backend.cpu_allocator import AllocatorRules, CachingAllocator
from roundpipe.backend.cpu_clock import IssueMode, host_allocation, task_generator
from roundpipe.backend.cpu_host_syncs import HostSyncs, call_site
from roundpipe.backend.cpu_memory import PINNED, AllocatorMemory
from roundpipe.backend.sanitizer import Sanitizer
from roundpipe.backend.threads import own_intra_op_threads
from roundpipe.errors import Aborted, StreamProtocolError
from roundpipe.testing import faults


def known_clock(backend: CpuBackend) -> dict:
    """What the calling thread knows has run on ``backend``'s streams (the events it waited for), as
    a vector clock. Kept per backend, so that it dies with it."""
    clock = getattr(backend.known, "clock", None)
    if clock is None:
        clock = backend.known.clock = {}
    return clock


def _learn(backend: CpuBackend, clock: dict) -> None:
    mine = known_clock(backend)
    for stream, t in clock.items():
        if t > mine.get(stream, 0):
            mine[stream] = t


class CpuEvent(Event):
    def __init__(self, backend: CpuBackend, clock: dict):
        self._backend = backend
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.clock = clock  # the recording stream's vector clock when it was recorded (issue time)
        self.at: float | None = None  # when it happened on a modelled clock (the virtual server)

    def fire(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if not self._done.is_set():
            with waiting():  # a closure that waits lets its device's streams run meanwhile
                while not self._done.wait(0.05):
                    if self._backend.aborted:
                        raise Aborted("wait abandoned: the pipeline is aborting")
        _learn(self._backend, self.clock)

    def synchronize(self) -> None:
        self.wait()
        if self.error is not None:
            raise self.error


_issuer = threading.local()  # the device whose closure the calling thread is issuing, if any


@contextmanager
def waiting():
    """While the calling thread waits inside a closure, its device's streams may run (see
    ``CpuDevice.issuing``); a no-op on a thread that is not issuing."""
    device = getattr(_issuer, "device", None)
    if device is None:
        yield
        return
    _issuer.device = None
    device._open()
    started = time.perf_counter()
    try:
        with device.backend.issue_token.released(lambda: device.backend.aborted):
            yield
    finally:
        device.waited_s += time.perf_counter() - started
        device._close()
        _issuer.device = device


# Markers in a stream's queue (kernels are queued as callables).
_RECORD, _WAIT, _BEGIN, _END, _POISON, _SLEEP, _RESET, _STOP = range(8)


class CpuStream(Stream):
    def __init__(self, device: CpuDevice, name: str, priority: int):
        super().__init__(device, name, priority)
        self._queue: queue.SimpleQueue = self.new_queue()
        self._error: BaseException | None = None  # issue side: a closure failed (skip later ones)
        self._failed: BaseException | None = None  # stream side: a kernel or a wait failed
        self.clock: dict[CpuStream, int] = {}  # vector clock of issued closures ordered before now
        self.issuing: tuple[str, float] | None = None  # the closure being issued, since when
        self.current: tuple[str, float] | None = None  # what the stream's thread runs, since when
        self._mode = IssueMode(self)
        self._thread = threading.Thread(
            target=self._loop, name=f"roundpipe-{device.name}-{name}", daemon=True
        )
        self._thread.start()

    # A span starts when its closure was issued: the issue held the device's streams (the gate).
    issue_in_span = 1

    def new_queue(self) -> queue.SimpleQueue:
        """The queue the stream's thread takes its work from."""
        return queue.SimpleQueue()

    # ------------------------------------------------------------------ issue side (any thread)
    def submit(
        self,
        fn: Callable[[], None],
        label: tuple[str, str] | None = None,
        name: str | None = None,
        work: TaskWork | None = None,
    ) -> None:
        if self._error is not None:
            return  # a poisoned stream runs nothing more until reset, as on CUDA
        name = name or (label[0] if label else "unnamed work")
        backend = self.device.backend
        self.clock[self] = self.clock.get(self, 0) + 1
        if label is not None or work is not None:
            self._queue.put((_BEGIN, label, self.modelled_seconds(work)))
        self.issuing = (name, time.perf_counter())
        waited = self.device.waited_s
        try:
            with self.device.issuing(), faults.stalls_on(self.sleep):
                self._mode.run(fn, name)
        except BaseException as e:  # carried to whoever synchronizes, never swallowed
            e = as_device_error(e, self.device, name)
            self._error = e
            self._queue.put((_POISON, e))
            if not isinstance(e, Aborted):
                backend.report(e)
        finally:
            # what the issue held the device for: its Python, less its waits (the gate was open)
            issued_s = time.perf_counter() - self.issuing[1] - (self.device.waited_s - waited)
            self.issuing = None
        if label is not None:
            self._queue.put((_END, label, max(0.0, issued_s)))

    def _queue_modelled(self, seconds: float) -> None:
        """Queue ``seconds`` of modelled device work with no span of its own, after what is queued."""
        self._queue.put((_BEGIN, None, seconds))

    def modelled_seconds(self, work: TaskWork | None) -> float:
        """How long the stream's device takes for ``work`` beyond its kernels: nothing here (the
        kernels run for real); the virtual server's streams take it from the cost model."""
        return 0.0

    def begin_modelled(self, seconds: float) -> float:
        """The stream's thread: modelled work of ``seconds`` starts; returns when (now, here)."""
        return time.perf_counter()

    def waited_for(self, event: CpuEvent, since: float) -> None:
        """The stream's thread has waited for another stream's ``event`` since ``since``."""

    def stamp(self, event: CpuEvent) -> None:
        """The stream's thread is about to fire ``event``: note when it happened, if modelled."""

    def span_end(self) -> float:
        """The stream's thread has reached the end of a span: when the span ended (now, here)."""
        return time.perf_counter()

    def settle(self) -> None:
        """The stream's thread: before an event fires or a span ends, let the device's modelled time
        pass (nothing to wait for here: kernels run for real)."""

    def enqueue(self, kernel: Callable[[], None]) -> None:
        """Queue work the stream's thread runs in order (the issue mode's kernels)."""
        self._queue.put(kernel)

    def sleep(self, seconds: float) -> None:
        """Make the stream itself stall (a hung kernel), not the thread that issues to it."""
        self._queue.put((_SLEEP, seconds))

    def record_event(self) -> CpuEvent:
        ev = CpuEvent(self.device.backend, dict(self.clock))
        self._queue.put((_RECORD, ev))
        return ev

    def wait_event(self, event: Event) -> None:
        clock = self.clock
        for stream, t in event.clock.items():
            if t > clock.get(stream, 0):
                clock[stream] = t
        self._queue.put((_WAIT, event))

    def wait_until_issued(self) -> None:
        """Block the calling thread until the stream has run everything issued to it so far."""
        ev = self.record_event()
        ev.wait()
        if ev.error is not None:
            raise ev.error

    def describe(self) -> str:
        """What this stream is doing, for the watchdog's message."""
        now = time.perf_counter()
        parts = []
        issuing = self.issuing
        if issuing is not None:
            parts.append(f"issuing {issuing[0]} for {now - issuing[1]:.1f}s")
        cur = self.current
        parts.append("idle" if cur is None else f"{cur[0]} for {now - cur[1]:.1f}s")
        return f"{self.name} {', '.join(parts)}, {self._queue.qsize()} queued"

    # ------------------------------------------------------------------ the stream's thread
    def _loop(self) -> None:
        own_intra_op_threads(1)  # one intra-op thread per worker stream (docs/design.md §4)
        torch.set_grad_enabled(False)  # kernels compute; autograd happened when they were issued
        device = self.device
        backend = device.backend
        get = self._queue.get
        begun: tuple[str, float] | None = None
        while True:
            item = get()
            if type(item) is not tuple:  # a kernel
                if device.closed:
                    held = time.perf_counter()
                    device.wait_open()
                    if begun is not None:  # a span lasts as long as its kernels ran, not the gate
                        begun = (begun[0], begun[1] + time.perf_counter() - held)
                if self._failed is None:
                    try:
                        item()
                    except BaseException as e:
                        self._failed = e
                        backend.report(e)
                del item
                continue
            op = item[0]
            if op == _RECORD:
                self.settle()
                self.stamp(item[1])
                item[1].fire(self._failed)
            elif op == _BEGIN:
                if device.closed:
                    device.wait_open()
                if item[1] is None:  # modelled work without a span
                    self.begin_modelled(item[2])
                    continue
                begun = (item[1][0], self.begin_modelled(item[2]))
                self.current = (f"running {begun[0]}", begun[1])
            elif op == _END:
                self.settle()
                label = item[1]
                if begun is not None and begun[0] == label[0]:
                    if self.name == "compute":
                        faults.after_compute(self.device.name, begun[1])  # a slow fault (free when off)
                    if backend.recording:
                        t0 = backend.recording_origin
                        # The span covers the closure's issue too: its device's streams were
                        # held meanwhile (the issue gate), so issue and kernels are the task's cost
                        # here (on a GPU the issue overlaps the device's work, and spans are GPU time)
                        backend.record_span(
                            (self.device.index, self.name, label[0], label[1], begun[1] - self.issue_in_span * item[2] - t0,
                             self.span_end() - t0)
                        )  # fmt: skip
                begun, self.current = None, None
            elif op == _WAIT:
                if self._failed is None:
                    self.current = ("waiting for an event of another stream", time.perf_counter())
                    try:
                        item[1].wait()
                        if item[1].error is not None:
                            self._failed = item[1].error
                    except Aborted as e:
                        self._failed = e
                    self.waited_for(item[1], self.current[1])
                    self.current = None
            elif op == _POISON:
                if self._failed is None:
                    self._failed = item[1]
            elif op == _SLEEP:
                self.current = ("stalled", time.perf_counter())
                time.sleep(item[1])
                self.current = None
            elif op == _RESET:
                self._failed = None
                item[1].set()
            elif op == _STOP:
                return

    # ------------------------------------------------------------------ lifetime
    def reset(self) -> None:
        """Drain the stream (waits cut short by the abort) and clear its errors."""
        done = threading.Event()
        self._queue.put((_RESET, done))
        done.wait()
        self._error = None

    def stop(self, timeout: float | None = None) -> None:
        """End the stream's thread once its queue is done (``timeout``: stop waiting for a kernel
        that never returns; the daemon thread then ends with the process)."""
        self._queue.put((_STOP, None))
        self._thread.join(timeout)


STOP_TIMEOUT_S = 10.0  # how long close waits for a stream's running kernel to return
ALLOCATING_STREAMS = 2  # the streams whose closures allocate device memory: compute, and h2d for hand-offs


class CpuDevice(Device):
    stream_class: type[CpuStream] = CpuStream
    prefix = "cpu"

    def __init__(self, backend: CpuBackend, index: int, capacity: int | None, rules: AllocatorRules | None):
        name = f"{self.prefix}:{index}"
        super().__init__(backend, index, name, torch.device("cpu"), backend.sanitizer)
        self.allocator = CachingAllocator(
            self,
            capacity,
            rules or AllocatorRules.for_capacity(capacity),
            registry=backend.blocks,
            on_sync=lambda what: backend.host_syncs.add(what, call_site()),
            on_free=backend.sanitizer.check_free,
        )
        self.memory = AllocatorMemory(self.allocator)
        # The issue gate: while a closure of this device is being issued (Python work on the worker
        # thread), its streams' threads hold back their kernels, and run them while the worker waits
        # or does anything else. Both are Python threads: run together, every operation's release of
        # the GIL would hand it over between them, which costs more than the work itself.
        self._gate = threading.Condition()
        self.closed = 0  # closures being issued now (worker threads of this device)
        self.waited_s = 0.0  # seconds closures of this device spent waiting with the gate open
        self.streams = {n: self.stream_class(self, n, STREAM_PRIORITIES[n]) for n in STREAM_NAMES}

    @contextmanager
    def issuing(self):
        """Around a closure's issue on the calling thread (``CpuStream.submit``): the gate is closed,
        unless the thread is issuing another closure of this device already (a closure may submit)."""
        if getattr(_issuer, "device", None) is self:
            yield
            return
        outer = getattr(_issuer, "device", None)
        backend = self.backend
        with backend.issue_token.held(lambda: backend.aborted):
            _issuer.device = self
            self._close()
            try:
                yield
            finally:
                self._open()
                _issuer.device = outer

    def waiting(self):
        """A closure of this device about to wait for another thread (``waiting``)."""
        return waiting()

    def _close(self) -> None:
        with self._gate:
            self.closed += 1

    def _open(self) -> None:
        with self._gate:
            self.closed -= 1
            if not self.closed:
                self._gate.notify_all()

    def wait_open(self) -> None:
        """A stream's thread: wait until no closure of this device is being issued."""
        with self._gate:
            while self.closed and not self.backend.aborted:
                self._gate.wait(0.05)

    def free_bytes(self) -> int | None:
        """The capacity less the bytes allocated on the device and the allocator's slack (its cached
        segments count as free, as on CUDA; None without a capacity: unbounded)."""
        capacity = self.memory.capacity
        if capacity is None:
            return None
        return max(0, capacity - self.memory.in_use - self.allocation_slack())

    def allocation_slack(self) -> int:
        """What the caching allocator may reserve beyond the bytes a plan counts: a partly used
        segment of each size per stream that allocates (``AllocatorRules.overhead``)."""
        return self.allocator.rules.overhead(ALLOCATING_STREAMS)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.count_in(host)
        out = torch.empty(host.shape, dtype=dtype or host.dtype)  # device memory (the allocator's)
        out.copy_(host)
        return out

    def to_host(self, dev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.count_out(dev)
        with host_allocation():
            out = self.backend.host_empty(dev.shape, dtype or dev.dtype)
        out.copy_(dev)
        return out

    def hand_over(self, t: torch.Tensor, stream: Stream) -> None:
        self.backend.sanitizer.hand_over(t, stream)

    @contextmanager
    def seeded(self, seed: int):
        # The block's random kernels draw from their own generator, in stream order, and its random
        # host work from another, at issue: no lock is held while the work is issued, and a
        # recomputation issued with the same seed draws the same.
        device, host = torch.Generator(), torch.Generator()
        device.manual_seed(seed)
        host.manual_seed(host_seed(seed))
        with task_generator(device, host):
            yield


class CpuBackend(Backend):
    """``cpu:N``: N virtual devices, each with its own stream threads, allocator and memory ledger."""

    name = "cpu"
    device_class: type[CpuDevice] = CpuDevice
    # torch's grouped matmul reads its offsets on the host except on the fast path of some GPUs
    # (backend/grouped_mm.py); cpu:N stands for none in particular, so it counts the sync.
    grouped_mm_fast_path = False

    def needs_values(self, what: str) -> None:
        """The issue mode is about to read device values on the host (``what``): a virtual run has
        none and refuses (``VirtualBackend``); here they exist."""

    def __init__(
        self,
        num_devices: int,
        capacity: int | None = None,
        sanitize: bool | None = None,
        rules: AllocatorRules | None = None,
    ):
        self.aborted = False
        self.errors: list[BaseException] = []
        self.sticky: BaseException | None = None  # a sticky device error (``testing.faults``)
        if sanitize is None:
            sanitize = os.environ.get("ROUNDPIPE_SANITIZE", "") not in ("", "0")
        self.blocks: dict = {}  # storage data ptr -> allocated block, every device
        self.known = threading.local()  # per thread: what it has seen run (``known_clock``)
        self.sanitizer = Sanitizer(checking=bool(sanitize), blocks=self.blocks)
        self.host_syncs = HostSyncs()
        self.devices = [self.device_class(self, i, capacity, rules) for i in range(num_devices)]

    def completed_clock(self, event) -> dict | None:
        """The vector clock of what is known to have run when ``event`` has happened (None: what the
        calling thread has seen run); None for an event that carries no clock."""
        if event is None:
            return known_clock(self)
        return getattr(event, "clock", None)

    def block_of(self, t: torch.Tensor):
        """The device block ``t`` lives in (None: host memory)."""
        return self.blocks.get(t.untyped_storage().data_ptr())

    def check_empty(self) -> None:
        self.sanitizer.raise_violations()
        for dev in self.devices:
            held = self.sanitizer.held(dev)
            if held:
                listed = "; ".join(r.describe() for r in held[:5])
                more = f" and {len(held) - 5} more" if len(held) > 5 else ""
                raise StreamProtocolError(
                    f"{dev.name} still holds {len(held)} tensors ({sum(r.size for r in held):,} bytes) "
                    f"after the step: {listed}{more}. Workers are stateless: release everything a "
                    "step put on a device before it ends"
                )

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        PINNED.track(t)  # CUDA copies it into a new page-locked tensor; here it stands for one
        return t

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.host_buffers is not None:
            return self.host_buffers.acquire(tuple(shape), dtype)
        t = torch.empty(shape, dtype=dtype)  # pinned on CUDA
        PINNED.track(t)
        return t

    def register_host(self, t: torch.Tensor) -> None:
        PINNED.register(t)

    def unregister_host(self, t: torch.Tensor) -> None:
        PINNED.unregister(t)

    def start_recording(self) -> None:
        self._span_lock = threading.Lock()
        self.recording_origin = time.perf_counter()
        super().start_recording()

    def record_span(self, span: tuple) -> None:
        with self._span_lock:
            self._spans.append(span)

    def abort(self) -> None:
        self.aborted = True

    def synchronized(self) -> None:
        """Every stream has run everything issued to it (the host waited for all of them, as after
        ``torch.cuda.synchronize``): from now on all that work is ordered before anything issued."""
        streams = [s for dev in self.devices for s in dev.streams.values()]
        merged: dict = {}
        for s in streams:
            for other, t in s.clock.items():
                if t > merged.get(other, 0):
                    merged[other] = t
        for s in streams:
            s.clock.update(merged)

    def report(self, error: BaseException) -> None:
        cause = error
        while cause is not None and self.sticky is None:
            if getattr(cause, "sticky", False):
                self.sticky = cause  # as a sticky CUDA error: nothing runs on this backend again
            cause = cause.__cause__
        super().report(error)

    def reset(self) -> None:
        if self.sticky is not None:  # CUDA's reset synchronizes the device, which raises again
            raise RuntimeError(
                f"the device cannot be reset after a sticky error ({self.sticky}); as with a CUDA error "
                "such as an illegal memory access, nothing can run on it in this process again"
            )
        # Drain while still aborted, so a stream stuck on an event that will never fire lets go.
        for dev in self.devices:
            for s in dev.streams.values():
                s.reset()
        self.synchronized()
        self.sanitizer.abandon()
        self.aborted = False
        self.errors = []

    def close(self) -> None:
        self.aborted = True
        for dev in self.devices:
            for s in dev.streams.values():
                s.stop(timeout=STOP_TIMEOUT_S)  # a kernel stuck for good (a stalled worker) stays behind
