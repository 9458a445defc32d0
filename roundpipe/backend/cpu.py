"""Virtual devices on the CPU: the backend every test runs on, faithful to CUDA's rules.

Each stream is a thread draining a FIFO of closures, so work on different streams and devices
really runs concurrently and really waits on events; copies are real copies. Every closure runs
under the stream sanitizer (``sanitizer.py``), which measures the device memory that is alive
(``DeviceOutOfMemory`` past the capacity) and, with checking on (``sanitize=True`` or
``ROUNDPIPE_SANITIZE=1``, as in every test), rejects what CUDA's caching allocator and stream
semantics would break: a tensor used on a stream it was not handed over to, an access not ordered
by an event. An error raised by a closure poisons its stream: later events recorded on it, and
streams that wait on those events, fail with the same error, as a sticky CUDA error would.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch

from roundpipe.backend.base import STREAM_NAMES, STREAM_PRIORITIES, Backend, Device, Event, Stream
from roundpipe.backend.sanitizer import LiveMemory, Sanitizer, StreamMode, host_allocation
from roundpipe.errors import StreamProtocolError
from roundpipe.testing import faults


class Aborted(RuntimeError):
    """A wait was cut short because the pipeline is shutting down after another failure."""


class CpuEvent(Event):
    def __init__(self, backend: CpuBackend):
        self._backend = backend
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.clock: dict = {}  # the recording stream's vector clock when it fired (sanitizer)

    def fire(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        while not self._done.wait(0.05):
            if self._backend.aborted:
                raise Aborted("wait abandoned: the pipeline is aborting")

    def synchronize(self) -> None:
        self.wait()
        if self.error is not None:
            raise self.error


_STOP = object()


class CpuStream(Stream):
    def __init__(self, device: CpuDevice, name: str, priority: int):
        super().__init__(device, name, priority)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.current: tuple[str, float] | None = None  # what the thread is doing now, since when
        self.clock: dict[CpuStream, int] = {}  # vector clock: closures of each stream ordered before now
        self._mode = StreamMode(self, device.backend.sanitizer) if device.backend.watching else None
        self._thread = threading.Thread(
            target=self._loop, name=f"roundpipe-{device.name}-{name}", daemon=True
        )
        self._thread.start()

    def submit(
        self, fn: Callable[[], None], label: tuple[str, str] | None = None, name: str | None = None
    ) -> None:
        self._queue.put(("run", (fn, label, name or (label[0] if label else "unnamed work"))))

    def record_event(self) -> CpuEvent:
        ev = CpuEvent(self.device.backend)
        self._queue.put(("record", ev))
        return ev

    def wait_event(self, event: Event) -> None:
        self._queue.put(("wait", event))

    def describe(self) -> str:
        """What this stream is doing, for the watchdog's message."""
        cur = self.current
        now = "idle" if cur is None else f"{cur[0]} for {time.perf_counter() - cur[1]:.1f}s"
        return f"{self.name} {now}, {self._queue.qsize()} queued"

    def stop(self, timeout: float | None = None) -> None:
        """End the stream's thread once its queue is done (``timeout``: stop waiting for a closure
        that never returns; the daemon thread then ends with the process)."""
        self._queue.put((_STOP, None))
        self._thread.join(timeout)

    def _loop(self) -> None:
        torch.set_num_threads(1)  # one intra-op thread per worker stream (docs/design.md §4)
        while True:
            op, arg = self._queue.get()
            if op is _STOP:
                return
            self.current = None
            if op == "record":
                arg.clock = dict(self.clock)
                arg.fire(self._error)
            elif self._error is not None:
                # A poisoned stream skips work until it is reset, and drops the closure now: kept
                # in ``arg`` while the loop waits for the next one, what it captured (device tensors
                # of the failed step) would stay alive until the next step.
                arg = None
                continue
            elif op == "wait":
                self.current = ("waiting for an event of another stream", time.perf_counter())
                try:
                    arg.wait()
                    if arg.error is not None:
                        self._error = arg.error
                    for stream, t in arg.clock.items():
                        if t > self.clock.get(stream, 0):
                            self.clock[stream] = t
                except Aborted as e:
                    self._error = e
            else:
                fn, label, name = arg
                del arg
                backend = self.device.backend
                start = time.perf_counter()
                self.current = (f"running {name}", start)
                try:
                    if self._mode is None:
                        fn()
                    else:
                        self._mode.run(fn, name)
                except BaseException as e:  # carried to whoever synchronizes, never swallowed
                    self._error = e
                    if not isinstance(e, Aborted):
                        backend.report(e)
                del fn  # what the closure captured must not outlive it (live memory counts it)
                if label is not None and self.name == "compute":
                    faults.after_compute(self.device.name, start)  # a slow fault (free when off)
                if label is not None and backend.recording:
                    t0 = backend.recording_origin
                    backend.record_span(
                        (
                            self.device.index,
                            self.name,
                            label[0],
                            label[1],
                            start - t0,
                            time.perf_counter() - t0,
                        )
                    )

    def reset(self) -> None:
        self.synchronize_quietly()
        self._error = None

    def synchronize_quietly(self) -> None:
        ev = self.record_event()
        ev._done.wait()


