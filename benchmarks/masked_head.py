"""What skipping unlabelled tokens in the LM head saves: one step with and without, side by side.

A 4-layer Llama (hidden 512, vocabulary 32,000, so the head is most of the work) on ``cpu:1``,
batch 4 x 512 tokens whose first half is a prompt (labels -100). "all tokens" is the runtime with
the loss positions withheld, so the head computes logits for every token, as it did before;
"label tokens" is the runtime as shipped. The two alternate, ``--rounds`` times each, and must give
the same loss (up to summation order, 1e-6).

    python benchmarks/masked_head.py [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch
from _common import llama_model, median_step_s, write_results

import roundpipe
import roundpipe.runtime.inputs as inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    model = llama_model(hidden=512, layers=4, intermediate=1376, vocab=32000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (4, 512), generator=g)
    labels = ids.clone()
    labels[:, :256] = -100
    shipped = inputs.loss_positions
    times: dict[str, list[float]] = {"all tokens": [], "label tokens": []}
    losses: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, positions in (("all tokens", lambda labels: None), ("label tokens", shipped)):
            inputs.loss_positions = positions
            try:
                with roundpipe.wrap(
                    model,
                    roundpipe.RunConfig(
                        devices="cpu:1", num_microbatches=2, policy="roundpipe", partition=None
                    ),
                ) as pipe:

                    def step(pipe=pipe, name=name):
                        losses[name] = float(pipe.forward_backward(ids, labels=labels).loss)
                        pipe.zero_grad()

                    median, _ = median_step_s(step, warmup=1, repeats=args.steps)
            finally:
                inputs.loss_positions = shipped
            times[name].append(median)
    if not math.isclose(losses["all tokens"], losses["label tokens"], rel_tol=1e-6):
        raise SystemExit(f"losses differ: {losses}")
    load = {"start": load_start, "end": os.getloadavg()[0]}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = med["all tokens"] / med["label tokens"]
    rows = [[name, f"{med[name]:.2f}", ", ".join(f"{t:.2f}" for t in times[name])] for name in times]
    notes = f"""
Speed-up from skipping unlabelled tokens: **{ratio:.2f}x** (median of {args.rounds} alternating
rounds, each the median of {args.steps} steps after one warm-up). Same loss both ways
({losses["all tokens"]:.6f} vs {losses["label tokens"]:.6f}). Half the tokens carry a label; the head's share of this model's
work is what the skip can save, so a deeper model gains less. Load average (1 min) of the machine
at the start and the end: {load["start"]:.1f}, {load["end"]:.1f} (2 cores: above that, other processes
took core time from the rounds measured).
"""
    write_results(
        "masked_head",
        {
            "seconds": times,
            "median_s": med,
            "speedup": ratio,
            "loss": losses["label tokens"],
            "load_average": load,
        },
        rows,
        ["head computes", "median step s", "rounds"],
        notes,
    )


if __name__ == "__main__":
    main()
