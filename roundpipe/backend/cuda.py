"""CUDA devices: real streams with priorities, real events, pinned host memory.

All CUDA calls of roundpipe live in this file. ``submit`` runs the closure at once on the calling
(worker) thread with the stream current, so its kernels queue asynchronously on that stream. A
spec like ``cuda:0x2`` makes two workers share one GPU (each with its own streams), which lets the
multi-worker protocol be tested on a single card.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch

from roundpipe.backend.base import STREAM_NAMES, STREAM_PRIORITIES, Backend, Device, Event, Stream


class CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event, error: BaseException | None = None):
        self.event = event
        self.error = error

    def synchronize(self) -> None:
        if self.error is not None:
            raise self.error
        self.event.synchronize()

    def query(self) -> bool:
        return self.error is not None or self.event.query()


class CudaStream(Stream):
    def __init__(self, device: CudaDevice, name: str, priority: int):
        super().__init__(device, name, priority)
        with torch.cuda.device(device.torch_device):
            self.stream = torch.cuda.Stream(device=device.torch_device, priority=priority)
        self._error: BaseException | None = None

    def submit(self, fn: Callable[[], None], label: tuple[str, str] | None = None) -> None:
        if self._error is not None:
            return
        backend = self.device.backend
        timed = label is not None and backend.recording
        try:
            with torch.cuda.stream(self.stream):
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                fn()
                if timed:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(self.stream)
                    backend._pending_spans.append((self.device, self.name, label, start, end))
        except BaseException as e:  # same semantics as the cpu backend: poison, carry to the waiter
            self._error = e
            self.device.backend.report(e)

    def record_event(self) -> CudaEvent:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return CudaEvent(ev, self._error)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        if event.error is not None and self._error is None:
            self._error = event.error
        self.stream.wait_event(event.event)


class CudaDevice(Device):
    def __init__(self, backend: CudaBackend, index: int, gpu: int, capacity: int | None):
        name = f"cuda:{gpu}" if backend.workers_per_gpu == 1 else f"cuda:{gpu}#{index}"
        if capacity is None:
            capacity = torch.cuda.get_device_properties(gpu).total_memory // backend.workers_per_gpu
        super().__init__(backend, index, name, torch.device("cuda", gpu), capacity)
        self.streams = {n: CudaStream(self, n, STREAM_PRIORITIES[n]) for n in STREAM_NAMES}

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.bytes_in += host.numel() * host.element_size()
        out = host.to(self.torch_device, non_blocking=True)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def to_host(self, dev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.bytes_out += dev.numel() * dev.element_size()
        src = dev if dtype is None or dtype == dev.dtype else dev.to(dtype)
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        out.copy_(src, non_blocking=True)
        return out

    def hand_over(self, t: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, CudaStream)
        t.record_stream(stream.stream)

    @contextmanager
    def seeded(self, seed: int):
        with self.backend.rng_lock, torch.random.fork_rng(devices=[self.torch_device.index]):
            torch.manual_seed(seed)
            yield


class CudaBackend(Backend):
    """``cuda``, ``cuda:0,1`` or ``cuda:0x2`` (two workers on GPU 0)."""

    name = "cuda"

    def __init__(self, gpus: list[int], workers_per_gpu: int = 1, capacity: int | None = None):
        self.workers_per_gpu = workers_per_gpu
        self.aborted = False
        self.errors: list[BaseException] = []
        self.rng_lock = threading.RLock()
        self.devices = [
            CudaDevice(self, i, gpu, capacity)
            for i, gpu in enumerate(g for g in gpus for _ in range(workers_per_gpu))
        ]

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def start_recording(self) -> None:
        """Timing events mark each labelled work; an origin event per device anchors them."""
        self._pending_spans = []
        self._origins = {}
        for dev in self.devices:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(dev.streams["compute"].stream)
            self._origins[dev.index] = ev
        super().start_recording()

    def collect_spans(self) -> list[tuple[int, str, str, str, float, float]]:
        for dev in self.devices:
            torch.cuda.synchronize(dev.torch_device)
        for dev, lane, label, start, end in self._pending_spans:
            origin = self._origins[dev.index]
            self._spans.append(
                (
                    dev.index,
                    lane,
                    label[0],
                    label[1],
                    origin.elapsed_time(start) / 1e3,
                    origin.elapsed_time(end) / 1e3,
                )
            )
        self._pending_spans = []
        return super().collect_spans()

    def reset(self) -> None:
        for dev in self.devices:
            torch.cuda.synchronize(dev.torch_device)
            for s in dev.streams.values():
                s._error = None
        self.aborted = False
        self.errors = []

    def close(self) -> None:
        for dev in self.devices:
            torch.cuda.synchronize(dev.torch_device)
