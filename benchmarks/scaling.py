"""Scaling from one to two workers on two cores: roundpipe on ``cpu:2`` against ``cpu:1``.

The same Llama-shaped model (hidden 512) trains on the same batches with one intra-op thread per
worker; steps alternate between the two pipelines and the medians' ratio is the speed-up.
Goal (issue 3): >= 1.5x on 2 cores.

    python benchmarks/scaling.py [--repeats 5] [--microbatches 8]
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
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--policy", default="roundpipe")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = llama_model(hidden=512, layers=8, intermediate=2048, vocab=8192)
    batch = random_batch(args.batch, args.seq, 8192)
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

    def step(pipe):
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
        pipe.step()

    for pipe in pipes.values():
        for _ in range(args.warmup):
            step(pipe)
    times: dict[str, list[float]] = {d: [] for d in pipes}
    stats = {}
    for _ in range(args.repeats):
        for devices, pipe in pipes.items():
            t0 = time.perf_counter()
            step(pipe)
            times[devices].append(time.perf_counter() - t0)
            stats[devices] = pipe.stats()
    for pipe in pipes.values():
        pipe.close()
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
Llama-shaped model, hidden 512, 8 layers, fp32 full fine-tuning; batch {args.batch} x {args.seq},
{args.microbatches} microbatches, policy `{args.policy}`; one intra-op thread per worker stream; medians of
{args.repeats} alternating steps. Goal: speed-up >= 1.5x on 2 cores. Host (accumulation + optimizer)
busy in the last cpu:2 step: {stats["cpu:2"]["host_busy_s"]:.3f} s of {stats["cpu:2"]["step_s"]:.3f} s.
"""
    write_results(
        "scaling",
        payload,
        rows,
        ["devices", "step s (median)", "tokens/s", "speed-up", "compute busy"],
        notes,
    )


if __name__ == "__main__":
    main()
