"""What ``tests/test_cuda.py`` needs besides the tests: the device mapping of a dry run, version
checks that turn "too old" into a clean skip, peak-memory measurements, and the hook that lets
PyTorch's CUDA stream sanitizer see roundpipe's worker threads.

``scripts/gpu_check.sh`` runs the cuda tests on a GPU machine with that machine's own torch and
transformers; ``scripts/gpu_check.sh --dry-run`` runs the same tests here on the cpu backend by
setting ``ROUNDPIPE_GPU_CHECK_DRY_RUN=1``: device specs map to virtual cpu devices and the memory
test shrinks its model (see ``MemorySizes``).
"""

from __future__ import annotations

import configparser
import copy
import itertools
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

DRY_RUN = os.environ.get("ROUNDPIPE_GPU_CHECK_DRY_RUN", "") not in ("", "0")
ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20

# A dry run maps the GPU specs onto virtual cpu devices with as many workers.
_DRY_RUN_DEVICES = {"cuda:0": "cpu:1", "cuda:0x2": "cpu:2"}


def devices(spec: str) -> str:
    """The device spec a test runs on: ``spec`` on a GPU, its cpu twin in a dry run."""
    return _DRY_RUN_DEVICES[spec] if DRY_RUN else spec


def workers_per_gpu(spec: str) -> int:
    m = re.fullmatch(r"cuda:\d+x(\d+)", spec)
    return int(m.group(1)) if m else 1


def on_gpu() -> bool:
    return not DRY_RUN and torch.cuda.is_available()


# ----------------------------------------------------------------------------- versions
def parse_version(text: str) -> tuple[int, ...]:
    """``"2.5.1+cu124"`` -> ``(2, 5, 1)``; tolerant of local tags, rc/dev suffixes and short forms."""
    nums = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in nums) + (0,) * (3 - len(nums))


def installed_versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # missing or broken: say so in skip messages
            out[name] = f"unimportable ({type(e).__name__})"
    return out


def versions_line() -> str:
    v = installed_versions()
    cuda = torch.version.cuda or "no CUDA"
    return f"torch {v['torch']} ({cuda}), transformers {v['transformers']}, peft {v['peft']}"


def _requirements(text: str, op: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        m = re.match(rf"\s*(torch|transformers|peft)\s*{re.escape(op)}\s*([0-9][^\s,;]*)", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def minimum_versions() -> dict[str, str]:
    """The lower bounds roundpipe declares (setup.cfg ``install_requires``)."""
    try:
        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "setup.cfg")
        found = _requirements(cfg.get("options", "install_requires"), ">=")
    except Exception:
        found = {}
    return {"torch": "2.4", "transformers": "5.0", "peft": "0.14"} | found


def tested_versions() -> dict[str, str]:
    """The pinned, tested set (constraints.txt)."""
    try:
        return _requirements((ROOT / "constraints.txt").read_text(), "==")
    except OSError:
        return {}


def _compare(bounds: dict[str, str]) -> list[str]:
    have = installed_versions()
    older = []
    for name, bound in bounds.items():
        if have[name].startswith("unimportable"):
            older.append(f"{name} is {have[name]}")
        elif parse_version(have[name]) < parse_version(bound):
            older.append(f"{name} {have[name]} < {bound}")
    return older


def below_minimum() -> list[str]:
    """What is older than roundpipe supports at all (empty: nothing)."""
    return _compare(minimum_versions())


def older_than_tested() -> list[str]:
    """What is older than the tested set: a failure to build a test model there is a skip."""
    return _compare(tested_versions())


def transformers_has(*names: str) -> list[str]:
    """The names among ``names`` that this transformers lacks."""
    import transformers

    missing = []
    for name in names:
        try:
            getattr(transformers, name)
        except Exception:
            missing.append(name)
    return missing


def build_or_skip(what: str, build):
    """``build()``, turning a failure into a skip that names the versions when this machine's
    packages are older than the tested set (tests/support/tiny_models.py uses transformers 5 features:
    ``from_config(..., dtype=)``, ``layer_types``, Qwen3 / Gemma3 configs); a failure with the
    tested versions or newer is a real failure and is raised."""
    import pytest

    try:
        return build()
    except Exception as e:
        older = older_than_tested()
        if not older:
            raise
        pytest.skip(
            f"{what} cannot be built with {versions_line()} ({'; '.join(older)}; tested set in "
            f"constraints.txt): {type(e).__name__}: {e}"
        )


# ----------------------------------------------------------------------------- policies
def policy_accepts(policy: str, num_devices: int, microbatches: int) -> bool:
    """Whether ``policy`` builds a table for its default stage count (as tests/test_multiworker.py)."""
    from roundpipe.errors import ScheduleError
    from roundpipe.schedule import Partition, build_table

    stages = {"interleaved": 2 * num_devices, "hanayo": 2 * num_devices}.get(policy, num_devices)
    part = Partition.from_sizes([1] * stages)
    try:
        build_table(policy, part, part, num_devices, microbatches)
    except ScheduleError:
        return False
    return True


def equivalence_grid(policies, specs=("cuda:0x2", "cuda:0"), microbatches=(4, 2, 3, 8)):
    """One case per (policy, spec) the policy accepts; LoRA/full x strict/ready and the microbatch
    counts rotate over the cases, so every policy meets both device specs and every combination
    turns up without running the full product. Yields (policy, spec, microbatches, lora, order)."""
    variants = itertools.cycle(
        [(None, "strict"), ("default", "ready"), ("default", "strict"), (None, "ready")]
    )
    counts = itertools.cycle(microbatches)
    for policy in policies:
        for spec in specs:
            n = workers_per_gpu(spec)
            for _ in range(len(microbatches)):
                m = next(counts)
                if policy_accepts(policy, n, m):
                    break
            else:
                continue  # e.g. chimera needs two devices
            lora, order = next(variants)
            yield policy, spec, m, lora, order


# ----------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class MemorySizes:
    """The Llama of the memory test. On the GPU each decoder layer is 202M parameters (386 MiB in
    bf16, Llama-7B's shape); the vocabulary is small so that the embedding and the head are far
    smaller than a block. A dry run uses a ~2 MiB-per-layer twin."""

    hidden: int
    intermediate: int
    heads: int
    blocks: int
    vocab: int
    batch: int
    seq: int

    def config(self):
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.blocks,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=max(512, self.seq),
            tie_word_embeddings=False,
        )


