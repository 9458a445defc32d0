"""Backends: ``cpu`` virtual devices (tests, anywhere), ``cuda`` (real GPUs) and ``virtual`` (a GPU
server modelled at full size: no data, modelled time and memory; ``virtual.py``).

Device specs: ``"auto"`` (all GPUs, else ``"cpu:2"``), ``"cpu:N"``, ``"cuda"`` (all GPUs),
``"cuda:0,1"`` (those GPUs), ``"cuda:0x2"`` (two workers sharing GPU 0), ``"virtual:8xrtx4090"``
(any hardware spec of ``roundpipe.presets.load_hardware``: ``virtual:rtx4090``, ``virtual:2xh200``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from roundpipe.backend.base import Backend, Device, DeviceMemory, Event, MemoryLedger, Stream, tensor_bytes
from roundpipe.errors import DeviceSpecError

_SPEC_HELP = (
    "use 'auto', 'cpu:N', 'cuda', 'cuda:0,1', 'cuda:0x2' (two workers on GPU 0) or 'virtual:8xrtx4090' "
    "(a modelled server)"
)


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda" | "virtual"
    count: int  # cpu: number of virtual devices
    gpus: tuple[int, ...] = ()  # cuda: GPU indices (empty = all)
    workers_per_gpu: int = 1
    hardware: str = ""  # virtual: the hardware spec (``presets.load_hardware``)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_device_spec(spec: str) -> DeviceSpec:
    """Parse a device spec without touching any device (``"auto"`` probes for CUDA)."""
    if not isinstance(spec, str):
        raise DeviceSpecError(f"devices must be a string, got {type(spec).__name__}; {_SPEC_HELP}")
    s = spec.strip().lower()
    if s == "auto":
        return parse_device_spec("cuda") if _cuda_count() else DeviceSpec("cpu", 2)
    if s == "cpu":
        return DeviceSpec("cpu", 1)
    m = re.fullmatch(r"cpu:(\d+)", s)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise DeviceSpecError(f"device spec {spec!r} asks for {n} cpu devices; use at least 'cpu:1'")
        return DeviceSpec("cpu", n)
    if s.startswith("virtual:"):
        from roundpipe.errors import ConfigError
        from roundpipe.presets import load_hardware

        hardware = s[len("virtual:") :]
        try:
            server = load_hardware(hardware)
        except ConfigError as e:
            raise DeviceSpecError(f"device spec {spec!r}: {e}") from None
        return DeviceSpec("virtual", server.num_gpus, hardware=hardware)
    m = re.fullmatch(r"cuda(?::(\d+(?:,\d+)*))?(?:x(\d+))?", s)
    if not m:
        raise DeviceSpecError(f"malformed device spec {spec!r}; {_SPEC_HELP}")
    available = _cuda_count()
    if available == 0:
        raise DeviceSpecError(
            f"device spec {spec!r} asks for CUDA but this machine has no CUDA device "
            "(or torch was built without CUDA); use 'cpu:N' or 'auto'"
        )
    gpus = tuple(int(g) for g in m.group(1).split(",")) if m.group(1) else tuple(range(available))
    workers = int(m.group(2)) if m.group(2) else 1
    missing = [g for g in gpus if g >= available]
    if missing:
        raise DeviceSpecError(f"device spec {spec!r} names GPU {missing[0]} but only {available} exist")
    if len(set(gpus)) != len(gpus) or workers < 1:
        raise DeviceSpecError(f"device spec {spec!r} repeats a GPU or asks for 0 workers; {_SPEC_HELP}")
    return DeviceSpec("cuda", len(gpus) * workers, gpus, workers)


def make_backend(
    spec: str | DeviceSpec, capacity: int | None = None, sanitize: bool | None = None
) -> Backend:
    """Create the backend for ``spec``. Starts the cpu backend's stream threads.

    ``sanitize`` turns on the cpu backend's stream checks (None: the ``ROUNDPIPE_SANITIZE``
    environment variable decides); on CUDA use PyTorch's own ``TORCH_CUDA_SANITIZER=1``.
    """
    ds = spec if isinstance(spec, DeviceSpec) else parse_device_spec(spec)
    if ds.kind == "cpu":
        from roundpipe.backend.cpu import CpuBackend

        return CpuBackend(ds.count, capacity, sanitize)
    if ds.kind == "virtual":
        from roundpipe.backend.virtual import VirtualBackend

        return VirtualBackend(ds.hardware, sanitize, capacity)
    from roundpipe.backend.cuda import CudaBackend

    return CudaBackend(list(ds.gpus), ds.workers_per_gpu, capacity)


__all__ = [
    "Backend",
    "Device",
    "DeviceMemory",
    "DeviceSpec",
    "Event",
    "MemoryLedger",
    "Stream",
    "make_backend",
    "parse_device_spec",
    "tensor_bytes",
]
