"""The RoundPipe paper's schedule study, replayed in roundpipe's simulator: are roundpipe's own plans
as good as the paper's?

The setting (paper section 5.6.1; numbers in ``benchmarks/data/paper_setting.json``): 8 devices,
16 microbatches of 4 x 2048 tokens, every decoder layer given the measured RTX 4090 forward and
backward time, the LM head + loss its measured times, one activation hop between GPUs through the
host its measured time (1.6-4 ms), no weight copies, no optimizer time. Compared:

- GPipe and 1F1B on the paper's baseline partitions (the head on the last device),
- interleaved 1F1B with one decoder layer per virtual stage (the largest multiple of 8 stages the
  model allows),
- roundpipe (sync and async optimizer) on the paper's own partitions,
- roundpipe on the plan roundpipe picks itself: the paper's objective over free stage grains
  (``partition.grain``), stage memory from roundpipe's cost model of the 4090, then the simulator
  in the loop (``sim.tune.refine``), separately for sync and async.

Run: ``.venv/bin/python benchmarks/paper_setting.py`` (about a minute). Writes
``benchmarks/results/paper_setting.json`` and ``docs/paper_setting.md``. Pure Python (no torch).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from roundpipe.partition.cost import model_costs
from roundpipe.partition.grain import grain_choices, objective
from roundpipe.partition.memory import device_reserve_bytes, pair_peak_bytes
from roundpipe.partition.partitioner import optimal_partition
from roundpipe.presets import load_hardware, load_measured_layers, load_model_config
from roundpipe.schedule import build_table
from roundpipe.schedule.table import Partition, ScheduleTable
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.scenario import Prepared, Scenario
from roundpipe.sim.simulator import simulate
from roundpipe.sim.tune import polish, refine
from roundpipe.sim.workload import LayerWork, Workload

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "paper_setting.json"
# A smoke run (benchmarks/run_all.py --quick) sets ROUNDPIPE_BENCH_RESULTS: both files go there.
_REDIRECT = os.environ.get("ROUNDPIPE_BENCH_RESULTS")
RESULTS = Path(_REDIRECT) if _REDIRECT else Path(__file__).resolve().parent / "results"
DOC = RESULTS / "paper_setting_doc.md" if _REDIRECT else ROOT / "docs" / "paper_setting.md"
SEQ_LEN, MICRO_BATCH = 2048, 4
LINK_BW = 16e9  # bytes/s of the modelled host link; hop bytes are sized so one hop takes the measured time
OWN_CANDIDATES = 8  # grains by the objective that the simulator then judges and refines
REFINE_SECONDS = 40.0
POLISHED = 2  # best refined candidates then hill-climbed boundary by boundary
CLASSIC = ("gpipe", "1f1b", "interleaved")


def load_setting() -> dict:
    """The study's setting, with every model's measured layer times (``presets.load_measured_layers``)."""
    setting = json.loads(DATA.read_text())
    measured = load_measured_layers()["models"]
    setting["per_layer_times_ms"] = {
        name: {
            **{k: measured[name][k] for k in ("fwd", "bwd", "head_fwd", "head_bwd")},
            "layers": int(load_model_config(name)["num_hidden_layers"]),
            "comm_per_hop": hop,
        }
        for name, hop in setting["comm_per_hop_ms"].items()
    }
    return setting


@dataclass(frozen=True)
class PaperModel:
    """One model of the study: its measured layers as a workload, and its layer costs (memory)."""

    name: str
    workload: Workload
    costs: list
    num_decoder: int


def paper_model(name: str, setting: dict) -> PaperModel:
    """``embed``, ``layers.0..L-1``, ``head``: measured times, a hop-sized activation, no weights."""
    t = setting["per_layer_times_ms"][name]
    hop_bytes = int(t["comm_per_hop"] / 1e3 / 2 * LINK_BW)  # one hop: a download and an upload
    lora = setting["lora_rank"].get(name)
    costs = model_costs(
        load_model_config(name), SEQ_LEN, MICRO_BATCH, dtype="fp16", lora_rank=lora, head_shards=1
    )
    layers = [LayerWork("embed", 0.0, 0.0, recompute=True, act_in_bytes=hop_bytes, trainable_params=0)]
    layers += [
        LayerWork(f"layers.{i}", t["fwd"] / 1e3, t["bwd"] / 1e3, act_in_bytes=hop_bytes, trainable_params=1)
        for i in range(t["layers"])
    ]
    layers.append(
        LayerWork("head", t["head_fwd"] / 1e3, t["head_bwd"] / 1e3, recompute=False, act_in_bytes=hop_bytes,
                  trainable_params=1)
    )  # fmt: skip
    assert [c.name for c in costs] == [lw.name for lw in layers], "the cost model names other layers"
    work = Workload(tuple(layers), tokens_per_microbatch=SEQ_LEN * MICRO_BATCH, name=name, dtype="fp16")
    return PaperModel(name, work, costs, t["layers"])


def paper_server():
    """8 RTX 4090s, each with its own link (hops are charged per edge, not shared)."""
    hw = load_hardware("8xrtx4090")
    gpu = replace(hw.gpu, host_link_bw=LINK_BW, host_link_bw_measured=LINK_BW)
    return replace(hw, gpu=gpu, gpus_per_switch=1, switch_uplink_bw=LINK_BW, host_memory_bytes=None)


ASYNC_STEPS = 8  # async: steps simulated back to back; the period settles after the first few


def options(optimizer: str) -> SimOptions:
    steps = ASYNC_STEPS if optimizer == "async" else 1
    return SimOptions(optimizer=optimizer, optimizer_time=False, record_timeline=False, iterations=steps)


# ----------------------------------------------------------------------------- partitions


def paper_roundpipe_partitions(name: str, setting: dict, n_layers: int) -> tuple[Partition, Partition]:
    """The paper's format -> bounds over ``embed, layers..., head``: the head is its own last stage
    in both partitions (the fused head stage), the embedding joins the first stage."""
    p = setting["roundpipe_partitions"][name]
    fwd = [p["forward"][0] + 1, *p["forward"][1:], 1]
    down = p["backward"][1:]  # from the head down, after the head's own stage
    bwd = list(reversed(down))
    bwd[0] += 1
    bwd.append(1)
    assert sum(fwd) == sum(bwd) == n_layers
    return Partition.from_sizes(fwd), Partition.from_sizes(bwd)


def baseline_partition(name: str, setting: dict) -> Partition:
    sizes = list(setting["baseline_1f1b_partitions"][name])
    sizes[0] += 1
    sizes[-1] += 1  # the LM head sits on the last device
    return Partition.from_sizes(sizes)


def interleaved_partition(model: PaperModel, num_devices: int) -> Partition:
    """One decoder layer per virtual stage where the layer count allows, else the largest multiple
    of the devices, balanced on forward + backward time."""
    n = model.workload.num_layers
    stages = (min(model.num_decoder, n) // num_devices) * num_devices
    times = [lw.fwd_s * (2 if lw.recompute else 1) + lw.bwd_s for lw in model.workload.layers]
    return optimal_partition(times, stages).partition


# ----------------------------------------------------------------------------- own plan


def fits(model: PaperModel, table: ScheduleTable, budget: int, reserve: int) -> bool:
    """Every stage of ``table`` within the 4090's memory by the partitioner's rule."""
    return pair_peak_bytes(model.costs, table.forward, table.backward, reserve) <= budget


def own_plan(
    model: PaperModel, optimizer: str, num_devices: int, microbatches: int, seconds: float = REFINE_SECONDS
) -> tuple[ScheduleTable, SimResult, dict]:
    """roundpipe's own choice: the best grains by the objective, each simulated and refined."""
    hw = load_hardware("8xrtx4090")
    budget, reserve = hw.memory_bytes, device_reserve_bytes(hw)
    f = [lw.fwd_s for lw in model.workload.layers]
    b = [lw.fwd_s * (1 if lw.recompute else 0) + lw.bwd_s for lw in model.workload.layers]
    server, opts = paper_server(), options(optimizer)
    accept = lambda t: fits(model, t, budget, reserve)  # noqa: E731
    choices = grain_choices(
        model.costs, f, b, num_devices=num_devices, microbatches=microbatches, budget=budget,
        reserve_bytes=reserve, limit=OWN_CANDIDATES, steady=optimizer == "async",
    )  # fmt: skip
    tried = []
    deadline = time.monotonic() + seconds / 2
    for rank, g in enumerate(choices):
        table = build_table("roundpipe", g.forward, g.backward, num_devices, microbatches)
        res = simulate(table, model.workload, server, opts)
        prep = Prepared(Scenario(model.name), server, table, model.workload, MICRO_BATCH, 1)
        table, res, moves = refine(prep, res, opts, deadline, accept=accept)
        info = {"grain_rank": rank, "objective_s": g.objective, "t_max_s": g.t_max, "refined_moves": moves}
        tried.append((res.iteration_s, rank, table, res, info))
    tried.sort(key=lambda x: x[:2])
    deadline = time.monotonic() + seconds / 2
    best = None
    for _, _rank, table, res, info in tried[:POLISHED]:
        prep = Prepared(Scenario(model.name), server, table, model.workload, MICRO_BATCH, 1)
        table, res, moves = polish(prep, res, opts, deadline, accept=accept)
        info = {**info, "polished_moves": moves}
        if best is None or res.iteration_s < best[0]:
            best = (res.iteration_s, table, res, info)
    assert best is not None
    return best[1], best[2], best[3]