STOP_TIMEOUT_S = 10.0  # how long close waits for a stream's running closure to return


class PinnedBytes:
    """Host bytes the cpu backend has handed out as page-locked (what CUDA would pin: ``pin``, a
    download buffer, a ``register_host``-ed block) that are still alive, process-wide.

    Measured, not kept by hand: a pinned tensor counts until it is garbage (a weak reference's
    finalizer), a registered block until ``unregister_host``. ``alive`` after every pipeline is
    closed is what a leak would leave (``tests/test_faults.py``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._tracked = 0
        self._registered: dict[int, int] = {}  # data_ptr -> bytes

    @property
    def alive(self) -> int:
        with self._lock:
            return self._tracked + sum(self._registered.values())

    def track(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        with self._lock:
            self._tracked += n
        weakref.finalize(t, self._untrack, n)

    def _untrack(self, n: int) -> None:
        with self._lock:
            self._tracked -= n

    def register(self, t: torch.Tensor) -> None:
        with self._lock:
            self._registered[t.data_ptr()] = t.numel() * t.element_size()

    def unregister(self, t: torch.Tensor) -> None:
        with self._lock:
            self._registered.pop(t.data_ptr(), None)


PINNED = PinnedBytes()


class CpuDevice(Device):
    def __init__(self, backend: CpuBackend, index: int, capacity: int | None):
        name = f"cpu:{index}"
        super().__init__(backend, index, name, torch.device("cpu"), backend.sanitizer)
        self.memory = LiveMemory(name, capacity, measured=backend.watching)
        self.streams = {n: CpuStream(self, n, STREAM_PRIORITIES[n]) for n in STREAM_NAMES}

    def free_bytes(self) -> int | None:
        """The capacity less the bytes alive on the device (None without a capacity: unbounded)."""
        capacity = self.memory.capacity
        return None if capacity is None else max(0, capacity - self.memory.in_use)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.count_in(host)
        out = torch.empty(host.shape, dtype=dtype or host.dtype)  # device memory: the sanitizer sees it
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
        # The CPU generator is process-wide, so virtual devices take turns while seeded.
        with self.backend.rng_lock, torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # the CPU's only, not a GPU's if there is one
            yield


class CpuBackend(Backend):
    """``cpu:N``: N virtual devices, each with its own stream threads and memory ledger."""

    name = "cpu"

    def __init__(self, num_devices: int, capacity: int | None = None, sanitize: bool | None = None):
        self.aborted = False
        self.errors: list[BaseException] = []
        self.rng_lock = threading.RLock()
        if sanitize is None:
            sanitize = os.environ.get("ROUNDPIPE_SANITIZE", "") not in ("", "0")
        self.sanitizer = Sanitizer(checking=sanitize)
        # Watching every operation costs (Python sees each op: up to 2x on tiny layers, and the
        # workers then contend for the GIL), so it is on only when something depends on it: the
        # checks, or a capacity to enforce. Otherwise device memory is not measured (peak: None).
        self.watching = bool(sanitize) or capacity is not None
        self.devices = [CpuDevice(self, i, capacity) for i in range(num_devices)]

    def check_empty(self) -> None:
        for dev in self.devices:
            held = self.sanitizer.held(dev)
            if held:
                listed = "; ".join(r.describe() for r in held[:5])
                more = f" and {len(held) - 5} more" if len(held) > 5 else ""
                raise StreamProtocolError(
                    f"{dev.name} still holds {len(held)} tensors ({sum(r.nbytes for r in held):,} bytes) "
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

    def reset(self) -> None:
        # Drain while still aborted, so a stream stuck on an event that will never fire lets go.
        for dev in self.devices:
            for s in dev.streams.values():
                s.reset()
        self.sanitizer.abandon()
        self.aborted = False
        self.errors = []

    def close(self) -> None:
        self.aborted = True
        for dev in self.devices:
            for s in dev.streams.values():
                s.stop(timeout=STOP_TIMEOUT_S)  # a closure stuck for good (a stalled worker) stays behind
