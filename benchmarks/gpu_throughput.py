"""One GPU, a ~1.5B Qwen3-shaped model, seq 4096: roundpipe against what a user would run instead.

Every system trains the same model (built once from a config, the same initial weights, the same
LoRA initialisation) on the same batches, bf16 compute, AdamW with the same hyper-parameters, in
two modes (LoRA r=16 on every linear layer, and full fine-tuning):

- ``roundpipe_x1`` / ``roundpipe_x2``: roundpipe on ``cuda:0x1`` and ``cuda:0x2`` (one and two
  workers sharing GPU 0), policy ``roundpipe``, weights, masters and AdamW state in page-locked CPU
  memory (its normal mode), ``dtype="bf16"`` (bf16 uploads, fp32 loss and masters).
- ``hf``: plain Hugging Face training with the whole model on the GPU, fp32 weights under
  ``torch.autocast(bfloat16)``, activation checkpointing, ``torch.optim.AdamW`` on the GPU. For
  full fine-tuning of 1.5B parameters its fp32 weights, gradients and AdamW state (~25 GB) fit in
  an H200's memory with room to spare: this is the baseline a user with that GPU would pick.
- ``fsdp2``: ``fully_shard`` (FSDP2) on a world-size-1 process group with ``CPUOffloadPolicy``
  (parameters, gradients and AdamW state on the CPU), ``MixedPrecisionPolicy(bf16 params, fp32
  reductions)``, activation checkpointing, ``torch.optim.AdamW``: what a user whose model does not
  fit would pick instead of roundpipe.

``hf`` and ``fsdp2`` accumulate gradients over micro-steps of ``rows`` sequences (the batch does
not fit one pass: the LM head's fp32 logits), each micro-step's loss weighted by its share of the
batch's label tokens, so their loss is the batch's token mean, as roundpipe's is.

Reported per system: tokens/s (input tokens per step over the median of the timed steps, after the
warm-up steps; roundpipe's first step also profiles its layers), the ratios to both roundpipe
runs, peak GPU memory (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), and for
roundpipe the host-to-device bytes uploaded per step (the devices' ``bytes_in`` counters) over the
step time, against a measured pinned host->device copy of 1 GiB. The first-step losses of all
systems must agree within rtol 2e-2 (bf16: the systems round differently).

The run keeps to a time budget (``--budget-s``): each system gets an equal share of what is left,
fewer timed steps when its warm-up says the share is short, and a system with too little left is
reported SKIP. A missing feature (FSDP2 in an older torch) is a SKIP that names it; a system that
raises is a FAIL that names the error, and the others still run. Exits 1 on a FAIL or a loss
mismatch.

    python benchmarks/gpu_throughput.py                 # on a GPU: benchmarks/results/gpu_throughput.*
    python benchmarks/gpu_throughput.py --dry-run       # cpu backend, tiny model, cpu:1 / cpu:2
    python benchmarks/gpu_throughput.py --json out.json --budget-s 200

``--dry-run`` runs the same code on the cpu backend with a tiny model (``cpu:1``, ``cpu:2``, plain
HF on the CPU, FSDP2 on gloo with CPU offload) and writes ``gpu_throughput_dry_run.{json,md}``
instead, so that it never overwrites what a GPU measured (``ROUNDPIPE_BENCH_RESULTS`` moves either
elsewhere). ``--tiny``: one decoder layer, one timed step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from roundpipe.errors import ConfigError  # noqa: E402

LOSS_RTOL = 2e-2  # first step: the same weights and batch, but bf16 rounds differently per system
MODES = ("lora", "full")
SYSTEMS = ("roundpipe_x1", "roundpipe_x2", "hf", "fsdp2")
ROUNDPIPE_SPECS = {"roundpipe_x1": ("cuda:0x1", "cpu:1"), "roundpipe_x2": ("cuda:0x2", "cpu:2")}
PINNED_COPY_BYTES = 1 << 30
GPU_BUDGET_S = 230.0  # the "about 4 minutes on an H200", imports and the summary aside
GiB = 2**30


@dataclass(frozen=True)
class Setup:
    """The model (a Qwen3 config), the data and the optimizer every system shares."""

    hidden: int = 1536
    layers: int = 28
    intermediate: int = 8960
    heads: int = 12
    kv_heads: int = 2
    head_dim: int = 128
    vocab: int = 151936
    tied: bool = True  # as Qwen2.5-1.5B / Qwen3-1.7B
    seq: int = 4096
    batch: int = 8  # sequences per optimizer step
    rows: int = 2  # sequences per micro-step of hf and fsdp2 (gradient accumulation)
    warmup: int = 2
    timed: int = 3
    lora_rank: int = 16
    lr_full: float = 1e-5
    lr_lora: float = 1e-4
    seed: int = 0

    def check(self) -> None:
        """Reject numbers the run cannot use, naming them (``ConfigError``)."""
        positive = ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
        positive += ("seq", "batch", "rows", "timed", "lora_rank")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.warmup < 1:
            raise ConfigError(
                f"warmup must be at least 1 (roundpipe's first step profiles its layers), got {self.warmup}"
            )
        if self.seq < 2:
            raise ConfigError(f"seq must be at least 2 (a label needs a token before it), got {self.seq}")
        if self.batch % self.rows:
            raise ConfigError(
                f"batch {self.batch} is not a multiple of rows {self.rows} (sequences per micro-step of "
                f"hf and fsdp2): choose rows among the divisors of {self.batch}"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


GPU_SETUP = Setup()
# bf16 matmuls on a CPU without bf16 instructions are ~50x slower than fp32: small shapes.
DRY_RUN_SETUP = Setup(
    hidden=32, layers=2, intermediate=64, heads=4, kv_heads=2, head_dim=8, vocab=256, seq=16, batch=2,
    rows=1, warmup=1, timed=2, lora_rank=4,
)  # fmt: skip


# --------------------------------------------------------------------------- the model
def config_class():
    """Qwen3Config, or Qwen2Config where transformers predates Qwen3 (no q/k norms, qkv biases)."""
    import transformers

    for name in ("Qwen3Config", "Qwen2Config"):
        if hasattr(transformers, name):
            return name, getattr(transformers, name)
    raise ImportError(f"transformers {transformers.__version__} has neither Qwen3Config nor Qwen2Config")


def model_config(setup: Setup):
    name, cls = config_class()
    return cls(
        vocab_size=setup.vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.intermediate,
        num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads,
        num_key_value_heads=setup.kv_heads,
        head_dim=setup.head_dim,
        max_position_embeddings=max(setup.seq, 64),
        tie_word_embeddings=setup.tied,
        use_cache=False,
    )


def parameter_count(setup: Setup, family: str = "Qwen3Config") -> int:
    """Parameters of the model from its config numbers alone (checked against the built model)."""
    h, q, kv = setup.hidden, setup.heads * setup.head_dim, setup.kv_heads * setup.head_dim
    attention = h * q + 2 * h * kv + q * h
    if family == "Qwen3Config":
        attention += 2 * setup.head_dim  # q_norm, k_norm
    else:
        attention += q + 2 * kv  # Qwen2's q, k, v biases
    layer = attention + 3 * h * setup.intermediate + 2 * h  # MLP + the two RMSNorms
    embeddings = setup.vocab * h * (1 if setup.tied else 2)
    return embeddings + setup.layers * layer + h  # + the final norm


def build_base_model(setup: Setup, device: torch.device):
    """The fp32 model every system starts from, on the CPU. Initialised on ``device`` (seconds on a
    GPU instead of a minute of CPU random numbers for 1.5B parameters), then moved to the CPU."""
    import transformers

    config = model_config(setup)

    def build(where):
        torch.manual_seed(setup.seed)
        with torch.device(where):
            try:
                return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            except TypeError:  # a transformers without attn_implementation= in from_config
                return transformers.AutoModelForCausalLM.from_config(config)

    try:
        model = build(device)
    except Exception as e:  # e.g. a transformers that fights the device context: build on the CPU
        if device.type == "cpu":
            raise
        print(f"building on {device} failed ({type(e).__name__}: {e}); building on the CPU instead")
        model = build(torch.device("cpu"))
    model = model.to("cpu", dtype=torch.float32).train()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def fresh_model(base, setup: Setup, mode: str):
    """A copy of ``base`` (systems move or re-point its tensors), with LoRA in ``lora`` mode: the
    same seed before ``get_peft_model`` gives every system the same adapter initialisation."""
    model = copy.deepcopy(base)
    if mode == "full":
        return model
    import peft

    torch.manual_seed(setup.seed + 1)
    lora = peft.LoraConfig(
        r=setup.lora_rank,
        lora_alpha=2 * setup.lora_rank,
        lora_dropout=0.0,  # no dropout: the first-step losses are comparable across systems
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, lora)


def make_batches(setup: Setup, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(setup.seed + 2)
    return [torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=g) for _ in range(count)]


def label_tokens(ids: torch.Tensor) -> int:
    """Tokens that have a label once HF shifts the labels (every token here has one)."""
    return ids.shape[0] * (ids.shape[1] - 1)


def enable_checkpointing(model) -> str:
    """Per-layer activation checkpointing, through whichever name this transformers has."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}  # frozen embeddings (LoRA) give checkpoints no grad input
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return "activation_checkpointing_enable"
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return "gradient_checkpointing_enable"


