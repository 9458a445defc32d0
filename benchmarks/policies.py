"""Simulated comparison of every dispatch policy, and device scaling, on 8x RTX 4090.

For Qwen3-1.7B, Llama-3.1-8B and Qwen3-32B (full fine-tuning) and Qwen3-235B-A22B (LoRA r=16) at
sequence length 4096 and 64 sequences per step, the tuner (``roundpipe.sim.tune``) searches each
policy's microbatch counts and stage grains; the table keeps each policy's best configuration
(the fastest that fits, else the fastest). A second table scales Llama-3.1-8B over 1/2/4/8 GPUs
(roundpipe against the weight-bound policies), and a third repeats Qwen3-1.7B with weight
gradients sent down after every task (a what-if: the runtime sums them on the device).
Timelines of the tuned configurations are drawn next to the tables.

Writes ``docs/policies.md``, ``docs/policies.json`` and ``docs/figures/*.png``. No GPU, no torch:

    .venv/bin/python benchmarks/policies.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from roundpipe.schedule import POLICIES
from roundpipe.sim.gantt import save_gantt
from roundpipe.sim.options import SimOptions
from roundpipe.sim.report import jsonable
from roundpipe.sim.scenario import Scenario, prepare
from roundpipe.sim.simulator import simulate
from roundpipe.sim.tune import Candidate, tune

ROOT = Path(__file__).resolve().parents[1]
# A smoke run (benchmarks/run_all.py --quick) sets ROUNDPIPE_BENCH_RESULTS: everything goes there.
DOCS = (
    Path(os.environ["ROUNDPIPE_BENCH_RESULTS"])
    if os.environ.get("ROUNDPIPE_BENCH_RESULTS")
    else ROOT / "docs"
)
FIGURES = DOCS / "figures"
HARDWARE = "8xrtx4090"
SEQ_LEN = 4096
GLOBAL_BATCH = 64
MODELS = (
    ("qwen3-1.7b", None),
    ("llama3.1-8b", None),
    ("qwen3-32b", None),
    ("qwen3-235b-a22b", 16),
)
WEIGHT_BOUND = tuple(name for name, spec in POLICIES.items() if spec.weight_bound)


def best_per_policy(ranked: tuple[Candidate, ...]) -> dict[str, Candidate]:
    out: dict[str, Candidate] = {}
    for c in ranked:  # ranked: fitting first, then by tokens/s
        out.setdefault(c.policy, c)
    return out


def row(model: str, lora, c: Candidate) -> dict:
    r = c.result
    return {
        "model": model,
        "tuning": "full" if lora is None else f"LoRA r={lora}",
        "policy": c.policy,
        "microbatches": c.num_microbatches,
        "stages": f"{c.stages[0]}/{c.stages[1]}",
        "head_shards": c.head_shards,
        "tokens_per_s": r.tokens_per_s,
        "iteration_s": r.iteration_s,
        "mfu": r.mfu,
        "bubble_total": r.bubble_total,
        "bubble_ideal": r.bubble_ideal,
        "peak_gpu_gib": r.peak_gpu / 2**30,
        "peak_host_gib": r.peak_host_bytes / 2**30,
        "h2d_gb": r.h2d_bytes / 1e9,
        "d2h_gb": r.d2h_bytes / 1e9,
        "fits": r.fits,
        "reason": r.reason,
    }


def md_table(rows: list[dict], first: str = "model") -> list[str]:
    head = f"| {first} | policy | mb | stages F/B | tokens/s | step s | MFU | bubble (idle/total) | GPU GiB | host GiB | PCIe up/down GB | fits |"
    out = [head, "|" + "---|" * head.count("|")[:-1] if False else "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        step = f"{r['iteration_s']:.2f}" if r["iteration_s"] and math.isfinite(r["iteration_s"]) else "-"
        bubble = (
            f"{r['bubble_total']:.1%}"
            if isinstance(r["bubble_total"], float) and math.isfinite(r["bubble_total"])
            else "-"
        )
        fits = "yes" if r["fits"] else "no: " + r["reason"].split(";")[0][:110]
        out.append(
            f"| {r[first]} | {r['policy']} | {r['microbatches']} | {r['stages']} | {r['tokens_per_s']:,.0f} | {step} | "
            f"{r['mfu']:.1%} | {bubble} | {r['peak_gpu_gib']:.1f} | {r['peak_host_gib']:.0f} | "
            f"{r['h2d_gb']:.0f}/{r['d2h_gb']:.0f} | {fits} |"
        )
    return out


def draw(model: str, lora, c: Candidate, path: Path, options: SimOptions) -> None:
    s = Scenario(
        model, HARDWARE, c.policy, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, microbatches=c.num_microbatches,
        lora_rank=lora, stages=c.stages if POLICIES[c.policy].separate_partitions else c.stages[0],
        head_shards=c.head_shards,
    )  # fmt: skip
    prep = prepare(s)
    from roundpipe.schedule import build_table

    opts = {k: v for k, v in prep.table.options.items() if k != "weight_bound"}
    table = build_table(c.policy, c.forward, c.backward, prep.table.num_devices, c.num_microbatches, **opts)
    res = simulate(table, prep.workload, prep.hardware, replace(options, record_timeline=True))
    tune_s = "full" if lora is None else f"LoRA r={lora}"
    title = (
        f"{model} ({tune_s}) on {HARDWARE}, {c.policy}, {c.num_microbatches} microbatches, stages {c.stages[0]}/{c.stages[1]}: "
        f"{res.iteration_s:.2f} s/step, {res.tokens_per_s:,.0f} tokens/s, bubble {res.bubble_total:.1%}"
    )
    save_gantt(res.timeline, str(path), title=title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small time budgets (a smoke run)")
    args = ap.parse_args()
    budget = 8.0 if args.quick else 45.0
    FIGURES.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    record: dict = {
        "hardware": HARDWARE,
        "seq_len": SEQ_LEN,
        "global_batch": GLOBAL_BATCH,
        "policies": [],
        "scaling": [],
    }
    md = [
        "# Simulated policy comparison",
        "",
        f"Written by `benchmarks/policies.py` (simulator, no GPU): {HARDWARE}, sequence length {SEQ_LEN}, "
        f"{GLOBAL_BATCH} sequences per step, bf16, exact (sync) optimizer. Each policy's best configuration from the "
        "tuner (microbatch count and stage grain searched). `fits: no` rows show what the step would cost if memory "
        "allowed and why it does not fit. See [simulator.md](simulator.md) for the model behind the numbers.",
        "",
    ]
    figures = []
    for model, lora in MODELS:
        res = tune(
            model, HARDWARE, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, lora_rank=lora, time_budget_s=budget
        )
        best = best_per_policy(res.ranked)
        rows = [row(model, lora, best[p]) for p in POLICIES if p in best]
        rows.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"]))
        record["policies"] += rows
        tuning = "full fine-tuning" if lora is None else f"LoRA r={lora}"
        md += [f"## {model}, {tuning}", "", *md_table(rows), ""]
        rp = best.get("roundpipe")
        wb = [best[p] for p in WEIGHT_BOUND if p in best]
        wb_fit = [c for c in wb if c.fits] or wb
        top_wb = max(wb_fit, key=lambda c: c.result.tokens_per_s) if wb_fit else None
        if rp is not None and top_wb is not None:
            ratio = (
                rp.result.tokens_per_s / top_wb.result.tokens_per_s
                if top_wb.result.tokens_per_s
                else math.inf
            )
            md += [
                f"roundpipe / best weight-bound ({top_wb.policy}{'' if top_wb.fits else ', does not fit'}): "
                f"**{ratio:.2f}x** tokens/s.",
                "",
            ]
        for c in (rp, top_wb if top_wb is not None and top_wb.fits else None):
            if c is not None and c.fits:
                name = f"{model}-{c.policy}.png"
                draw(model, lora, c, FIGURES / name, SimOptions())
                figures.append((model, c.policy, name))
                md += [f"![{model} {c.policy}](figures/{name})", ""]

    # Device scaling: Llama-3.1-8B, full fine-tuning.
    md += ["## Scaling: llama3.1-8b, full fine-tuning, 1/2/4/8 GPUs", ""]
    scale_rows = []
    for n in (1, 2, 4, 8):
        res = tune(
            "llama3.1-8b", HARDWARE, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, num_devices=n,
            policies=["roundpipe", "1f1b", "interleaved", "zb"] if n > 1 else ["roundpipe", "1f1b"],
            time_budget_s=budget,
        )  # fmt: skip
        best = best_per_policy(res.ranked)
        for p in ("roundpipe", "1f1b", "interleaved", "zb"):
            if p in best:
                r = row("llama3.1-8b", None, best[p])
                r["gpus"] = n
                scale_rows.append(r)
    record["scaling"] = scale_rows
    md += md_table(scale_rows, first="gpus") + [""]
    base = {r["policy"]: r["tokens_per_s"] for r in scale_rows if r["gpus"] == 1}
    rp_rows = [r for r in scale_rows if r["policy"] == "roundpipe"]
    if rp_rows and base.get("roundpipe"):
        md += [
            "roundpipe speed-up over 1 GPU: "
            + ", ".join(f"{r['gpus']} GPUs {r['tokens_per_s'] / base['roundpipe']:.2f}x" for r in rp_rows),
            "",
        ]

    # What-if: weight gradients sent down after every task instead of summed on the device.
    md += [
        "## What-if: Qwen3-1.7B with weight gradients sent down per microbatch",
        "",
        "The runtime sums a stage's weight gradients on the device (fp32) while the device keeps "
        "backpropagating that stage and sends them down once. Sending them after every task instead "
        "(full fine-tuning: the whole model's fp32 gradients per microbatch) makes every policy "
        "PCIe-bound:",
        "",
    ]
    per_task = SimOptions(accumulate_grads=False)
    res = tune(
        "qwen3-1.7b",
        HARDWARE,
        seq_len=SEQ_LEN,
        global_batch=GLOBAL_BATCH,
        options=per_task,
        time_budget_s=budget,
    )
    best = best_per_policy(res.ranked)
    acc_rows = [row("qwen3-1.7b", None, best[p]) for p in POLICIES if p in best]
    acc_rows.sort(key=lambda r: (not r["fits"], -r["tokens_per_s"]))
    record["per_microbatch_grads"] = acc_rows
    md += md_table(acc_rows) + [""]
    if "roundpipe" in best and best["roundpipe"].fits:
        c = best["roundpipe"]
        name = "qwen3-1.7b-roundpipe-per-microbatch-grads.png"
        draw("qwen3-1.7b", None, c, FIGURES / name, per_task)
        md += [f"![qwen3-1.7b roundpipe, gradients sent down per microbatch](figures/{name})", ""]
    md += [f"_Generated in {time.monotonic() - t0:.0f} s._", ""]
    (DOCS / "policies.md").write_text("\n".join(md), encoding="utf-8")
    (DOCS / "policies.json").write_text(json.dumps(jsonable(record), indent=1), encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
