"""Scaling from one to two workers on two cores: roundpipe on ``cpu:2`` against ``cpu:1``.

The same Llama-shaped model (hidden 512) trains on the same batches with one intra-op thread per
worker; steps alternate between the two pipelines and the medians' ratio is the speed-up.
Goal (issue 3): >= 1.5x on 2 cores. Both pipelines train the same weights on the same batch, so
their losses must agree step by step (exit status 1 if not).

    python benchmarks/scaling.py [--repeats 5] [--microbatches 8] [--quick]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--policy", default="roundpipe")
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model, batch 4 x 16, 2 steps each (the CI smoke)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.seq, args.batch, args.microbatches = 1, 16, 4, 4
    shape = QUICK_MODEL if args.quick else MODEL
    torch.set_num_threads(1)

    model = llama_model(**shape)
    batch = random_batch(args.batch, args.seq, shape["vocab"])
    pipes = {}
    for devices in ("cpu:1", "cpu:2"):
        config = roundpipe.RunConfig(
            devices=devices,
            num_microbatches=args.microbatches,
            policy=args.policy,
            partition=None,
            sanitize=False,
        )
        pipes[devices] = roundpipe.wrap(copy.deepcopy(model), config)
        pipes[devices].configure_optimizer(lr=1e-5)

    losses: dict[str, list[float]] = {d: [] for d in pipes}

    def step(devices):
        out = pipes[devices].forward_backward(batch["input_ids"], labels=batch["labels"])
        pipes[devices].step()
        losses[devices].append(float(out.loss))

    for devices in pipes:
        for _ in range(args.warmup):
            step(devices)
    times: dict[str, list[float]] = {d: [] for d in pipes}
    stats = {}
    for _ in range(args.repeats):
        for devices, pipe in pipes.items():
            t0 = time.perf_counter()
            step(devices)
            times[devices].append(time.perf_counter() - t0)
            stats[devices] = pipe.stats()
    for pipe in pipes.values():
        pipe.close()
    problems = check_losses(losses)
    one, two = statistics.median(times["cpu:1"]), statistics.median(times["cpu:2"])
    tokens = args.batch * args.seq
    payload = {
        "policy": args.policy,
        "batch": args.batch,
        "seq": args.seq,
        "microbatches": args.microbatches,
        "step_s": times,
        "median_cpu1_s": one,
        "median_cpu2_s": two,
        "speedup": one / two,
        "goal": 1.5,
        "model": shape,
        "quick": args.quick,
        "losses": losses,
        "loss_problems": problems,
        "last_step_stats": stats,
    }
    rows = [
        [
            d,
            f"{t:.3f}",
            f"{tokens / t:,.0f}",
            f"{one / t:.2f}x",
            ", ".join(f"{x['busy_s'] / stats[d]['step_s']:.0%}" for x in stats[d]["devices"]),
        ]
        for d, t in (("cpu:1", one), ("cpu:2", two))
    ]
    notes = f"""
Llama-shaped model, hidden {shape["hidden"]}, {shape["layers"]} layers, fp32 full fine-tuning; batch {args.batch} x {args.seq},
{args.microbatches} microbatches, policy `{args.policy}`; one intra-op thread per worker stream; medians of
{args.repeats} alternating steps. Goal: speed-up >= 1.5x on 2 cores. Host (accumulation + optimizer)
busy in the last cpu:2 step: {stats["cpu:2"]["host_busy_s"]:.3f} s of {stats["cpu:2"]["step_s"]:.3f} s.

Losses: {"cpu:1 and cpu:2 agree at every step" if not problems else "DISAGREE: " + "; ".join(problems)}
(first step rtol {RTOL_FIRST:.0e}, later steps {RTOL_LATER:.0e}; last {losses["cpu:1"][-1]:.6f} / {losses["cpu:2"][-1]:.6f}).
"""
    write_results(
        "scaling",
        payload,
        rows,
        ["devices", "step s (median)", "tokens/s", "speed-up", "compute busy"],
        notes,
    )
    if problems:
        print("loss mismatch:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