def decoder_layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


# --------------------------------------------------------------------------- the systems
class Skip(Exception):
    """A system cannot run on this machine (a missing feature); the message says why."""


def _version(text: str) -> tuple[int, ...]:
    """``"2.5.1+cu124"`` -> ``(2, 5, 1)``."""
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def older_than_roundpipe_supports() -> list[str]:
    """The packages older than the lower bounds of roundpipe's setup.cfg (a SKIP, not a FAIL)."""
    try:
        text = (Path(__file__).resolve().parent.parent / "setup.cfg").read_text()
    except OSError:
        return []
    older = []
    for name, bound in re.findall(r"^\s*(torch|transformers|peft)\s*>=\s*([0-9][^\s,;]*)", text, re.M):
        try:
            have = __import__(name).__version__
        except Exception as e:
            older.append(f"{name} is not importable ({type(e).__name__})")
            continue
        if _version(have) < _version(bound):
            older.append(f"{name} {have} < {bound}")
    return older


class RoundpipeRun:
    """roundpipe on one GPU's workers (cpu virtual devices in a dry run)."""

    precision = "bf16 uploads and activations, fp32 loss, masters and AdamW state on the CPU"

    def __init__(self, key: str, spec: str):
        self.key, self.devices = key, spec
        self.step_bytes: list[int] = []

    def open(self, model, setup: Setup, mode: str, gpu: bool):
        older = older_than_roundpipe_supports()
        if older:
            raise Skip(f"roundpipe needs newer packages than this machine's: {'; '.join(older)}")
        import roundpipe

        config = roundpipe.RunConfig(devices=self.devices, dtype="bf16", policy="roundpipe")
        self.pipe = roundpipe.wrap(model, config)
        self.pipe.configure_optimizer(lr=setup.lr_lora if mode == "lora" else setup.lr_full, weight_decay=0.0)

    def _uploaded(self) -> int:
        return sum(d.bytes_in for d in self.pipe.backend.devices)

    def step(self, ids: torch.Tensor) -> float:
        before = self._uploaded()
        out = self.pipe.forward_backward(ids, labels=ids)
        self.pipe.step()
        self.step_bytes.append(self._uploaded() - before)
        return float(out.loss)

    def figures(self, timed: int) -> dict:
        plan = self.pipe.plan
        stats = self.pipe.stats()
        return {
            "policy": plan.policy,
            "num_microbatches": plan.num_microbatches,
            "stages": len(plan.rows),
            "h2d_bytes_per_step": statistics.median(self.step_bytes[-timed:]),
            "worker_peak_bytes": [d["peak_bytes"] for d in stats["devices"]],
            "worker_planned_peak_bytes": [d["planned_peak_bytes"] for d in stats["devices"]],
            "bubble_fraction": [round(d["bubble_fraction"], 4) for d in stats["devices"]],
        }

    def close(self):
        if getattr(self, "pipe", None) is not None:
            self.pipe.close()
            self.pipe = None


