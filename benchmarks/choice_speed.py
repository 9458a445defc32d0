"""How long the runtime's automatic choice (``roundpipe.sim.choice.choose``) takes: a 100-layer
model (the last layer the head) with measured-looking times on 8 devices, every executable policy,
batch 64. Writes the median of ``--repeats`` runs to ``results/choice_speed.{json,md}``; the choice
runs once per batch shape, after the first step's profile. No torch.

    .venv/bin/python benchmarks/choice_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _common import write_results

from roundpipe.config import known_policies
from roundpipe.partition.cost import LayerCost
from roundpipe.schedule import POLICIES
from roundpipe.sim.choice import choose

LAYERS, DEVICES, BATCH, SEQ = 100, 8, 64, 128


def _costs(tokens: float) -> list[LayerCost]:
    return [
        LayerCost(
            f"l{i}",
            0.0,
            0.0,
            param_bytes=1 << 20,
            trainable_params=1,
            act_in_bytes=int(tokens) * 8,
            work_bytes=int(tokens) * 64,
            kind="head" if i == LAYERS - 1 else "block",
            recompute=i < LAYERS - 1,
        )  # fmt: skip
        for i in range(LAYERS)
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(1)
    times = [(1e-3 * (1 + 0.1 * rng.random()), 2e-3 * (1 + 0.1 * rng.random())) for _ in range(LAYERS)]
    policies = [p for p in POLICIES if p in known_policies()]
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        choice = choose(
            times, 1024.0, _costs, num_devices=DEVICES, batch=BATCH, seq_len=SEQ, policies=policies
        )
        runs.append(time.perf_counter() - t0)
    median = statistics.median(runs)
    rows = [[f"{LAYERS}", f"{DEVICES}", f"{BATCH} x {SEQ}", f"{len(policies)}", f"{median:.3f}", f"{min(runs):.3f}",
             choice.best.policy]]  # fmt: skip
    notes = f"""
`roundpipe.sim.choice.choose` over {", ".join(policies)}: median and minimum of {len(runs)} runs on this
machine. The runtime makes this choice once per batch shape, after the first step's profile.
"""
    write_results(
        "choice_speed",
        {"layers": LAYERS, "devices": DEVICES, "batch": BATCH, "seq": SEQ, "policies": policies,
         "seconds": runs, "median_s": median, "chose": choice.best.policy},
        rows,
        ["layers", "devices", "batch", "policies", "median s", "min s", "chose"],
        notes,
    )  # fmt: skip


if __name__ == "__main__":
    main()
