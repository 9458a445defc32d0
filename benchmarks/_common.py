"""Shared helpers of the benchmarks: models built from configs, timing, result files.

torch is imported where a model or a batch is made, not at import: the simulator's benchmarks
(schedule_study, joint_tuning, sim_speed) write their results through this module without it, a
second less per run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS_ENV = (
    "ROUNDPIPE_BENCH_RESULTS"  # a directory that replaces benchmarks/results (e.g. a quick run into tmp)
)
RESULTS = Path(os.environ.get(RESULTS_ENV) or Path(__file__).resolve().parent / "results")


def results_dir() -> Path:
    """Where results go: ``$ROUNDPIPE_BENCH_RESULTS`` when set at call time, else :data:`RESULTS`.

    Read at each call, not only at import, so a caller that imports a benchmark first and sets the
    variable afterwards (a test, ``run_all``) still redirects its files."""
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else RESULTS


def llama_model(hidden: int, layers: int, intermediate: int, vocab: int, heads: int = 8, seed: int = 0):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """``input_ids`` of ``batch`` x ``seq`` random tokens and ``labels`` equal to them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


RTOL_FIRST = 1e-5  # first step: same weights, same batch, fp32: only summation order differs
RTOL_LATER = 1e-4  # later steps: the updates carry the round-off on, so "close"


def check_losses(
    losses: dict[str, list[float]], rtol_first: float = RTOL_FIRST, rtol_later: float = RTOL_LATER
) -> list[str]:
    """What disagrees, against the first system: empty when every loss agrees. ``losses``: per
    system, its loss at each step of a run in which every system trained the same weights on the
    same batches (a NaN disagrees with everything)."""
    names = list(losses)
    ref_name, ref = names[0], losses[names[0]]
    problems = []
    for name in names[1:]:
        got = losses[name]
        if len(got) != len(ref):
            problems.append(f"{name}: {len(got)} losses, {ref_name}: {len(ref)}")
            continue
        for i, (a, b) in enumerate(zip(got, ref)):
            rtol = rtol_first if i == 0 else rtol_later
            if not abs(a - b) <= rtol * abs(b):
                problems.append(
                    f"{name} step {i}: loss {a:.7f}, {ref_name} {b:.7f} (rel. diff {abs(a - b) / abs(b):.1e} > {rtol:.0e})"
                )
    return problems


def median_step_s(step, warmup: int, repeats: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def write_results(
    name: str, payload: dict, table_rows: list[list[str]], header: list[str], notes: str
) -> Path:
    """Write ``results/<name>.json`` and ``results/<name>.md`` (a markdown table + notes) into
    :func:`results_dir`."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        **payload,
        "machine": {"python": platform.python_version(), "torch": _torch_version(), "cpus": cores()},
    }
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows]
    md = f"# {name}\n\n" + "\n".join(lines) + "\n\n" + notes.strip() + "\n"
    (out / f"{name}.md").write_text(md)
    print(md)
    return out / f"{name}.md"


def _torch_version() -> str:
    """The installed torch's version, without importing it when nothing has."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