class AccumulatingRun:
    """A plain training loop over micro-steps of ``rows`` sequences (``hf`` and ``fsdp2``)."""

    autocast = False

    def open(self, model, setup: Setup, mode: str, gpu: bool):
        self.model, self.rows = model, setup.rows
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        self.checkpointing = enable_checkpointing(model)
        self.prepare(model, gpu)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=setup.lr_lora if mode == "lora" else setup.lr_full, weight_decay=0.0
        )

    def prepare(self, model, gpu: bool):
        raise NotImplementedError

    def step(self, ids: torch.Tensor) -> float:
        total = label_tokens(ids)
        loss_sum = torch.zeros((), device=self.device)
        for rows in ids.split(self.rows):
            rows = rows.to(self.device, non_blocking=True)
            context = (
                torch.autocast(self.device.type, dtype=torch.bfloat16)
                if self.autocast
                else contextlib.nullcontext()
            )
            with context:
                loss = self.model(input_ids=rows, labels=rows).loss * (label_tokens(rows) / total)
            loss.backward()
            loss_sum += loss.detach().float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum)  # waits for the device

    def figures(self, timed: int) -> dict:
        return {"checkpointing": self.checkpointing, "rows_per_micro_step": self.rows}

    def close(self):
        self.model = self.optimizer = None


