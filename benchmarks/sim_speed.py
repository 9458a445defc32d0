"""How long one simulation takes: 8 devices x 64 microbatches x 100 one-layer stages.

Qwen3-8B with LoRA r=16 and the head cut into 63 shards gives 100 layers; the roundpipe table deals
them one per stage to 8 devices for 64 microbatches (12,800 tasks). Goal (issue 5): under 1 s.

    python benchmarks/sim_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import write_results

from roundpipe.partition.cost import model_costs
from roundpipe.presets import load_hardware, load_model_config
from roundpipe.schedule import Partition, build_table
from roundpipe.sim import SimOptions, simulate, workload_from_costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    hardware = load_hardware("8xrtx4090")
    costs = model_costs(load_model_config("qwen3-8b"), 4096, 1, lora_rank=16, head_shards=63)
    workload = workload_from_costs(costs, hardware)
    part = Partition.per_layer(workload.num_layers)
    table = build_table("roundpipe", part, part, 8, 64)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        simulate(table, workload, hardware, SimOptions())
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tasks = sum(len(row) for row in table.devices)
    rows = [[f"{workload.num_layers}", "8", "64", f"{tasks:,}", f"{median:.3f}", f"{min(times):.3f}"]]
    notes = f"""
Medians and minimum of {args.repeats} runs on this machine. Goal: under 1 s per simulation.
"""
    write_results(
        "sim_speed",
        {"layers": workload.num_layers, "tasks": tasks, "seconds": times, "median_s": median, "goal_s": 1.0},
        rows,
        ["stages", "devices", "microbatches", "tasks", "median s", "min s"],
        notes,
    )


if __name__ == "__main__":
    main()
