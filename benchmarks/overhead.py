"""Overhead of roundpipe's streaming runtime on one worker, against plain PyTorch.

Both sides train the same ~40M-parameter Llama-shaped model (fp32, full fine-tuning, AdamW) on the
same batches with one intra-op thread; the plain side uses per-layer activation checkpointing (HF's
``activation_checkpointing_enable``), which recomputes exactly what roundpipe recomputes. Steps
alternate between the two so machine noise hits both alike; the medians' ratio is the figure.
Goal (issue 3): ratio <= 1.15. A third pipeline runs the same steps with the cpu backend's stream
sanitizer on (``RunConfig(sanitize=True)``, as in the tests), so its cost is measured side by side;
the other pipeline has it off. All three train the same weights on the same batch, so their losses
must agree step by step (exit status 1 if not).

    python benchmarks/overhead.py [--repeats 5] [--seq 256] [--batch 8] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _common import RTOL_FIRST, RTOL_LATER, check_losses, llama_model, random_batch, write_results

import roundpipe

MODEL = dict(hidden=512, layers=8, intermediate=2048, vocab=8192)
QUICK_MODEL = dict(hidden=64, layers=4, intermediate=128, vocab=512, heads=4)  # the CI smoke
PLAIN, PIPE, CHECKED = (
    "plain PyTorch + per-layer checkpointing",
    "roundpipe, cpu:1",
    "roundpipe, cpu:1, stream sanitizer on",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model, batch 4 x 16, 2 steps each (the CI smoke)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.seq, args.batch = 1, 16, 4
    shape = QUICK_MODEL if args.quick else MODEL
    torch.set_num_threads(1)

    model = llama_model(**shape)
    params = sum(p.numel() for p in model.parameters())
    batch = random_batch(args.batch, args.seq, shape["vocab"])
    losses: dict[str, list[float]] = {PLAIN: [], PIPE: [], CHECKED: []}

    plain = copy.deepcopy(model)
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def plain_step():
        loss = plain(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[PLAIN].append(float(loss.detach()))

    def make_pipe(sanitize: bool):
        config = roundpipe.RunConfig(
            devices="cpu:1",
            num_microbatches=args.microbatches,
            sanitize=sanitize,
            policy="roundpipe",
            partition=None,
        )
        pipe = roundpipe.wrap(copy.deepcopy(model), config)
        pipe.configure_optimizer(lr=1e-5)
        name = CHECKED if sanitize else PIPE

        def pipe_step():
            out = pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()
            losses[name].append(float(out.loss))

        return pipe, pipe_step

    pipe, pipe_step = make_pipe(sanitize=False)
    checked, checked_step = make_pipe(sanitize=True)
    for _ in range(args.warmup):
        plain_step()
        pipe_step()
        checked_step()
    plain_times, pipe_times, checked_times = [], [], []
    for _ in range(args.repeats):
        for step, times in (
            (plain_step, plain_times),
            (pipe_step, pipe_times),
            (checked_step, checked_times),
        ):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    stats = pipe.stats()
    pipe.close()
    checked.close()
    problems = check_losses(losses)
    p, r = statistics.median(plain_times), statistics.median(pipe_times)
    c = statistics.median(checked_times)
    tokens = args.batch * args.seq
    payload = {
        "model_params": params,
        "batch": args.batch,
        "seq": args.seq,
        "microbatches": args.microbatches,
        "plain_checkpointed_s": plain_times,
        "roundpipe_cpu1_s": pipe_times,
        "roundpipe_cpu1_sanitized_s": checked_times,
        "median_plain_s": p,
        "median_roundpipe_s": r,
        "median_roundpipe_sanitized_s": c,
        "ratio": r / p,
        "sanitizer_cost": c / r,
        "goal": 1.15,
        "model": shape,
        "quick": args.quick,
        "losses": losses,
        "loss_problems": problems,
        "last_step_stats": stats,
    }
    rows = [
        [PLAIN, f"{p:.3f}", f"{tokens / p:,.0f}", "1.00"],
        [PIPE, f"{r:.3f}", f"{tokens / r:,.0f}", f"{r / p:.2f}"],
        [CHECKED, f"{c:.3f}", f"{tokens / c:,.0f}", f"{c / p:.2f}"],
    ]
    busy = stats["devices"][0]["busy_s"]
    notes = f"""
Model: Llama-shaped, {params / 1e6:.1f}M parameters (hidden {shape["hidden"]}, {shape["layers"]} layers, vocab {shape["vocab"]}), fp32, full
fine-tuning, AdamW; batch {args.batch} x {args.seq} tokens, {args.microbatches} microbatches; one intra-op
thread. Medians of {args.repeats} alternating steps. Goal: ratio <= 1.15 (sanitizer off). The stream
sanitizer costs {c / r - 1:+.0%} per step on this model.

Last roundpipe step: {stats["step_s"]:.3f} s wall, compute stream busy {busy:.3f} s
({busy / stats["step_s"]:.0%}), host (gradient accumulation + optimizer) busy {stats["host_busy_s"]:.3f} s.

Losses: {"the three agree at every step" if not problems else "DISAGREE: " + "; ".join(problems)} (first
step rtol {RTOL_FIRST:.0e}, later steps {RTOL_LATER:.0e}; last {", ".join(f"{v[-1]:.6f}" for v in losses.values())}).
"""
    write_results("overhead", payload, rows, ["run", "step s (median)", "tokens/s", "ratio"], notes)
    if problems:
        print("loss mismatch:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