GPU_SIZES = MemorySizes(hidden=4096, intermediate=11008, heads=32, blocks=3, vocab=1024, batch=16, seq=256)
DRY_RUN_SIZES = MemorySizes(hidden=256, intermediate=1024, heads=4, blocks=3, vocab=256, batch=8, seq=64)


def memory_sizes() -> MemorySizes:
    return DRY_RUN_SIZES if DRY_RUN else GPU_SIZES


def build_llama(sizes: MemorySizes):
    import transformers

    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(sizes.config(), attn_implementation="sdpa")
    except TypeError:  # a transformers without attn_implementation= in from_config
        model = transformers.AutoModelForCausalLM.from_config(sizes.config())
    return model.train()


def _cpu_peak(fn):
    """Peak bytes the CPU allocator held above the start while ``fn()`` ran (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak


def measure_peak(fn, device: torch.device):
    """``(fn(), peak bytes allocated above what was allocated before)`` on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    return _cpu_peak(fn)


@dataclass
class WorkingSet:
    """One worker's working set for one microbatch of ``rows`` samples, every figure in bytes.

    ``forward_backward``: measured peak of plain PyTorch running the largest decoder layer's forward
    (with autograd) and ``torch.autograd.grad`` w.r.t. its input and weights for one microbatch on
    the same device, weights and incoming tensors already there (the saved activations, the
    temporaries, the output and the compute-dtype gradients). ``accumulator``: the stage's fp32
    weight-gradient sum the runtime keeps (full fine-tuning). ``activations``: the task's incoming
    activation and incoming gradient. ``workspace``: what the first matmul + backward on a fresh
    stream allocates (cuBLAS workspace: each worker computes on its own stream; 0 on cpu).
    """

    rows: int
    forward_backward: int
    accumulator: int
    activations: int
    workspace: int

    @property
    def total(self) -> int:
        return self.forward_backward + self.accumulator + self.activations + self.workspace


def measure_workspace(device: torch.device, dtype: torch.dtype) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        w = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        torch.autograd.grad((x @ w).sum(), [x, w])
        del w, x
    stream.synchronize()
    return max(0, torch.cuda.memory_allocated(device) - base)


def measure_working_set(model, rows: int, seq: int, device: torch.device, dtype: torch.dtype) -> WorkingSet:
    """Plain PyTorch on ``device``: decoder layer 0 of ``model`` (all blocks have one shape)."""
    base = model.model if hasattr(model, "model") else model
    layer = copy.deepcopy(base.layers[0]).to(device=device, dtype=dtype)
    rotary = copy.deepcopy(base.rotary_emb).to(device=device)
    hidden = model.config.hidden_size
    x = torch.randn(rows, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, seq, hidden, device=device, dtype=dtype)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(rows, seq)
    with torch.no_grad():
        cos, sin = rotary(x, positions)
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward_backward():
        y = layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        y = y[0] if isinstance(y, tuple) else y  # transformers 4 returns a tuple
        return torch.autograd.grad([y], [x, *params], grad_outputs=[g])

    forward_backward()  # warm up: kernels, the cuBLAS workspace of this stream, allocator pools
    grads, peak = measure_peak(forward_backward, device)
    del grads
    accumulator = sum(4 * p.numel() for p in params)
    activations = 2 * x.numel() * x.element_size()
    workspace = measure_workspace(device, dtype)
    return WorkingSet(rows, peak, accumulator, activations, workspace)