# ----------------------------------------------------------------------------- the study


def stage_sizes(part: Partition) -> list[int]:
    return [part.bounds[s + 1] - part.bounds[s] for s in range(part.num_stages)]


def study(names: list[str] | None = None, seconds: float = REFINE_SECONDS) -> dict:
    setting = load_setting()
    n_dev, m = setting["num_devices"], setting["num_microbatches"]
    server = paper_server()
    rows = {}
    for name in names or [k for k in setting["per_layer_times_ms"] if not k.startswith("_")]:
        model = paper_model(name, setting)
        n = model.workload.num_layers
        out: dict[str, dict] = {}

        def record(key: str, table: ScheduleTable, res: SimResult, out: dict = out, **extra) -> None:
            out[key] = {
                "policy": table.policy,
                "bubble": res.bubble_total,
                "iteration_s": res.iteration_s,
                "forward_stages": table.forward.num_stages,
                "backward_stages": table.backward.num_stages,
                "forward": stage_sizes(table.forward),
                "backward": stage_sizes(table.backward),
                **extra,
            }

        base = baseline_partition(name, setting)
        for policy in ("gpipe", "1f1b"):
            table = build_table(policy, base, base, n_dev, m)
            record(policy, table, simulate(table, model.workload, server, options("sync")))
        inter = interleaved_partition(model, n_dev)
        table = build_table("interleaved", inter, inter, n_dev, m)
        record("interleaved", table, simulate(table, model.workload, server, options("sync")))
        fwd, bwd = paper_roundpipe_partitions(name, setting, n)
        paper_table = build_table("roundpipe", fwd, bwd, n_dev, m)
        hw = load_hardware("8xrtx4090")
        paper_peak = pair_peak_bytes(model.costs, fwd, bwd, device_reserve_bytes(hw))
        for optimizer in ("sync", "async"):
            res = simulate(paper_table, model.workload, server, options(optimizer))
            record(f"roundpipe_{optimizer}_paper", paper_table, res)
            t0 = time.monotonic()
            table, res, info = own_plan(model, optimizer, n_dev, m, seconds)
            record(f"roundpipe_{optimizer}_own", table, res, plan_seconds=time.monotonic() - t0, **info)
        best_classic = min(CLASSIC, key=lambda k: out[k]["bubble"])
        out["summary"] = {
            "best_classic": best_classic,
            "sync_cut_vs_best_classic": 1 - out["roundpipe_sync_own"]["bubble"] / out[best_classic]["bubble"],
            "own_vs_paper_sync": out["roundpipe_sync_own"]["bubble"] - out["roundpipe_sync_paper"]["bubble"],
            "own_vs_paper_async": out["roundpipe_async_own"]["bubble"] - out["roundpipe_async_paper"]["bubble"],
            "paper_peak_gpu_bytes": paper_peak,
            "paper_fits_memory_model": paper_peak <= hw.memory_bytes,
            "paper_objective_s": objective(m, n_dev, paper_table.forward.num_stages + paper_table.backward.num_stages - 1,
                                           _t_max(paper_table, model.workload)),
        }  # fmt: skip
        rows[name] = out
    return {"setting": {"num_devices": n_dev, "num_microbatches": m}, "models": rows}


