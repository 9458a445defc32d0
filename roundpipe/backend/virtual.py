"""The virtual server: the real runtime, unchanged, at full model size, on GPU-scale time and memory.

``RunConfig(devices="virtual:8xrtx4090")`` (any hardware spec ``roundpipe.presets.load_hardware``
takes: ``virtual:rtx4090``, ``virtual:4xh200``) runs the runtime's own code on the cpu backend's
machinery, on CUDA's clock (``cpu_clock.py``): closures run at issue on the worker threads, their
operations allocate from the caching-allocator model at the preset's capacity, host syncs are
counted. What differs is that **no data exists and no kernel runs**:

- **Tensors.** Host tensors of a virtual run (the parameter store, the hand-off buffers) are meta
  tensors: shapes and dtypes, no bytes (``host_device``). Device tensors are views of the
  allocator's segments, address ranges the kernel never backs with memory because nothing writes
  them. So a 32B model runs on a machine with a fraction of its size in RAM.
- **Time.** Each stream's thread keeps its device's clock in real time: a compute task lasts what
  the cost model (``partition/cost.py``, calibrated on the RTX 4090's measured layers) says for its
  layers and microbatch, through the simulator's own rule (``sim.workload.op_seconds``); a copy lasts
  its bytes over the GPU's host link, one copy at a time per direction (one copy engine each way)
  and sharing the PCIe switch's uplink with the GPUs behind it. A stream's thread waits that time
  out in ``time.sleep`` (no GIL held), so the Python the runtime spends issuing is measured for real
  on top. Host work on meta tensors (gradient accumulation, the optimizer) costs its bytes at the
  server's host memory bandwidth times ``optimizer_efficiency`` (``HostWork``).
- **Memory.** The caching-allocator model (``cpu_allocator.py``) with CUDA's rules at the GPU's
  capacity less the preset's workspace reserve: running out is the same ``DeviceOutOfMemory``.
- **Data.** Anything that needs a value (a host sync on a device tensor, a data-dependent shape such
  as MoE routing, reading a meta host tensor) raises :class:`~roundpipe.errors.VirtualDataError`
  naming the operation, unless it is modelled; what is modelled is listed in ``docs/virtual.md``.

The layer costs come from the model's config (``attach``): the Pipeline hands the backend its
adapter's model and run settings once the model is wrapped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.backend.base import TaskWork
from roundpipe.backend.cpu import CpuBackend, CpuDevice, CpuEvent, CpuStream
from roundpipe.backend.cpu_allocator import AllocatorRules
from roundpipe.backend.cpu_kernels import Kernel, KernelRef
from roundpipe.backend.grouped_mm import fast_path_on
from roundpipe.backend.issue_token import ISSUE_TOKEN
from roundpipe.errors import ConfigError, VirtualDataError
from roundpipe.presets import Server, load_hardware
from roundpipe.sim.variability import TaskNoise, check_variability

_COPY = torch.ops.aten.copy_.default
_META = torch.device("meta")


class Link:
    """One direction of a link that carries one copy at a time at ``bandwidth`` bytes/s (a GPU's
    copy engine on its PCIe link), or a budget of bytes shared in arrival order (a switch uplink)."""

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.free_at = 0.0  # perf_counter time at which the link is free again
        self.busy_s = 0.0  # seconds it carried copies


class Links:
    """Every link of the server: per GPU and direction its copy engine, per PCIe switch and
    direction its uplink. ``transfer`` books one copy and says when it ends.

    A copy of ``n`` bytes starting at ``t`` (its stream's turn) takes its engine from
    ``max(t, engine free)`` for ``n / link`` seconds, and ``n / uplink`` seconds of its switch's
    uplink, whose time is handed out in booking order; it ends at the later of the two. Two GPUs
    behind one switch copying at once thus share the uplink's rate, as in the simulator's fluid
    model in aggregate (each copy's own end may differ: first come, first served here).
    """

    def __init__(self, server: Server, count: int):
        link, uplink = server.gpu.host_link_bw_effective, server.uplink_bw_effective
        self._lock = threading.Lock()
        self.engines = {(d, w): Link(link) for d in range(count) for w in ("h2d", "d2h")}
        self.uplinks = {(server.switch_of(d), w): Link(uplink) for d in range(count) for w in ("h2d", "d2h")}
        self._switch = [server.switch_of(d) for d in range(count)]
        self.moved = {"h2d": 0, "d2h": 0}  # bytes copied each way, every GPU

    def transfer(self, device: int, way: str, nbytes: int, start: float) -> float:
        with self._lock:
            engine, uplink = self.engines[(device, way)], self.uplinks[(self._switch[device], way)]
            t0 = max(start, engine.free_at)
            own = nbytes / engine.bandwidth
            shared = nbytes / uplink.bandwidth
            u0 = max(t0, uplink.free_at)
            uplink.free_at = u0 + shared
            uplink.busy_s += shared
            end = max(t0 + own, u0 + shared)
            engine.free_at = end
            engine.busy_s += end - t0
            self.moved[way] += nbytes
            return end


def _copy_way(kernel: Kernel) -> tuple[str, int] | None:
    """``("h2d" | "d2h", bytes)`` for a copy between host and device memory, else None."""
    if kernel.func is not _COPY:
        return None
    dst, src = kernel.args[0], kernel.args[1]
    dst_dev, src_dev = type(dst) is KernelRef, type(src) is KernelRef
    if dst_dev == src_dev:
        return None
    ref = dst if dst_dev else src
    n = 1
    for s in ref.shape:
        n *= s
    return ("h2d" if dst_dev else "d2h"), n * ref.dtype.itemsize


class VirtualStream(CpuStream):
    """A stream whose kernels take modelled time instead of running (see the module docstring).

    ``ready_at``: the perf_counter time at which the device will have done everything this thread
    has taken off the queue. Compute work is added when its task begins (``begin_modelled``); a copy
    is booked on the links when the thread reaches it; the thread sleeps until ``ready_at`` before
    an event fires or a span ends (``settle``), so events, and whoever waits on them, see the
    modelled time."""

    def __init__(self, device, name: str, priority: int):
        self.ready_at = 0.0
        # When the item the thread took last was issued, and when the event of its last wait
        # happened: with ``ready_at``, when the device could start that item. The thread itself
        # may get there later (it wakes up after sleeping out the work before, and waits for the
        # interpreter lock), which a GPU does not: its copy engine starts a queued copy as the one
        # before it ends, and a stream goes on as the event it waits for happens.
        self.issued_at = 0.0
        self.waited_to = 0.0
        self.busy_s = 0.0  # modelled seconds of work on this stream (compute or copies)
        # Idle device time, by cause: nothing issued yet (the host's issue), or waiting for an event
        # of another stream (a copy, another device's output).
        self.idle_issue_s = 0.0
        self.idle_wait_s = 0.0
        super().__init__(device, name, priority)

    issue_in_span = 0  # the issue overlaps the device's work, as on a GPU: a span is device time

    def new_queue(self) -> queue.SimpleQueue:
        return _TimedQueue(self)

    def earliest(self) -> float:
        """When the device can start the item the thread took last: once it was issued, the work
        before it is done and its waits are over (perf_counter time)."""
        return max(self.issued_at, self.waited_to, self.ready_at)

    def waited_for(self, event: CpuEvent, since: float) -> None:
        # The wait is over when the event happened on the device that recorded it (on a GPU no
        # thread wakes up in between), or, for an event of the host, now.
        end = time.perf_counter() if event.at is None else event.at
        self.idle_wait_s += max(0.0, end - self.earliest())
        self.waited_to = max(self.waited_to, end)

    def stamp(self, event: CpuEvent) -> None:
        event.at = self.earliest()

    def span_end(self) -> float:
        return self.earliest()  # its work done, and its issue (a kernel ends after its launch)

    def modelled_seconds(self, work: TaskWork | None) -> float:
        if work is None:
            return 0.0
        return cast(VirtualBackend, self.device.backend).task_seconds(work, self.device.index)

    def begin_modelled(self, seconds: float) -> float:
        start = self.earliest()
        self.ready_at = start + seconds
        self.busy_s += seconds
        return start

    def sleep(self, seconds: float) -> None:
        """A hung kernel is device time: the device's clock moves on by ``seconds``."""
        self._queue_modelled(seconds)

    def settle(self) -> None:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def enqueue(self, kernel) -> None:
        way = _copy_way(kernel) if type(kernel) is Kernel else None
        if way is None:
            return  # no data: a kernel that is not a host copy takes no time of its own
        super().enqueue(_Transfer(self, *way))


class _TimedQueue(queue.SimpleQueue):
    """A stream's queue that notes when each item was issued (``VirtualStream.issued_at``) and
    counts the device's idle time while the queue was empty."""

    def __init__(self, stream: VirtualStream):
        self.stream = stream

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put((time.perf_counter(), item), block, timeout)

    def get(self, block: bool = True, timeout: float | None = None):
        s = self.stream
        idle_from = s.earliest() if self.empty() else None
        s.issued_at, item = super().get(block, timeout)
        if idle_from is not None:
            s.idle_issue_s += max(0.0, s.issued_at - idle_from)
        return item


class _Transfer:
    """A copy between host and device, run on its stream's thread as a booking on the links."""

    __slots__ = ("stream", "way", "nbytes")

    def __init__(self, stream: VirtualStream, way: str, nbytes: int):
        self.stream, self.way, self.nbytes = stream, way, nbytes

    def __call__(self) -> None:
        s = self.stream
        s.settle()  # book in time order (the links are shared), once the copy before has ended
        start = s.earliest()
        end = cast(VirtualBackend, s.device.backend).links.transfer(
            s.device.index, self.way, self.nbytes, start
        )
        s.busy_s += end - start
        s.ready_at = end


class VirtualDevice(CpuDevice):
    """A GPU of the preset. Its streams run beside the worker's issue (no issue gate: nothing they
    run holds the GIL), as a GPU does."""

    stream_class = VirtualStream
    prefix = "virtual"

    def _close(self) -> None:
        pass

    def _open(self) -> None:
        pass


class VirtualBackend(CpuBackend):
    """``virtual:SPEC``: the devices of a server preset (``roundpipe.presets.load_hardware(SPEC)``)."""

    name = "virtual"
    device_class = VirtualDevice
    host_device = _META
    issue_token = ISSUE_TOKEN  # its workers issue beside each other, as CUDA's do

    def __init__(self, spec: str, sanitize: bool | None = None, capacity: int | None = None):
        self.server = load_hardware(spec)
        gpu = self.server.gpu
        self.grouped_mm_fast_path = fast_path_on(gpu.compute_capability)
        if capacity is None:  # RunConfig(device_capacity=...) overrides, as on the cpu backend
            capacity = gpu.memory_bytes - gpu.workspace_reserve_bytes
        self.links = Links(self.server, self.server.num_gpus)
        self.costs: TaskCosts | None = None
        self.noise: TaskNoise | None = None  # ``vary``
        self._noise_lock = threading.Lock()
        self.pinned_bytes = 0  # host bytes the run page-locked (``register_host`` and pinned buffers)
        self.host_moved_bytes = 0  # what the host jobs' operations read and wrote (``HostWork``)
        self._tally_lock = threading.Lock()
        self._pinned: dict[int, int] = {}
        super().__init__(self.server.num_gpus, capacity, sanitize, AllocatorRules.for_capacity(capacity))

    def needs_values(self, what: str) -> None:
        raise data_error(what)

    # ------------------------------------------------------------------ the model's costs
    def attach(self, model_config: dict, settings: dict) -> None:
        """The model whose layers the compute tasks run (its HF config as a dict) and the run's
        settings the cost model needs: ``dtype``, ``lora_rank``, ``head_shards``,
        ``head_chunk_tokens``, ``fp16_accumulation``."""
        self.costs = TaskCosts(model_config, self.server, **settings)

    def vary(self, jitter: float = 0.0, seed: int = 0, slowdown: tuple[float, ...] = ()) -> None:
        """Let tasks' times vary as ``SimOptions(jitter=..., jitter_seed=..., slowdown=...)`` make the
        simulator's (``sim.variability.TaskNoise``): each compute task's time times its device's
        slowdown and its own log-normal draw (drawn in the order tasks are issued)."""
        check_variability(jitter, slowdown)
        with self._noise_lock:
            self.noise = TaskNoise(jitter, seed, slowdown, len(self.devices))

    def task_seconds(self, work: TaskWork, device: int = 0) -> float:
        if self.noise is not None:
            with self._noise_lock:
                factor = self.noise.factor(device)
            return factor * self._task_seconds(work)
        return self._task_seconds(work)

    def _task_seconds(self, work: TaskWork) -> float:
        if self.costs is None:
            raise ConfigError(
                "a virtual device was given work before the model was attached; wrap the model with "
                "roundpipe.wrap (the Pipeline attaches it), not the backend alone"
            )
        return self.costs.seconds(work)

    def modelled(self) -> dict:
        """What the modelled devices have done so far: per device the seconds its compute stream
        ran tasks, and the bytes copied each way (compare two snapshots around a step)."""
        lanes = [cast(VirtualStream, d.streams["compute"]) for d in self.devices]
        return {
            "compute_busy_s": tuple(s.busy_s for s in lanes),
            "compute_idle_issue_s": tuple(s.idle_issue_s for s in lanes),
            "compute_idle_wait_s": tuple(s.idle_wait_s for s in lanes),
            "issued_ops": sum(s._mode.ops for d in self.devices for s in cast(dict, d.streams).values()),
            "h2d_bytes": self.links.moved["h2d"],
            "d2h_bytes": self.links.moved["d2h"],
            # the host jobs' modelled seconds (accumulation, the optimizer, the refresh of copies)
            "host_work_s": self.host_moved_bytes / self.server.host_work_bw,
        }

    def use_fp16_accumulation(self) -> None:
        """Honoured by the time model: the cost settings ``attach`` gets carry it."""

    # ------------------------------------------------------------------ host memory: meta
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.host_buffers is not None:
            return self.host_buffers.acquire(tuple(shape), dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=_META)

    def register_host(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self._pinned[t.untyped_storage()._cdata] = n
        self.pinned_bytes += n

    def unregister_host(self, t: torch.Tensor) -> None:
        self.pinned_bytes -= self._pinned.pop(t.untyped_storage()._cdata, 0)

    def host_work(self):
        """What the host thread runs its jobs under: their meta operations take modelled time."""
        return HostWork(self.server, self._host_work_done)

    def _host_work_done(self, moved_bytes: int) -> None:
        with self._tally_lock:
            self.host_moved_bytes += moved_bytes


class ShapesOnly:
    """The weights of a virtual run's meta model: every tensor is there, and reading it writes
    nothing (its store copy is a meta tensor too)."""

    def __contains__(self, name: str) -> bool:
        return True

    def fill(self, name: str, out: torch.Tensor) -> None:
        if not out.is_meta:
            raise data_error(f"reading weight {name} into a tensor with data")


class TaskCosts:
    """Seconds of a compute task on the preset's GPU: the cost model's layers for the task's
    microbatch shape (cached per shape), summed by the simulator's rule for an operation."""

    def __init__(self, model_config: dict, server: Server, **settings):
        self.config, self.server, self.settings = model_config, server, settings
        self._workload = lru_cache(maxsize=64)(self._build)

    def _build(self, rows: int, seq_len: int):
        from roundpipe.partition.cost import model_costs
        from roundpipe.sim.workload import workload_from_costs

        s = dict(self.settings)
        fp16_acc = s.pop("fp16_accumulation", False)
        costs = model_costs(self.config, seq_len, micro_batch_size=rows, fp16_accumulation=fp16_acc, **s)
        return workload_from_costs(costs, self.server)

    def seconds(self, work: TaskWork) -> float:
        from roundpipe.sim.workload import flow_seconds

        return flow_seconds(self._workload(work.rows, work.seq_len), work.flow)


class HostWork(TorchDispatchMode):
    """Host jobs of a virtual run: every operation on meta tensors runs (instantly, no data) and
    then costs the bytes it reads and writes at the host's memory rate for the optimizer
    (``Server.host_work_bw``, the simulator's), slept off on the host thread."""

    def __init__(self, server: Server, done: Callable[[int], None] | None = None):
        super().__init__()
        self.rate = server.host_work_bw
        self.owed = 0.0
        self.moved_bytes = 0  # what the operations read and wrote, in all
        self.done = done  # told the bytes moved at the end

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except (RuntimeError, NotImplementedError) as e:
            if _bytes_of(args) or _bytes_of(list((kwargs or {}).values())):
                raise data_error(f"{func} on the host ({e})") from e
            raise
        if func.is_view or func.overloadpacket in _NO_TRAFFIC:  # metadata or an allocation: no bytes move
            return out
        read = args[1:] if func.overloadpacket in _OVERWRITES else args  # the destination is not read
        n = _bytes_of(read) + _new_bytes(out, args) + _written_bytes(func, args)
        self.moved_bytes += n
        if n:
            self.owed += n / self.rate
            if self.owed > 1e-3:
                time.sleep(self.owed)
                self.owed = 0.0
        return out

    def __exit__(self, *exc):
        if self.owed > 0:
            time.sleep(self.owed)
            self.owed = 0.0
        if self.done is not None:
            self.done(self.moved_bytes)
        return super().__exit__(*exc)


_NO_TRAFFIC = frozenset(
    {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.detach}
)


# In-place operations that overwrite their first argument whole, without reading it.
_OVERWRITES = frozenset({torch.ops.aten.copy_, torch.ops.aten.zero_, torch.ops.aten.fill_})


def _written_bytes(func, args) -> int:
    """Bytes of the arguments an in-place operation writes (read once and written once)."""
    n = 0
    for a, v in zip(func._schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write:
            n += _bytes_of(v)
    return n


def _new_bytes(out, args) -> int:
    """Bytes of the outputs that are not an argument returned again (an in-place operation returns
    the tensor it wrote, counted by ``_written_bytes``)."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return sum(_bytes_of(o) for o in outs if not any(o is a for a in args))


def _bytes_of(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size() if v.is_meta else 0
    if isinstance(v, (list, tuple)):
        return sum(_bytes_of(x) for x in v)
    return 0


def data_error(what: str) -> VirtualDataError:
    return VirtualDataError(
        f"{what} needs the values of a tensor, which a virtual run does not have (shapes only); "
        "model it (docs/virtual.md lists what is modelled) or run on cpu:N or cuda"
    )