def planning_ledger(dev):
    """The runtime's plan of what a device holds (``Device.ledger``; ``Device.memory`` before the
    measured device memory existed)."""
    return dev.ledger if hasattr(dev, "ledger") else dev.memory


def measured_memory_is_live(dev) -> bool:
    """True when ``Device.memory`` measures live bytes, separate from the planning ledger."""
    return hasattr(dev, "ledger") and dev.memory is not dev.ledger


# ----------------------------------------------------------------------------- CUDA sanitizer
def sanitizer_enabled() -> bool:
    """PyTorch's CUDA stream sanitizer is on (``TORCH_CUDA_SANITIZER`` set when torch was imported)."""
    if DRY_RUN or not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import _sanitizer
    except ImportError:
        return False
    return bool(getattr(_sanitizer.cuda_sanitizer, "enabled", False))


_SANITIZER_LOCK = threading.RLock()


@contextmanager
def sanitize_new_threads():
    """Make threads started inside run under the sanitizer too.

    ``TORCH_CUDA_SANITIZER=1`` enters the sanitizer's ``TorchDispatchMode`` on the importing thread
    only (dispatch modes are thread-local), while roundpipe issues every kernel from its worker
    threads. Each new thread enters a mode of its own that shares the global one's event handler,
    so accesses from all threads are checked against one record of streams, events and tensors.
    The handler is not thread-safe (a kernel's bookkeeping reads a global sequence number across a
    stack walk), so every mode's dispatch, the importing thread's included, takes one lock: kernels
    are launched one at a time, which changes no stream order. Blocking is safe: a GPU never waits
    on a host thread, so an op that synchronises while holding the lock finishes.
    """
    from torch.cuda import _sanitizer
    from torch.utils._python_dispatch import TorchDispatchMode

    base = _sanitizer.CUDASanitizerDispatchMode
    shared = _sanitizer.cuda_sanitizer.dispatch

    class SerialMode(base):
        def __init__(self):  # not base's: that would register a second set of trace callbacks
            TorchDispatchMode.__init__(self)
            self.event_handler = shared.event_handler

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            with _SANITIZER_LOCK:
                return super().__torch_dispatch__(func, types, args, kwargs)

    original_run = threading.Thread.run

    def run(self):
        with SerialMode():
            original_run(self)

    shared.__class__ = SerialMode  # the importing thread's mode takes the lock too
    threading.Thread.run = run
    try:
        yield
    finally:
        threading.Thread.run = original_run
        shared.__class__ = base


# ----------------------------------------------------------------------------- a slow GPU
@contextmanager
def slow_compute(factor: float = 3.0, sleep_cycles: int = 2_000_000):
    """Make every compute closure's work run late, so that the host issues far ahead of it: what a
    GPU slower than its host does, and what exposes a host-side effect that is right only when the
    work before it has finished (a buffer reused, a pinned buffer given back).

    On a GPU each compute closure is queued behind a ``torch.cuda._sleep`` of ``sleep_cycles``
    (about a millisecond at 2 GHz); in a dry run a ``slow`` fault makes each compute closure take
    ``factor`` times its time on the cpu devices' stream threads."""
    if not on_gpu():
        from roundpipe.testing import faults

        with faults.injected(faults.Fault("compute", kind="slow", factor=factor)):
            yield
        return
    from roundpipe.backend.cuda import CudaStream

    with compute_delayed(CudaStream, lambda: torch.cuda._sleep(sleep_cycles)):
        yield


@contextmanager
def compute_delayed(stream_class: type, delay):
    """Patch ``stream_class.submit`` so that each closure given to a compute stream calls
    ``delay()`` before its work (on a GPU: queues a sleep kernel ahead of it)."""
    submit = stream_class.submit

    def late(self, fn, *args, **kwargs):  # submit's other arguments, whatever they are, passed on
        if self.name != "compute":
            return submit(self, fn, *args, **kwargs)

        def behind_a_delay():
            delay()
            fn()

        return submit(self, behind_a_delay, *args, **kwargs)

    stream_class.submit = late
    try:
        yield
    finally:
        stream_class.submit = submit


@contextmanager
def compute_waits_removed():
    """Drop every wait the compute streams are given (the uploads of weights and inputs it must
    wait for): the negative control of a stream checker, which must flag the unordered reads."""
    if on_gpu():
        from roundpipe.backend.cuda import CudaStream as stream_class
    else:
        from roundpipe.backend.cpu import CpuStream as stream_class
    wait = stream_class.wait_event

    def skipped(self, event):
        if self.name != "compute":
            wait(self, event)

    stream_class.wait_event = skipped
    try:
        yield
    finally:
        stream_class.wait_event = wait