def _t_max(table: ScheduleTable, work: Workload) -> float:
    ly = work.layers
    f = [sum(ly[i].fwd_s for i in table.forward.layers(s)) for s in range(table.forward.num_stages - 1)]
    b = [
        sum(ly[i].fwd_s + ly[i].bwd_s for i in table.backward.layers(s))
        for s in range(table.backward.num_stages - 1)
    ]
    head = sum(ly[i].fwd_s + ly[i].bwd_s for i in table.backward.layers(table.backward.num_stages - 1))
    return max(f + b + [head])


def markdown(result: dict) -> str:
    s = result["setting"]
    lines = [
        "# The paper's schedule study, replayed",
        "",
        "Generated by `.venv/bin/python benchmarks/paper_setting.py`; do not edit by hand.",
        "",
        f"RoundPipe paper, section 5.6.1: {s['num_devices']} devices, {s['num_microbatches']} microbatches of "
        f"{MICRO_BATCH} x {SEQ_LEN} tokens, the measured RTX 4090 time of every decoder layer and of the LM head, "
        "a measured 1.6-4 ms per activation hop, no weight copies and no optimizer time. Bubble = idle share of "
        "the devices' time over the step (async: the steady-state period of overlapping steps). *paper*: the "
        "paper's own partitions; *own*: the plan roundpipe picks itself (the paper's objective over free stage "
        "grains with the 4090's memory from roundpipe's cost model, then the simulator in the loop).",
        "",
        "| model | GPipe | 1F1B | interleaved | sync, paper | sync, own | async, paper | async, own | sync cut vs best classic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["models"].items():
        cells = [f"{r[k]['bubble']:.2%}" for k in ("gpipe", "1f1b", "interleaved", "roundpipe_sync_paper",
                                                    "roundpipe_sync_own", "roundpipe_async_paper", "roundpipe_async_own")]  # fmt: skip
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {r['summary']['sync_cut_vs_best_classic']:.0%} |"
        )
    lines += ["", "Stage grains (forward / backward stages, the fused head stage counted in both):", "",
              "| model | paper | own, sync | own, async |", "|---|---|---|---|"]  # fmt: skip
    for name, r in result["models"].items():
        cells = [f"{r[k]['forward_stages']} / {r[k]['backward_stages']}"
                 for k in ("roundpipe_sync_paper", "roundpipe_sync_own", "roundpipe_async_own")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    misses = [
        (name, opt, r) for name, r in result["models"].items() for opt in ("sync", "async")
        if r["summary"][f"own_vs_paper_{opt}"] > 1e-9
    ]  # fmt: skip
    if misses:
        lines += ["", "Where the own plan's bubble is larger than the paper's partition's:", ""]
        for name, opt, r in misses:
            sm = r["summary"]
            why = (
                f"the paper's partition needs {sm['paper_peak_gpu_bytes'] / 2**30:.1f} GiB on its fullest device by "
                "roundpipe's memory model (24 GiB cards), so roundpipe may not choose it"
                if not sm["paper_fits_memory_model"]
                else "the paper's partition fits roundpipe's memory model: the search missed it"
            )
            lines.append(f"- **{name}**, {opt}: +{sm[f'own_vs_paper_{opt}']:.2%}; {why}.")
    lines += ["", "Own plans, forward and backward stage sizes in layers (embedding first, head last):", ""]
    for name, r in result["models"].items():
        own = r["roundpipe_sync_own"]
        lines.append(f"- **{name}** (sync): forward {own['forward']}, backward {own['backward']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="a subset of the five models")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    result = study(args.models)
    result["elapsed_s"] = time.monotonic() - t0
    text = markdown(result)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "paper_setting.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "paper_setting.md").write_text(text)
        DOC.write_text(text)
    worst = max(r["summary"]["own_vs_paper_sync"] for r in result["models"].values())
    print(f"elapsed {result['elapsed_s']:.1f} s; own minus paper bubble (sync), worst: {worst:+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
