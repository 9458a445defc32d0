"""Shared helpers of the benchmarks: models built from configs, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

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


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


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
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus()},
    }
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows]
    md = f"# {name}\n\n" + "\n".join(lines) + "\n\n" + notes.strip() + "\n"
    (out / f"{name}.md").write_text(md)
    print(md)
    return out / f"{name}.md"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