class PlainHFRun(AccumulatingRun):
    key, autocast = "hf", True
    precision = "fp32 weights on the device under torch.autocast(bfloat16), AdamW there too"

    def __init__(self, gpu: bool):
        self.devices = "cuda:0" if gpu else "cpu"

    def prepare(self, model, gpu: bool):
        model.to(self.device)


def fsdp2_api():
    """``(fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy, where)``; ``Skip`` naming what is
    missing in this torch (FSDP2 is public in torch.distributed.fsdp from 2.6, in
    torch.distributed._composable.fsdp before)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise Skip(f"torch {torch.__version__} was built without torch.distributed")
    errors = []
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(where, fromlist=["fully_shard"])
            return module.fully_shard, module.CPUOffloadPolicy, module.MixedPrecisionPolicy, where
        except (ImportError, AttributeError) as e:
            errors.append(f"{where}: {type(e).__name__}: {e}")
    raise Skip(f"torch {torch.__version__} has no FSDP2 with CPUOffloadPolicy ({'; '.join(errors)})")


class FSDP2Run(AccumulatingRun):
    key = "fsdp2"
    precision = "MixedPrecisionPolicy(bf16 params, fp32 reduce); fp32 shards, grads, AdamW on the CPU"

    def __init__(self, gpu: bool):
        self.devices = "cuda:0" if gpu else "cpu"
        self.api = self.backend = None

    def prepare(self, model, gpu: bool):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard, offload, mixed, self.api = fsdp2_api()
        self.backend = self._init_group(dist, gpu)
        mesh = init_device_mesh(self.device.type, (1,))
        options = dict(
            mesh=mesh,
            offload_policy=offload(pin_memory=gpu),
            mp_policy=mixed(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)

    @staticmethod
    def _init_group(dist, gpu: bool) -> str:
        """A world-size-1 group in this process: gloo for the CPU, NCCL for the GPU."""
        if dist.is_initialized():
            dist.destroy_process_group()
        errors = []
        for backend in ("cpu:gloo,cuda:nccl", "nccl") if gpu else ("gloo",):
            try:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                return backend
            except Exception as e:  # an older torch without device:backend strings: try the next
                errors.append(f"{backend}: {type(e).__name__}: {e}")
        raise Skip(f"no world-size-1 process group: {'; '.join(errors)}")

    def figures(self, timed: int) -> dict:
        return super().figures(timed) | {"fsdp2_api": self.api, "process_group": self.backend}

    def close(self):
        import torch.distributed as dist

        super().close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def make_run(key: str, gpu: bool):
    if key in ROUNDPIPE_SPECS:
        return RoundpipeRun(key, ROUNDPIPE_SPECS[key][0 if gpu else 1])
    return PlainHFRun(gpu) if key == "hf" else FSDP2Run(gpu)


# --------------------------------------------------------------------------- measuring
class Budget:
    """Seconds left of the run, counted from when the budget is made (after the imports); None: no limit."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()


