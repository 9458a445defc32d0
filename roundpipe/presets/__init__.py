"""Hardware and model presets: the one place where numbers that describe GPUs, servers and models live.

The numbers sit in three data files next to this module, each entry with its public source
(``_source``) and, where a number is not a published figure, an ``_assumed`` note saying why it is
what it is:

- ``hardware.json``: per GPU (``gpus``) dense tensor-core and FP32 rates, memory, host link; per GPU
  kind a default server topology (``servers``) used when a spec like ``"8xrtx4090"`` builds a server.
- ``models.json``: architecture numbers of the models the issues name, with transformers field names,
  so a preset and a local ``config.json`` are interchangeable.
- ``measured_layers.json``: per-layer times measured on real hardware (the RoundPipe paper's RTX
  4090 layers), which the cost model's fitted parameters in ``hardware.json`` reproduce.

This module only parses and converts units (datasheet TFLOPS/GB/GBs -> FLOP/s, bytes, bytes/s).
Pure Python; nothing is read until a loader is called.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from roundpipe.errors import ConfigError

GIB = 1 << 30
_TERA = 1e12
_GIGA = 1e9
_SPEC_RE = re.compile(r"^\s*(?:(\d+)\s*[x\*]\s*)?([a-z0-9.\-]+)\s*$")
_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


@cache
def _read(name: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return json.loads(text)


def normalize_dtype(dtype: str) -> str:
    """Map ``"bfloat16"``, ``"torch.float16"``, ... to one of ``"bf16"``, ``"fp16"``, ``"fp32"``."""
    key = str(dtype).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class GPU:
    """One GPU model, in SI units (FLOP/s, bytes, bytes/s). Build it with :func:`load_hardware`.

    ``host_link_bw`` is the nominal PCIe rate per direction; ``host_link_bw_measured`` is a measured
    pinned host-to-device rate where a public figure exists (else ``None``).
    """

    name: str
    memory_bytes: int
    memory_bw: float
    bf16_flops: float
    fp16_flops: float
    fp16_flops_fp16_acc: float | None
    fp32_flops: float
    tf32_flops: float
    host_link: str
    host_link_bw: float
    host_link_bw_measured: float | None
    p2p: bool
    nvlink_bw: float | None
    matmul_efficiency: float
    workspace_reserve_bytes: int
    host_link_efficiency: float
    source: str
    # The cost model's kernel roofline (partition/kernels.py); matmul_efficiency is its GEMM plateau.
    memory_efficiency: float  # share of memory_bw that elementwise kernels reach
    gemm_ramp_s: float  # fixed time a GEMM spends filling and draining the GPU
    attention_efficiency: float  # share of the fp32-accumulate tensor peak FlashAttention reaches
    launch_s: float  # host time to issue one forward kernel (eager Python); shorter kernels wait for it
    launch_bwd_s: float  # the same for a backward kernel (issued by the autograd engine)
    expert_grad_passes: float  # DRAM passes charged per expert's full-size gradient (MoE backward)
    # CUDA's (major, minor), which sets torch's cuBLAS workspace size; None: not a CUDA GPU
    compute_capability: tuple[int, int] | None = None

    def peak_flops(
        self, dtype: str = "bf16", *, fp16_accumulate: bool = False, allow_tf32: bool = False
    ) -> float:
        """Dense peak FLOP/s of matmuls in ``dtype``.

        fp16 uses FP32 accumulation, PyTorch's default, unless ``fp16_accumulate`` (what
        ``torch.backends.cuda.matmul.allow_fp16_accumulation`` enables; only GeForce cards run it
        faster). fp32 runs on the FP32 units unless ``allow_tf32``.
        """
        dtype = normalize_dtype(dtype)
        if dtype == "bf16":
            return self.bf16_flops
        if dtype == "fp16":
            if fp16_accumulate and self.fp16_flops_fp16_acc:
                return self.fp16_flops_fp16_acc
            return self.fp16_flops
        return self.tf32_flops if allow_tf32 else self.fp32_flops

    @property
    def host_link_bw_effective(self) -> float:
        """Pinned copy rate per direction: the measured figure, else nominal x ``host_link_efficiency``."""
        if self.host_link_bw_measured:
            return self.host_link_bw_measured
        return self.host_link_bw * self.host_link_efficiency


@dataclass(frozen=True)
class Server:
    """``num_gpus`` identical GPUs in one host, with the shared resources the simulator models.

    GPUs are grouped ``gpus_per_switch`` to a PCIe switch whose uplink (``switch_uplink_bw`` per
    direction) all of them share; ``host_memory_bw`` bounds every host-side copy and the CPU
    optimizer, which runs on ``cpu_cores``.
    """

    gpu: GPU
    num_gpus: int
    gpus_per_switch: int
    switch_uplink_bw: float
    host_memory_bw: float
    cpu_cores: int
    source: str
    max_gpus: int | None = None  # the most GPUs such a server holds (None: not limited)
    host_memory_bytes: int | None = None  # host RAM (None: not modelled)
    optimizer_efficiency: float = 0.5  # share of host_memory_bw the CPU AdamW step reaches

    @property
    def name(self) -> str:
        return f"{self.num_gpus}x{self.gpu.name}"

    @property
    def num_switches(self) -> int:
        return -(-self.num_gpus // self.gpus_per_switch)

    def switch_of(self, gpu_index: int) -> int:
        """Index of the PCIe switch GPU ``gpu_index`` sits behind."""
        if not 0 <= gpu_index < self.num_gpus:
            raise ConfigError(f"GPU index {gpu_index} is outside a server of {self.num_gpus} GPUs")
        return gpu_index // self.gpus_per_switch

    @property
    def host_work_bw(self) -> float:
        """Bytes per second the host's bandwidth-bound jobs (the CPU AdamW step, gradient sums)
        move: ``host_memory_bw`` at ``optimizer_efficiency``."""
        return self.host_memory_bw * self.optimizer_efficiency

    @property
    def uplink_bw_effective(self) -> float:
        """Per-direction rate of a switch uplink, derated like the GPU links (nominal -> effective)."""
        return self.switch_uplink_bw * self.gpu.host_link_bw_effective / self.gpu.host_link_bw

    # The single-GPU view, so a Server can stand in wherever a GPU is expected.
    @property
    def memory_bytes(self) -> int:
        return self.gpu.memory_bytes

    @property
    def workspace_reserve_bytes(self) -> int:
        return self.gpu.workspace_reserve_bytes

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        return self.gpu.compute_capability

    @property
    def matmul_efficiency(self) -> float:
        return self.gpu.matmul_efficiency

    def peak_flops(self, dtype: str = "bf16", **kw) -> float:
        return self.gpu.peak_flops(dtype, **kw)


def known_gpus() -> list[str]:
    return sorted(k for k in _read("hardware.json")["gpus"] if not k.startswith("_"))


def known_models() -> list[str]:
    return sorted(k for k in _read("models.json") if not k.startswith("_"))


def _capability(text: str | None) -> tuple[int, int] | None:
    """``"9.0"`` as ``(9, 0)``; None for a device that is not a CUDA GPU."""
    if text is None:
        return None
    major, minor = text.split(".")
    return int(major), int(minor)


def _gpu(name: str) -> GPU:
    data = _read("hardware.json")
    entry = data["gpus"].get(name)
    if entry is None:
        raise ConfigError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpus())} "
            f"(or 'N x name' for a server, e.g. '8xrtx4090')"
        )
    d = data["_defaults"]
    measured = entry.get("host_link_gbs_measured_pinned_h2d")
    fp16_acc = entry.get("fp16_tflops_fp16_acc")
    nvlink = entry.get("nvlink_gbs")
    return GPU(
        name=name,
        memory_bytes=int(entry["memory_gb"] * GIB),
        memory_bw=entry["memory_bw_gbs"] * _GIGA,
        bf16_flops=entry["bf16_tflops"] * _TERA,
        fp16_flops=entry["fp16_tflops_fp32_acc"] * _TERA,
        fp16_flops_fp16_acc=fp16_acc * _TERA if fp16_acc else None,
        fp32_flops=entry["fp32_tflops"] * _TERA,
        tf32_flops=entry["tf32_tflops"] * _TERA,
        host_link=entry["host_link"],
        host_link_bw=entry["host_link_gbs_nominal"] * _GIGA,
        host_link_bw_measured=measured * _GIGA if measured else None,
        p2p=bool(entry["p2p"]),
        nvlink_bw=nvlink * _GIGA if nvlink else None,
        matmul_efficiency=entry.get("matmul_efficiency", d["matmul_efficiency"]),
        workspace_reserve_bytes=int(entry.get("workspace_reserve_gb", d["workspace_reserve_gb"]) * GIB),
        compute_capability=_capability(entry["compute_capability"]),
        host_link_efficiency=entry.get("host_link_efficiency", d["host_link_efficiency"]),
        source=entry["_source"],
        memory_efficiency=entry.get("memory_efficiency", d["memory_efficiency"]),
        gemm_ramp_s=entry.get("gemm_ramp_us", d["gemm_ramp_us"]) * 1e-6,
        attention_efficiency=entry.get("attention_efficiency", d["attention_efficiency"]),
        launch_s=entry.get("launch_us", d["launch_us"]) * 1e-6,
        launch_bwd_s=entry.get("launch_bwd_us", d["launch_bwd_us"]) * 1e-6,
        expert_grad_passes=entry.get("expert_grad_passes", d["expert_grad_passes"]),
    )


def load_hardware(spec: str, **overrides: Any) -> Server:
    """Build a server from a spec: ``"rtx4090"`` (one GPU) or ``"8xrtx4090"`` (eight).

    The topology comes from the GPU kind's ``servers`` entry in ``hardware.json``; ``overrides``
    replace any :class:`Server` field (``gpus_per_switch=2``, ``cpu_cores=32``, ...) or, with a
    ``gpu_`` prefix, any :class:`GPU` field (``gpu_memory_bytes=20 * 2**30``).
    Unknown names raise :class:`ConfigError` listing the known ones.
    """
    m = _SPEC_RE.match(str(spec).lower())
    if not m:
        raise ConfigError(f"bad hardware spec {spec!r}; expected e.g. 'rtx4090' or '8xrtx4090'")
    count = int(m.group(1) or 1)
    if count < 1:
        raise ConfigError(f"hardware spec {spec!r} asks for {count} GPUs; need at least one")
    gpu = _gpu(m.group(2))
    gpu_over = {k[4:]: v for k, v in overrides.items() if k.startswith("gpu_")}
    server_over = {k: v for k, v in overrides.items() if not k.startswith("gpu_")}
    try:
        if gpu_over:
            gpu = replace(gpu, **gpu_over)
        topo = _read("hardware.json")["servers"][gpu.name]
        server = Server(
            gpu=gpu,
            num_gpus=count,
            gpus_per_switch=int(topo["gpus_per_switch"]),
            switch_uplink_bw=topo["switch_uplink_gbs"] * _GIGA,
            host_memory_bw=topo["host_memory_bw_gbs"] * _GIGA,
            cpu_cores=int(topo["cpu_cores"]),
            source=topo["_source"],
            max_gpus=int(topo["max_gpus"]) if topo.get("max_gpus") else None,
            host_memory_bytes=int(topo["host_memory_gb"] * GIB) if topo.get("host_memory_gb") else None,
            optimizer_efficiency=float(
                topo.get(
                    "cpu_optimizer_efficiency",
                    _read("hardware.json")["_defaults"]["cpu_optimizer_efficiency"],
                )
            ),
        )
        server = replace(server, **server_over) if server_over else server
    except TypeError as exc:
        raise ConfigError(f"bad hardware override for {spec!r}: {exc}") from None
    if server.max_gpus is not None and server.num_gpus > server.max_gpus:
        raise ConfigError(
            f"hardware spec {spec!r} asks for {server.num_gpus} GPUs, but a {gpu.name} server holds at most "
            f"{server.max_gpus}; use 1..{server.max_gpus} (or override max_gpus=...)"
        )
    return server


def _normalize_model_name(name: str) -> str:
    key = name.strip().lower()
    key = key.rsplit("/", 1)[-1]  # "Qwen/Qwen3-8B" -> "qwen3-8b"
    key = re.sub(r"^(meta-)?llama-3", "llama3", key)  # "Meta-Llama-3.1-8B" -> "llama3.1-8b"
    key = re.sub(r"-(instruct|base)$", "", key)
    return key


def _looks_like_path(name: str) -> bool:
    return os.path.exists(name) or name.endswith(".json") or name.startswith((".", "~")) or os.sep in name


def load_model_config(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """Architecture numbers of a model as a transformers-style dict (a fresh copy).

    Accepts a preset name (``"qwen3-8b"``; a hub id such as ``"Qwen/Qwen3-8B"`` maps to it), a path to
    a local ``config.json``, or a directory holding one. A multimodal config's ``text_config`` is
    used when the top level has no ``hidden_size``. Unknown names raise :class:`ConfigError` listing
    the known ones.
    """
    text = os.fspath(name_or_path)
    presets = _read("models.json")
    key = _normalize_model_name(text)
    if key in presets and not key.startswith("_"):
        return json.loads(json.dumps(presets[key]))
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read model config {path!r}: {exc}") from None
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "_source": path}
        cfg.setdefault("_source", path)
        return cfg
    where = "no config.json at that path, " if _looks_like_path(text) else ""
    raise ConfigError(
        f"unknown model {text!r} ({where}no preset of that name); known models: "
        f"{', '.join(known_models())}, or pass a path to a config.json"
    )


def load_measured_layers() -> dict[str, Any]:
    """Per-layer times measured on real hardware (``measured_layers.json``, a fresh copy): the
    RoundPipe paper's RTX 4090 figures the cost model is calibrated on. ``setting`` says how they
    were measured; ``models`` maps a preset name to its ``fwd``, ``bwd``, ``head_fwd`` and
    ``head_bwd`` milliseconds and ``lora_rank`` (None: full fine-tuning)."""
    return json.loads(json.dumps(_read("measured_layers.json")))


__all__ = [
    "GIB",
    "GPU",
    "Server",
    "known_gpus",
    "known_models",
    "load_hardware",
    "load_measured_layers",
    "load_model_config",
    "normalize_dtype",
]
