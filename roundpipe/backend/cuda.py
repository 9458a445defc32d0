"""CUDA devices: real streams with priorities, real events, pinned host memory.

All CUDA calls of roundpipe live in this file. ``submit`` runs the closure at once on the calling
(worker) thread with the stream current, so its kernels queue asynchronously on that stream. A
spec like ``cuda:0x2`` makes two workers share one GPU (each with its own streams), which lets the
multi-worker protocol be tested on a single card.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch

from roundpipe.backend.base import (
    STREAM_NAMES,
    STREAM_PRIORITIES,
    Backend,
    Device,
    DeviceMemory,
    Event,
    Stream,
    TaskWork,
    as_device_error,
    host_seed,
)
from roundpipe.backend.cpu_allocator import CUDA_RULES
from roundpipe.backend.issue_token import ISSUE_TOKEN
from roundpipe.partition.memory import cublas_reserve_bytes

ALLOCATING_STREAMS = 2  # the streams whose closures allocate device memory: compute, and h2d for hand-offs


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

    def submit(
        self,
        fn: Callable[[], None],
        label: tuple[str, str] | None = None,
        name: str | None = None,
        work: TaskWork | None = None,
    ) -> None:
        if self._error is not None:
            return
        backend = self.device.backend
        timed = label is not None and backend.recording
        try:
            with backend.issue_token.held(lambda: backend.aborted), torch.cuda.stream(self.stream):
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                fn()
                if timed:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(self.stream)
                    backend._pending_spans.append((self.device, self.name, label, start, end))
        except BaseException as e:  # same semantics as the cpu backend: poison, carry to the waiter
            e = as_device_error(e, self.device, name or (label[0] if label else "work on " + self.name))
            self._error = e
            self.device.backend.report(e)

    def record_event(self) -> CudaEvent:
        # blocking: a host thread that synchronizes on it sleeps until the GPU gets there. A default
        # event's cudaEventSynchronize spins, and up to nine threads (workers, host queue, copy
        # lanes) waiting so burn the cores the CPU optimizer needs.
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.stream)
        return CudaEvent(ev, self._error)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        if event.error is not None and self._error is None:
            self._error = event.error
        self.stream.wait_event(event.event)


class CudaMemory(DeviceMemory):
    """What the caching allocator has handed out on the GPU (``torch.cuda.memory_allocated``).

    Workers sharing a GPU (``cuda:0x2``) share these figures: the allocator does not tell them apart.
    A block freed while another stream still uses it (``record_stream``) stays counted until that
    stream is done, so this is what the GPU really holds.
    """

    def __init__(self, gpu: torch.device, capacity: int):
        self.gpu = gpu
        self.capacity = capacity

    @property
    def in_use(self) -> int:
        return torch.cuda.memory_allocated(self.gpu)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.gpu)

    @property
    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.gpu)

    @property
    def reserved_peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.gpu)

    def stats(self) -> dict:
        s = torch.cuda.memory_stats(self.gpu)
        return {
            "allocated_bytes": s.get("allocated_bytes.all.current", 0),
            "allocated_bytes_peak": s.get("allocated_bytes.all.peak", 0),
            "requested_bytes": s.get("requested_bytes.all.current", 0),
            "requested_bytes_peak": s.get("requested_bytes.all.peak", 0),
            "reserved_bytes": s.get("reserved_bytes.all.current", 0),
            "reserved_bytes_peak": s.get("reserved_bytes.all.peak", 0),
            "active_bytes": s.get("active_bytes.all.current", 0),
            "active_bytes_peak": s.get("active_bytes.all.peak", 0),
            "segments": s.get("segment.all.current", 0),
            "segment_allocations": s.get("segment.all.allocated", 0),
            "num_alloc_retries": s.get("num_alloc_retries", 0),
            "num_ooms": s.get("num_ooms", 0),
        }

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.gpu)


class CudaDevice(Device):
    def __init__(self, backend: CudaBackend, index: int, gpu: int, capacity: int | None):
        name = f"cuda:{gpu}" if backend.workers_per_gpu == 1 else f"cuda:{gpu}#{index}"
        torch_device = torch.device("cuda", gpu)
        if capacity is None:  # what is free now, not the card's total: other processes hold some
            free, _total = torch.cuda.mem_get_info(torch_device)
            capacity = (free + torch.cuda.memory_reserved(torch_device)) // backend.workers_per_gpu
        super().__init__(backend, index, name, torch_device)
        self.memory = CudaMemory(torch_device, capacity)
        self.streams = {n: CudaStream(self, n, STREAM_PRIORITIES[n]) for n in STREAM_NAMES}

    def waiting(self):
        """A closure about to wait for another thread: the issue token is free meanwhile."""
        backend = self.backend
        return backend.issue_token.released(lambda: backend.aborted)

    def free_bytes(self) -> int:
        """What the driver has free on the GPU plus what the caching allocator holds for this
        process unused (roundpipe's own cached blocks are usable), shared out among the workers
        of the GPU, less the allocator's slack."""
        gpu = self.torch_device
        free, _total = torch.cuda.mem_get_info(gpu)
        cached = torch.cuda.memory_reserved(gpu) - torch.cuda.memory_allocated(gpu)
        return max(0, (free + max(0, cached)) // self.backend.workers_per_gpu - self.allocation_slack())

    def allocation_slack(self) -> int:
        """Partly used segments of the caching allocator (``AllocatorRules.overhead``, CUDA's
        constants) for each stream that allocates, and cuBLAS's workspaces on this worker's compute
        stream (``partition.memory.cublas_reserve_bytes``: two, for this GPU's architecture and the
        process environment), which the allocator hands out at the first matmul of each thread and
        keeps. Counted whether or not they exist yet (once they do, free bytes already lack them)."""
        capability = torch.cuda.get_device_capability(self.torch_device)
        return CUDA_RULES.overhead(ALLOCATING_STREAMS) + cublas_reserve_bytes(capability, env=os.environ)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.count_in(host)
        out = host.to(self.torch_device, non_blocking=True)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def to_host(self, dev: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.count_out(dev)
        src = dev if dtype is None or dtype == dev.dtype else dev.to(dtype)
        out = self.backend.host_empty(src.shape, src.dtype)
        out.copy_(src, non_blocking=True)
        return out

    def hand_over(self, t: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, CudaStream)
        t.record_stream(stream.stream)

    def seeded(self, seed: int):
        return self.backend.generators.seeded(
            self.torch_device.index,
            torch.cuda.default_generators[self.torch_device.index],
            torch.default_generator,
            seed,
        )


class GeneratorLocks:
    """Who may seed which generator while a layer is issued (``CudaDevice.seeded``).

    A layer's random kernels draw from its GPU's default generator when they are *issued* (a CUDA
    generator's state is its seed and Philox offset, kept on the host; a launch takes its offset
    then), and its host draws (peft LoHa's ``torch.rand(1)``) from the CPU's default generator, also
    at issue. Both are shared: a GPU's generator by the workers of that GPU (``cuda:0x2``), the CPU's
    by every worker of the process. So a seeded block holds, while its layer is issued:

    - the lock of its *physical GPU*'s generator: workers of different GPUs never wait for each
      other; workers sharing a GPU must, since torch offers no second generator that kernels take
      by default (the cpu backend gives every block its own through its dispatch mode, a cost per
      operation CUDA's issue should not pay);
    - the CPU generator's lock only while it is not known that the model draws nothing on the host.
      Until the first step has completed (``every_layer_seeded``) every block takes it and notes
      whether its layer moved the CPU generator; if none did, later blocks leave the CPU generator
      alone and take no lock shared across GPUs. A model that draws on the host keeps taking it:
      its issue of random layers stays serialised across GPUs, the price of a process-wide
      generator.

    The states are saved and restored directly (no device work, no sync), which is cheaper than
    ``fork_rng``'s device bookkeeping per layer. Generators are passed in, so that the rule is
    tested without a GPU (``tests/test_generator_locks.py``).
    """

    def __init__(self, gpus):
        self.gpu = {gpu: threading.RLock() for gpu in gpus}
        self.host = threading.RLock()
        self.host_draws: bool | None = None  # None: not known until a step has seeded every layer

    @contextmanager
    def seeded(self, gpu: int, device_generator, host_generator, seed: int):
        with self.gpu[gpu]:
            saved = device_generator.get_state()
            device_generator.manual_seed(seed)
            try:
                if self.host_draws is False:
                    yield
                else:
                    with self._host_seeded(host_generator, host_seed(seed)):
                        yield
            finally:
                device_generator.set_state(saved)

    @contextmanager
    def _host_seeded(self, generator, seed: int):
        with self.host:
            saved = generator.get_state()
            generator.manual_seed(seed)
            seeded = generator.get_state()
            try:
                yield
            finally:
                if not torch.equal(generator.get_state(), seeded):
                    self.host_draws = True
                generator.set_state(saved)

    def every_layer_seeded(self) -> None:
        """A step has completed, so every training-mode layer has been issued in a seeded block:
        what they draw on the host is known."""
        if self.host_draws is None:
            self.host_draws = False


def use_expandable_segments() -> bool:
    """Turn on the caching allocator's expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` says
    otherwise; True when they are on. Stages of different sizes allocated one after another leave
    fixed segments that no later, larger stage fits (reserved bytes grow past what is allocated
    until the retry path synchronizes the device and frees them); an expandable segment per pool
    serves any request its free space fits. The cpu backend models the same (``cpu_allocator``)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError) as e:  # an older torch, or a platform without them
        warnings.warn(
            f"expandable segments could not be turned on ({e}): fixed segments", RuntimeWarning, stacklevel=2
        )
        return False
    return True


class CudaBackend(Backend):
    """``cuda``, ``cuda:0,1`` or ``cuda:0x2`` (two workers on GPU 0)."""

    name = "cuda"
    issue_token = ISSUE_TOKEN  # workers issue from Python beside each other (issue_token.py)

    def __init__(self, gpus: list[int], workers_per_gpu: int = 1, capacity: int | None = None):
        self.workers_per_gpu = workers_per_gpu
        self.aborted = False
        self.errors: list[BaseException] = []
        self.generators = GeneratorLocks(set(gpus))
        self._fp16_accumulation_before: bool | None = None  # the process setting to restore on close
        self.expandable_segments = use_expandable_segments()
        self.devices = [
            CudaDevice(self, i, gpu, capacity)
            for i, gpu in enumerate(g for g in gpus for _ in range(workers_per_gpu))
        ]

    def step_completed(self) -> None:
        self.generators.every_layer_seeded()

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.host_buffers is not None:
            return self.host_buffers.acquire(tuple(shape), dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock ``t``'s bytes in place with ``cudaHostRegister`` (exact size, no rounding).

        ``cudaHostRegisterPortable`` (1): pinned for every device's context, as workers on several
        GPUs copy from the same host block. Untested on a GPU as written.
        """
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("register_host needs a contiguous CPU tensor (a whole host allocation)")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 1))
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes at {t.data_ptr():#x} failed with cudaError {err} "
                "(2: out of memory -- the host cannot lock that much, check free RAM and `ulimit -l`; "
                "712: already registered; 801: not supported on this platform); "
                "RunConfig(host_memory='pinned' or 'pageable') does without cudaHostRegister"
            )

    def unregister_host(self, t: torch.Tensor) -> None:
        """Undo ``register_host`` (before the memory is freed, after every copy from it has finished)."""
        if t.numel() * t.element_size() == 0:
            return
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostUnregister(t.data_ptr()))
        if err != 0:
            raise RuntimeError(
                f"cudaHostUnregister of host memory at {t.data_ptr():#x} failed with cudaError {err} "
                "(713: it was not registered with register_host)"
            )

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

    def use_fp16_accumulation(self) -> None:
        """Set ``torch.backends.cuda.matmul.allow_fp16_accumulation`` (process-wide) until close;
        warn where the installed torch does not have it (added in torch 2.7)."""
        matmul = torch.backends.cuda.matmul
        if not hasattr(matmul, "allow_fp16_accumulation"):
            warnings.warn(
                f"torch {torch.__version__} has no torch.backends.cuda.matmul.allow_fp16_accumulation "
                "(torch >= 2.7 does): fp16 matmuls keep accumulating in fp32",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if self._fp16_accumulation_before is None:
            self._fp16_accumulation_before = matmul.allow_fp16_accumulation
        matmul.allow_fp16_accumulation = True

    def close(self) -> None:
        if self._fp16_accumulation_before is not None:
            torch.backends.cuda.matmul.allow_fp16_accumulation = self._fp16_accumulation_before
            self._fp16_accumulation_before = None
        for dev in self.devices:
            torch.cuda.synchronize(dev.torch_device)