def synchronize(gpu: bool):
    if gpu:
        torch.cuda.synchronize()


def reset_gpu_peaks(gpu: bool):
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed_steps(run, batches, setup: Setup, share_s: float, gpu: bool, log) -> dict:
    """Warm-up steps, then as many of ``setup.timed`` steps (at least one) as fit ``share_s``. Every
    warm-up after the first is dropped too when it would leave no room for a timed step."""
    losses, warm = [], []
    for ids in batches[: setup.warmup]:
        if warm and sum(warm) + 2 * warm[-1] > share_s:
            break
        t0 = time.perf_counter()
        losses.append(run.step(ids))
        synchronize(gpu)
        warm.append(time.perf_counter() - t0)
        log(f"    warm-up step {len(warm)}: {warm[-1]:.2f} s, loss {losses[-1]:.4f}")
    timed = setup.timed
    if math.isfinite(share_s):
        fits = int((share_s - sum(warm)) // max(warm[-1], 1e-6))
        timed = max(1, min(timed, fits))
    times = []
    for ids in batches[setup.warmup : setup.warmup + timed]:
        t0 = time.perf_counter()
        losses.append(run.step(ids))
        synchronize(gpu)
        times.append(time.perf_counter() - t0)
        log(f"    timed step {len(times)}: {times[-1]:.2f} s, loss {losses[-1]:.4f}")
    median = statistics.median(times)
    return {
        "warmup_steps": len(warm),
        "warmup_s": [round(t, 4) for t in warm],
        "step_s": [round(t, 4) for t in times],
        "step_s_median": median,
        "timed_steps": timed,
        "timed_steps_cut": timed < setup.timed,  # the budget's share allowed fewer than asked
        "tokens_per_s": setup.tokens_per_step / median,
        "losses": losses,
        "first_loss": losses[0],
    }


def measure_system(key, base, batches, setup, mode, gpu, share_s, log) -> dict:
    """One system in one mode: PASS with its figures, SKIP (a missing feature) or FAIL (an error)."""
    run = make_run(key, gpu)
    result = {"status": "FAIL", "devices": run.devices, "precision": run.precision}
    reset_gpu_peaks(gpu)
    t0 = time.perf_counter()
    try:
        model = fresh_model(base, setup, mode)
        result["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        run.open(model, setup, mode, gpu)
        if gpu:  # the peaks of training from here (fully_shard moves the whole model up first)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        result["setup_s"] = round(time.perf_counter() - t0, 2)
        log(f"  {mode} {key} on {run.devices}: ready in {result['setup_s']} s")
        result |= timed_steps(run, batches, setup, share_s - result["setup_s"], gpu, log)
        try:
            result |= run.figures(result["timed_steps"])
        except Exception as e:  # the timing stands; the extra figures say why they are missing
            result["figures_error"] = f"{type(e).__name__}: {e}"
        if gpu:
            result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        else:
            result["peak_gpu_allocated_bytes"] = result["peak_gpu_reserved_bytes"] = None
        result["status"] = "PASS"
    except Skip as e:
        result |= {"status": "SKIP", "reason": str(e)}
    except Exception as e:
        result["reason"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=8)
        log(result["traceback"])
    finally:
        try:
            run.close()
        except Exception as e:  # the figures are kept; the failure to close is reported with them
            result["close_error"] = f"{type(e).__name__}: {e}"
        model = None  # freed by the next system's reset_gpu_peaks (a collection costs 0.1 s here)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    log(f"  {mode} {key}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else ""))
    return result


def pinned_copy_peak(gpu: bool, nbytes: int = PINNED_COPY_BYTES, repeats: int = 5) -> dict:
    """The host->device rate of one large copy from page-locked memory (the link's practical peak);
    in a dry run a CPU memcpy of 64 MiB stands in (there is no link)."""
    if not gpu:
        nbytes = 64 << 20
        host, dev = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dev.copy_(host)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dev.copy_(host)
            times.append(time.perf_counter() - t0)
        what = "CPU memcpy (dry run: no host-device link)"
    else:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        what = "pinned host -> cuda:0, one copy on the default stream"
    del host, dev
    return {
        "what": what,
        "bytes": nbytes,
        "best_gb_per_s": nbytes / min(times) / 1e9,
        "median_gb_per_s": nbytes / statistics.median(times) / 1e9,
    }


# --------------------------------------------------------------------------- comparing
def add_ratios_and_bandwidth(systems: dict, pinned: dict) -> None:
    """Per system: tokens/s over each roundpipe run's; per roundpipe run: the upload rate reached."""
    for result in systems.values():
        if result.get("status") != "PASS":
            continue
        result["ratio_to"] = {
            key: result["tokens_per_s"] / systems[key]["tokens_per_s"]
            for key in ROUNDPIPE_SPECS
            if systems.get(key, {}).get("status") == "PASS"
        }
        if "h2d_bytes_per_step" in result:
            rate = result["h2d_bytes_per_step"] / result["step_s_median"] / 1e9
            result["h2d_gb_per_s"] = rate
            result["h2d_fraction_of_pinned_peak"] = rate / pinned["best_gb_per_s"]


def shortest_run(systems: dict) -> float:
    """Seconds the quickest measured system took to set up, warm up once and run one timed step:
    what another system of the same mode needs at least (0 before any was measured)."""
    runs = [
        r["setup_s"] + r["warmup_s"][0] + r["step_s_median"]
        for r in systems.values()
        if r.get("status") == "PASS"
    ]
    return min(runs, default=0.0)


def check_losses(systems: dict, rtol: float = LOSS_RTOL) -> dict:
    """The first-step losses against the first roundpipe run that passed (or any system)."""
    passed = {k: r["first_loss"] for k, r in systems.items() if r.get("status") == "PASS"}
    if not passed:
        return {"reference": None, "rtol": rtol, "mismatches": [], "ok": True, "compared": 0}
    reference = next((k for k in ROUNDPIPE_SPECS if k in passed), next(iter(passed)))
    ref = passed[reference]
    mismatches = [
        f"{key}: first loss {loss:.6f} vs {reference} {ref:.6f} (relative difference "
        f"{abs(loss - ref) / abs(ref):.2e} > rtol {rtol:g})"
        for key, loss in passed.items()
        if abs(loss - ref) > rtol * abs(ref)
    ]
    return {
        "reference": reference,
        "rtol": rtol,
        "mismatches": mismatches,
        "ok": not mismatches,
        "compared": len(passed),
    }


def versions(gpu: bool) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:
            out[name] = f"unimportable ({type(e).__name__})"
    out["gpu"] = torch.cuda.get_device_name(0) if gpu else None
    out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory if gpu else None
    return out


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def table(payload: dict) -> tuple[list[str], list[list[str]]]:
    header = ["mode", "system", "devices", "status", "tokens/s", "step s", "vs rp x1", "vs rp x2"]
    header += ["first loss", "GPU peak alloc / reserved GiB", "H2D GB/s (of pinned peak)"]
    rows = []
    for mode, block in payload["modes"].items():
        for key, r in block["systems"].items():
            if r.get("status") != "PASS":
                reason = r.get("reason", "")[:120].replace("|", "/")  # a "|" would split the cell
                rows.append([mode, key, str(r.get("devices")), r["status"], reason])
                rows[-1] += [""] * (len(header) - len(rows[-1]))
                continue
            ratio = r.get("ratio_to", {})
            h2d = r.get("h2d_gb_per_s")
            rows.append(
                [
                    mode,
                    key,
                    r["devices"],
                    "PASS",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['step_s_median']:.3f}",
                    f"{ratio['roundpipe_x1']:.2f}x" if "roundpipe_x1" in ratio else "-",
                    f"{ratio['roundpipe_x2']:.2f}x" if "roundpipe_x2" in ratio else "-",
                    f"{r['first_loss']:.4f}",
                    f"{_gib(r['peak_gpu_allocated_bytes'])} / {_gib(r['peak_gpu_reserved_bytes'])}",
                    "-" if h2d is None else f"{h2d:.3g} ({100 * r['h2d_fraction_of_pinned_peak']:.2g}%)",
                ]
            )
    return header, rows


def notes(payload: dict) -> str:
    setup, model = payload["setup"], payload["model"]
    pinned = payload["pinned_copy"]
    lines = [
        f"Model: {model['family']} from a config, {model['parameters']:,} parameters (formula "
        f"{model['parameters_formula']:,}), hidden {setup['hidden']}, {setup['layers']} layers, "
        f"vocab {setup['vocab']}, tied embeddings {setup['tied']}. Batch {setup['batch']} x "
        f"{setup['seq']} tokens per step ({setup['tokens_per_step']:,}); {setup['warmup']} warm-up + "
        f"up to {setup['timed']} timed steps, median. hf and fsdp2: micro-steps of {setup['rows']} "
        f"sequences. LoRA r={setup['lora_rank']} on all linear layers.",
        f"Precision: roundpipe {RoundpipeRun.precision}; hf {PlainHFRun.precision}; fsdp2 "
        f"{FSDP2Run.precision}.",
        "vs rp x1 / x2: the system's tokens/s over roundpipe_x1's / roundpipe_x2's (above 1x: faster "
        "than roundpipe). H2D: roundpipe's bytes uploaded per step (its devices' counters) over the "
        "median step time.",
        f"Pinned copy peak: {pinned['best_gb_per_s']:.1f} GB/s ({pinned['what']}, "
        f"{pinned['bytes'] / GiB:.2f} GiB).",
    ]
    for mode, block in payload["modes"].items():
        check = block["loss_check"]
        verdict = "agree" if check["ok"] else "DISAGREE: " + "; ".join(check["mismatches"])
        lines.append(
            f"{mode}: first-step losses of {check['compared']} systems {verdict} (rtol {check['rtol']:g} "
            f"against {check['reference']})."
        )
    hf = payload["modes"].get("full", {}).get("systems", {}).get("hf", {})
    if hf.get("status") == "PASS" and hf.get("peak_gpu_reserved_bytes") is not None:
        total = payload["versions"]["gpu_memory_bytes"]
        lines.append(
            f"Plain HF full fine-tuning fits this GPU: peak {_gib(hf['peak_gpu_reserved_bytes'])} GiB "
            f"reserved of {_gib(total)} GiB."
        )
    if payload["dry_run"]:
        lines.append("Dry run: cpu backend and a tiny model; the figures say nothing about speed.")
    return "\n\n".join(lines)


# --------------------------------------------------------------------------- the run
def run(setup: Setup, gpu: bool, budget: Budget, modes=MODES, systems=SYSTEMS, json_path=None, log=print):
    """Measure every system in every mode; returns the payload (also written to ``json_path``
    after each system, so a run cut short keeps what it measured)."""
    setup.check()
    unknown = [m for m in modes if m not in MODES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ConfigError(
            f"unknown mode or system {', '.join(unknown)}: modes are {', '.join(MODES)}, systems "
            f"{', '.join(SYSTEMS)}"
        )
    warnings.filterwarnings("ignore", category=FutureWarning)  # renamed HF helpers peft calls
    family, _ = config_class()
    t0 = time.perf_counter()
    base = build_base_model(setup, torch.device("cuda", 0) if gpu else torch.device("cpu"))
    built = sum(p.numel() for p in base.parameters())
    formula = parameter_count(setup, family)
    log(
        f"model: {family}, {built:,} parameters built ({formula:,} from the config numbers), "
        f"{time.perf_counter() - t0:.1f} s"
    )
    pinned = pinned_copy_peak(gpu)
    log(f"pinned copy peak: {pinned['best_gb_per_s']:.1f} GB/s ({pinned['what']})")
    batches = make_batches(setup, setup.warmup + setup.timed)
    payload = {
        "benchmark": "gpu_throughput",
        "dry_run": not gpu,
        "complete": False,
        "versions": versions(gpu),
        "model": {
            "family": family.removesuffix("Config"),
            "parameters": built,
            "parameters_formula": formula,
        },
        "setup": asdict(setup) | {"tokens_per_step": setup.tokens_per_step},
        "budget_s": budget.seconds,
        "pinned_copy": pinned,
        "modes": {m: {"systems": {}, "loss_check": check_losses({})} for m in modes},
    }
    # The roundpipe runs and plain HF first, mode by mode; FSDP2 (a process group, the likeliest to
    # stall) last, so that a hang there costs only its own figures.
    order = [(m, s) for m in modes for s in systems if s != "fsdp2"]
    order += [(m, "fsdp2") for m in modes if "fsdp2" in systems]
    for i, (mode, key) in enumerate(order):
        block = payload["modes"][mode]
        share = budget.left() / (len(order) - i)
        needs = max(5.0, shortest_run(block["systems"]))
        if budget.left() < needs:
            block["systems"][key] = {
                "status": "SKIP",
                "reason": f"{budget.left():.0f} s of the {budget.seconds:.0f} s budget left, under the "
                f"{needs:.0f} s the quickest {mode} system took to set up and run two steps",
            }
        else:
            block["systems"][key] = measure_system(key, base, batches, setup, mode, gpu, share, log)
        add_ratios_and_bandwidth(block["systems"], pinned)
        block["loss_check"] = check_losses(block["systems"])
        payload["elapsed_s"] = round(budget.elapsed(), 1)
        if json_path:
            write_json(payload, json_path)
    payload["complete"] = True
    if json_path:
        write_json(payload, json_path)
    return payload


def write_json(payload: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def failures(payload: dict) -> list[str]:
    out = []
    for mode, block in payload["modes"].items():
        out += [
            f"{mode} {k}: {r.get('reason')}" for k, r in block["systems"].items() if r["status"] == "FAIL"
        ]
        out += [f"{mode} loss check: {m}" for m in block["loss_check"]["mismatches"]]
        if not any(r["status"] == "PASS" for r in block["systems"].values()):
            out.append(f"{mode}: no system was measured (see each one's reason)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="cpu backend, tiny model, cpu:1 / cpu:2")
    parser.add_argument("--json", help="also write the JSON here (rewritten after every system)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for the run after the imports (default {GPU_BUDGET_S:.0f} on a GPU, none dry)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: lora, full")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="one decoder layer and one timed step (with --dry-run: the CI smoke)",
    )
    for name in ("layers", "seq", "batch", "rows", "warmup", "timed"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override the setup's {name}")
    args = parser.parse_args(argv)
    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        raise ConfigError(
            "torch sees no CUDA GPU: run with --dry-run for the cpu backend, or on a machine with one"
        )
    if args.dry_run:
        # One intra-op thread, as the tests run: on a small shared CPU, more threads than free
        # cores make these tiny bf16 matmuls ten times slower, not faster.
        torch.set_num_threads(1)
    setup = DRY_RUN_SETUP if args.dry_run else GPU_SETUP
    if args.tiny:
        setup = replace(setup, layers=1, warmup=1, timed=1)
    overrides = {n: getattr(args, n) for n in ("layers", "seq", "batch", "rows", "warmup", "timed")}
    setup = replace(setup, **{n: v for n, v in overrides.items() if v is not None})
    budget = Budget(args.budget_s if args.budget_s is not None else (None if args.dry_run else GPU_BUDGET_S))
    payload = run(
        setup,
        gpu,
        budget,
        modes=tuple(m for m in args.modes.split(",") if m),
        systems=tuple(s for s in args.systems.split(",") if s),
        json_path=args.json,
    )
    header, rows = table(payload)
    # A dry run has its own files, so that it never overwrites what a GPU measured.
    write_results(
        "gpu_throughput" if gpu else "gpu_throughput_dry_run", payload, rows, header, notes(payload)
    )
    problems = failures(payload)
    for line in problems:
        print("FAILED", line)
    print(f"gpu_throughput: {'FAIL' if problems else 'PASS'} in {budget.elapsed():.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
