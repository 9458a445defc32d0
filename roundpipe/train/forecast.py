"""Before the first step: what the run will need and do.

``host_ram_needed`` counts the host bytes of the parameter store from the model's own tensors (on
the meta device or real): fp32 masters, gradients and AdamW moments of the trainable ones (of the
moments one rank's share with ``optimizer_sharding: nodes``), the compute copies the uploads
read, and a margin for the activations and gradients handed back to the host. ``check_host_ram``
compares it, times the ranks on this machine, with what ``psutil`` says is available and refuses,
with the figures and the levers, when it will not fit. ``predict`` asks the simulator for tokens/s and
memory of the run as configured (a recipe's ``policy: auto`` is left to the runtime, which chooses
from the first batch's measured layer times).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from roundpipe.errors import HostMemoryError

GIB = 1 << 30
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class HostNeed:
    store_bytes: int  # masters, gradients, optimizer moments, compute copies
    handoff_bytes: int  # activations and gradients held on the host during a step (estimate)

    @property
    def total(self) -> int:
        return self.store_bytes + self.handoff_bytes


def host_ram_needed(
    model: nn.Module, dtype: str, optimizer_mode: str, batch_tokens: int, *, optimizer_shards: int = 1
) -> HostNeed:
    """Host bytes one rank's state takes (see the module docstring). ``batch_tokens``: tokens of one
    forward/backward on this rank (its rows of the batch x sequence length). ``optimizer_shards``:
    the ranks the AdamW moments are split over (``optimizer_sharding: nodes``); each holds about
    1/N of them, while the masters and gradients stay whole on every rank."""
    if type(optimizer_shards) is not int or optimizer_shards < 1:
        raise ValueError(f"optimizer_shards must be a positive int, got {optimizer_shards!r}")
    run_bytes = _DTYPE_BYTES[dtype]
    copies = 2 if optimizer_mode == "async" else 1
    seen: set[int] = set()
    store = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if p.requires_grad:
            store += n * 8  # fp32 master, fp32 gradient
            store += -(-n * 8 // optimizer_shards)  # two fp32 AdamW moments, this rank's share
            if dtype != "fp32" or copies == 2:
                store += n * run_bytes * copies
        else:
            store += n * (run_bytes if p.is_floating_point() else p.element_size())
    hidden = int(getattr(_base_config(model), "hidden_size", 0) or 0)
    layers = int(getattr(_base_config(model), "num_hidden_layers", 0) or 0)
    # Each layer boundary's activation (forward) and its gradient (backward), in the run dtype.
    handoff = 2 * batch_tokens * hidden * (layers + 2) * run_bytes
    return HostNeed(store, handoff)


def check_host_ram(need: HostNeed, *, lora: bool, dtype: str, ranks_here: int = 1) -> str:
    """Raise ``HostMemoryError`` when ``need`` exceeds the available host RAM; else a one-line summary.
    ``ranks_here``: the ranks of a data-parallel run that share this machine (``LOCAL_WORLD_SIZE``),
    each needing ``need``."""
    import psutil

    available = psutil.virtual_memory().available
    total = need.total * ranks_here
    each = (
        f" per rank, ~{total / GIB:.2f} GiB for the {ranks_here} ranks on this node" if ranks_here > 1 else ""
    )
    line = (
        f"host RAM: the run needs ~{need.total / GIB:.2f} GiB (state {need.store_bytes / GIB:.2f} GiB, "
        f"activations on the host ~{need.handoff_bytes / GIB:.2f} GiB){each}; {available / GIB:.1f} GiB available"
    )
    if total <= available:
        return line
    levers = []
    if not lora:
        levers.append(
            "train LoRA adapters (lora.enabled: true): the frozen weights then need no master, gradient or moments"
        )
    if dtype == "fp32":
        levers.append("run.dtype: bf16 (frozen weights and compute copies in 2 bytes)")
    if ranks_here > 1:
        levers.append(
            "run.optimizer_sharding: nodes (each rank holds 1/N of the AdamW state), or fewer ranks per "
            "node (torchrun --nproc-per-node)"
        )
    levers.append("a smaller run.batch_size or data.max_length (less activation memory on the host)")
    levers.append("a machine with more RAM, or fewer other processes")
    raise HostMemoryError(
        f"{line}: it does not fit. Levers: " + "; ".join(levers) + ". "
        "Set run.host_ram_check: false to start anyway."
    )


def _base_config(model: nn.Module):
    return getattr(model, "config", None) or getattr(getattr(model, "base_model", None), "config", None)


def simulator_hardware(devices) -> tuple[str, str]:
    """The simulator's preset for the run's devices (a ``DeviceSpec``: nothing is started), and a
    note on how it was chosen."""
    if devices.kind == "cpu":
        return f"{devices.count}xcpu", "virtual cpu devices"
    if devices.kind == "virtual":
        return devices.hardware, "the virtual server's preset"
    gpus = len(devices.gpus) if devices.gpus else torch.cuda.device_count()
    n = gpus * devices.workers_per_gpu
    gpu = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    for key, preset in (
        ("4090", "rtx4090"),
        ("3090", "rtx3090"),
        ("h200", "h200"),
        ("h100", "h100-sxm"),
        ("a800", "a800-pcie"),
    ):
        if key in gpu:
            return f"{n}x{preset}", gpu
    return f"{n}xrtx4090", f"{gpu or 'unknown GPU'}: no preset, modelled as an RTX 4090"


@dataclass(frozen=True)
class Forecast:
    text: str


def predict(model: nn.Module, devices, *, policy: str, seq_len: int, batch: int, microbatches, lora_rank, dtype: str,
            optimizer_mode: str, fp16_accumulation: bool = False, optimizer_shards: int = 1,
            head_shards: int = 1) -> Forecast:  # fmt: skip
    """The simulator's prediction for this run: its policy, microbatch count and head shards
    (``RunConfig.head_shards``, what the run's model is wrapped with).

    ``optimizer_shards`` > 1 (``optimizer_sharding: nodes``): the host figure is one rank's, its
    AdamW moments (8 bytes per trainable parameter) divided by the ranks.
    Never raises for a model the simulator cannot describe: the text then says why."""
    from roundpipe.errors import RoundpipeError
    from roundpipe.sim.scenario import Scenario, safe_run

    hardware, how = simulator_hardware(devices)
    config = _base_config(model).to_dict()
    try:
        mb = microbatches if isinstance(microbatches, int) else None
        r = safe_run(
            Scenario(
                config,
                hardware,
                policy,
                seq_len=seq_len,
                global_batch=batch,
                microbatches=mb,
                lora_rank=lora_rank,
                dtype=dtype,
                optimizer=optimizer_mode,
                fp16_accumulation=fp16_accumulation,
                head_shards=head_shards,
            )  # fmt: skip
        )
        head = f"simulator ({hardware}, {how}): policy {policy}"
    except (RoundpipeError, KeyError, ValueError) as e:
        return Forecast(f"simulator: cannot model this run ({e})")
    gpu = max(r.peak_gpu_bytes) if r.peak_gpu_bytes else 0
    host = f"host {r.peak_host_bytes / GIB:.2f} GiB"
    if optimizer_shards > 1:
        moments = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        per_rank = r.peak_host_bytes - moments + moments / optimizer_shards
        host += (
            f" ({per_rank / GIB:.2f} GiB per rank with the AdamW state split over {optimizer_shards} ranks)"
        )
    text = (
        f"{head}: predicts {r.tokens_per_s:,.0f} tokens/s, {r.iteration_s:.3f} s per forward/backward, "
        f"peak device memory {gpu / GIB:.2f} GiB, {host}" + ("" if r.fits else f"; does not fit: {r.reason}")
    )
    return Forecast(f"{text} ({trust_note(hardware, how)})")


def trust_note(hardware: str, how: str) -> str:
    """How far to trust the forecast's speed on this backend, as far as it has been measured."""
    if hardware.endswith("xcpu"):
        return (
            "speed rough on virtual cpu devices: the cpu preset is a generic core, not this machine's, "
            "and leaves out the interpreter's cost per task; runs have measured 6x (the demo) to "
            "hundreds of times (tiny models) below it"
        )
    if "no preset" in how:
        return "speed rough: no preset for this GPU"
    return (
        "layer times calibrated within 15% of an RTX 4090's measured ones (docs/simulator.md); "
        "other GPUs and whole steps are modelled, not measured"
    )
