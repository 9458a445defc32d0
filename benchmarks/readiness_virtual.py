"""Readiness-first against fixed order on the virtual 4x RTX 4090 server, against the simulator.

``benchmarks/readiness.py`` measured strict against ready order on ``cpu:4`` and stayed inside the
noise: the four virtual cpu devices share two cores, so one device's idle time went to another's
compute. On the virtual server (``roundpipe/backend/virtual.py``) device time is modelled, so a
device's idle time is lost as on GPUs. Every executable policy runs a Llama-3.1-8B-shaped model
(``LAYERS`` decoder layers, meta weights) on ``virtual:4xrtx4090`` in both orders, steps alternating,
in four cases:

- ``none``: every sample ``FIXED`` tokens;
- ``variable length``: SFT-like log-normal lengths (median ``LENGTHS["median"]``), right padded,
  each microbatch cut to its own longest sample, a new draw every step;
- ``slow device``: the ``none`` batches with virtual:1 ``--slow`` times slower
  (``backend.vary(slowdown=...)``);
- ``jitter``: the ``none`` batches with each task's time times a log-normal factor of sigma
  ``SIM_JITTER`` (``backend.vary(jitter=...)``, as the simulator's ``SimOptions(jitter=...)``).

The simulator replays each policy's table with the same layer costs (``backend.costs``), lengths,
slow device and jitter. Reported per policy and case: median step time strict and ready, the
speed-up, tasks run ahead, and the simulator's speed-up beside it.

    python benchmarks/readiness_virtual.py [--quick]

Writes ``benchmarks/results/readiness_virtual.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from _common import write_results  # noqa: E402
from readiness import ORDERS, SIM_JITTER, SLOW_DEVICE, _paired_noise, compute_order, ran_ahead, verdict  # noqa: E402
from virtual_server import Case, meta_model  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.sim.options import SimOptions  # noqa: E402
from roundpipe.sim.simulator import simulate  # noqa: E402

DEVICES = 4
HARDWARE = f"{DEVICES}xrtx4090"
LAYERS = 8
POLICIES = ("gpipe", "1f1b", "interleaved", "chimera", "hanayo", "roundpipe")
CASES = ("none", "variable length", "slow device", "jitter")
# An SFT-like length distribution (median 256, sigma 0.8, cap 1024) scaled by 8, so that each task's
# modelled GPU time is large against the host's issue of it.
LENGTHS = dict(median=2048, sigma=0.8, cap=8192, minimum=256)
MICROBATCHES = 8


def lengths_of(n: int, g: torch.Generator) -> list[int]:
    z = torch.randn(n, generator=g, dtype=torch.float64)
    raw = torch.exp(
        torch.log(torch.tensor(float(LENGTHS["median"]), dtype=torch.float64)) + LENGTHS["sigma"] * z
    )
    return [int(min(LENGTHS["cap"], max(LENGTHS["minimum"], round(float(x))))) for x in raw]


def batch_of(lengths: list[int], g: torch.Generator) -> dict:
    width = max(lengths)
    ids = torch.randint(3, 1000, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run_policy(policy: str, layers: int, steps: int, slow: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    variable = [lengths_of(MICROBATCHES, g) for _ in range(steps)]
    fixed = round(statistics.mean(n for ls in variable for n in ls))
    batches = {
        "none": [batch_of([fixed] * MICROBATCHES, g)] * steps,
        "variable length": [batch_of(ls, g) for ls in variable],
    }
    pipes = {}
    for order in ORDERS:
        config = roundpipe.RunConfig(
            devices=f"virtual:{HARDWARE}", dtype="bf16", policy=policy, partition=None, order=order,
            num_microbatches=MICROBATCHES, sanitize=False, seed=seed,
        )  # fmt: skip
        pipes[order] = roundpipe.wrap(
            meta_model(Case("", "llama3.1-8b", HARDWARE, 1, 1, layers=layers)), config
        )
        pipes[order].configure_optimizer(lr=1e-5)
    out: dict = {}
    try:
        for order in ORDERS:  # warm-up: the profile and the plan of both shapes
            for b in batches.values():
                _step(pipes[order], b[0])
        for case in CASES:
            times: dict[str, list[float]] = {o: [] for o in ORDERS}
            seen: dict[str, dict] = {}
            source = batches["variable length" if case == "variable length" else "none"]
            for n, batch in enumerate(source):
                for order in ORDERS if n % 2 == 0 else ORDERS[::-1]:
                    pipe = pipes[order]
                    pipe.backend.vary(
                        jitter=SIM_JITTER if case == "jitter" else 0.0, seed=seed + n,
                        slowdown=tuple(slow if case == "slow device" and d == SLOW_DEVICE else 1.0
                                       for d in range(DEVICES)),
                    )  # fmt: skip
                    t0 = time.perf_counter()
                    _step(pipe, batch)
                    times[order].append(time.perf_counter() - t0)
                    seen[order] = compute_order(pipe)
                pipe.backend.vary()
            table_order = seen["strict"]
            out[case] = {
                "median_s": {o: statistics.median(times[o]) for o in ORDERS},
                "noise": _paired_noise(times["strict"], times["ready"]),
                "ran_ahead": sum(
                    ran_ahead(seen["ready"].get(d, []), names) for d, names in table_order.items()
                ),
                "tasks": sum(len(names) for names in table_order.values()),
            }
            out[case]["speedup"] = out[case]["median_s"]["strict"] / out[case]["median_s"]["ready"]
        table = pipes["strict"].last_plan.table
        costs = pipes["strict"].backend.costs
        server = pipes["strict"].backend.server
    finally:
        for pipe in pipes.values():
            pipe.close()
    workload = costs._workload(1, fixed)
    sim_runs = {
        "none": [(workload, {})],
        "variable length": [
            (dataclasses.replace(workload, microbatch_sizes=tuple(ls), micro_batch_size=fixed), {})
            for ls in variable
        ],
        "slow device": [
            (workload, {"slowdown": tuple(slow if d == SLOW_DEVICE else 1.0 for d in range(DEVICES))})
        ],
        "jitter": [(workload, {"jitter": SIM_JITTER, "jitter_seed": s}) for s in range(5)],
    }
    for case, runs in sim_runs.items():
        res = {o: [simulate(table, w, server, SimOptions(order=o, **kw)) for w, kw in runs] for o in ORDERS}
        med = {o: statistics.median(r.iteration_s for r in res[o]) for o in ORDERS}
        out[case]["sim_median_s"] = med
        out[case]["sim_speedup"] = med["strict"] / med["ready"]
        out[case]["sim_ran_ahead"] = statistics.median(r.reordered for r in res["ready"])
        out[case]["verdict"] = verdict(out[case]["speedup"], out[case]["noise"], out[case]["ran_ahead"])
    return {"fixed_tokens": fixed, "cases": out}


def _step(pipe, batch: dict) -> None:
    pipe.forward_backward(batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"])
    pipe.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two policies, two layers, two steps (the CI smoke)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per order and case")
    ap.add_argument(
        "--slow", type=float, default=2.0, help="how many times slower virtual:1 is in 'slow device'"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    policies = ("1f1b", "roundpipe") if args.quick else POLICIES
    layers, steps = (2, 2) if args.quick else (LAYERS, args.steps)
    load = os.getloadavg()[0]
    results = {}
    started = time.perf_counter()
    for policy in policies:
        results[policy] = run_policy(policy, layers, steps, args.slow, args.seed)
        print(f"{policy}: {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for policy, r in results.items():
        for case, c in r["cases"].items():
            rows.append(
                [policy, case, f"{c['median_s']['strict']:.3f}", f"{c['median_s']['ready']:.3f}",
                 f"{c['speedup']:.2f}x", f"±{c['noise']:.0%}", f"{c['ran_ahead']}/{c['tasks']}", c["verdict"],
                 f"{c['sim_median_s']['strict']:.3f}", f"{c['sim_median_s']['ready']:.3f}",
                 f"{c['sim_speedup']:.2f}x", f"{c['sim_ran_ahead']:.0f}"]
            )  # fmt: skip
    header = [
        "policy", "case", "strict s", "ready s", "speed-up", "noise", "ran ahead", "verdict",
        "sim strict s", "sim ready s", "sim speed-up", "sim ran ahead",
    ]  # fmt: skip
    notes = (
        f"Llama-3.1-8B layer shapes, {layers} decoder layers, bf16 full fine-tuning on virtual:{HARDWARE}, "
        f"{MICROBATCHES} one-sample microbatches per step, each policy's automatic partition, sync optimizer; "
        f"{steps} measured steps per order and case after warm-up, the orders alternating; medians. "
        f"Variable lengths: log-normal, median {LENGTHS['median']}, sigma {LENGTHS['sigma']}, clipped to "
        f"[{LENGTHS['minimum']}, {LENGTHS['cap']}]; the other cases use their mean. Slow device: virtual:"
        f"{SLOW_DEVICE} {args.slow:g}x slower; jitter: sigma {SIM_JITTER}. Noise: half the interquartile "
        f"range of the step-by-step ratios strict / ready. Load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores."
    )
    write_results("readiness_virtual", {"results": results}, rows, header, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
