"""Overhead of roundpipe's streaming runtime on one worker, against plain PyTorch.

Both sides train the same ~40M-parameter Llama-shaped model (fp32, full fine-tuning, AdamW) on the
same batches with one intra-op thread; the plain side uses per-layer activation checkpointing (HF's
``gradient_checkpointing_enable``), which recomputes exactly what roundpipe recomputes. Steps
alternate between the two so machine noise hits both alike; the medians' ratio is the figure.
Goal (issue 3): ratio <= 1.15. A third pipeline runs the same steps with the cpu backend's stream
sanitizer on (``RunConfig(sanitize=True)``, as in the tests), so its cost is measured side by side;
the other pipeline has it off.

    python benchmarks/overhead.py [--repeats 5] [--seq 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _common import llama_model, random_batch, write_results

import roundpipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = llama_model(hidden=512, layers=8, intermediate=2048, vocab=8192)
    params = sum(p.numel() for p in model.parameters())
    batch = random_batch(args.batch, args.seq, 8192)

    plain = copy.deepcopy(model)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def plain_step():
        loss = plain(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

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

        def pipe_step():
            pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()

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
        "last_step_stats": stats,
    }
    rows = [
        ["plain PyTorch + per-layer checkpointing", f"{p:.3f}", f"{tokens / p:,.0f}", "1.00"],
        ["roundpipe, cpu:1", f"{r:.3f}", f"{tokens / r:,.0f}", f"{r / p:.2f}"],
        ["roundpipe, cpu:1, stream sanitizer on", f"{c:.3f}", f"{tokens / c:,.0f}", f"{c / p:.2f}"],
    ]
    busy = stats["devices"][0]["busy_s"]
    notes = f"""
Model: Llama-shaped, {params / 1e6:.1f}M parameters (hidden 512, 8 layers, vocab 8192), fp32, full
fine-tuning, AdamW; batch {args.batch} x {args.seq} tokens, {args.microbatches} microbatches; one intra-op
thread. Medians of {args.repeats} alternating steps. Goal: ratio <= 1.15 (sanitizer off). The stream
sanitizer costs {c / r - 1:+.0%} per step on this model.

Last roundpipe step: {stats["step_s"]:.3f} s wall, compute stream busy {busy:.3f} s
({busy / stats["step_s"]:.0%}), host (gradient accumulation + optimizer) busy {stats["host_busy_s"]:.3f} s.
"""
    write_results("overhead", payload, rows, ["run", "step s (median)", "tokens/s", "ratio"], notes)


if __name__ == "__main__":
    main()
