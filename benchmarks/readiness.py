"""Readiness-first against fixed order when the work varies (issue 14, item 2).

Every executable policy runs the same Llama-shaped model on ``cpu:4`` twice, ``RunConfig(order=
"strict")`` (each worker runs its tasks in table order) and ``order="ready"`` (the first task in
table order whose inputs are there), steps alternating between the two pipelines on the same
batches, in three cases of work:

- ``none``: every sample of one length, so every microbatch costs the same;
- ``variable length``: sample lengths drawn from an SFT-like log-normal (see ``LENGTHS``), right
  padded; the runtime cuts each microbatch to its own longest sample
  (``roundpipe.runtime.inputs.trailing_padding``), so microbatches cost what their tokens cost;
- ``slow device``: the ``none`` batches with ``cpu:1`` made ``--slow`` times slower (the ``slow``
  fault kind of ``roundpipe.testing.faults``: each closure on its compute stream is followed by a
  sleep of ``factor - 1`` times what it took).

The simulator replays the same tables on the layer times ``pipe.profile`` measured here, with the
same microbatch lengths, the same slow device (``SimOptions(slowdown=...)``) and per-task jitter
(``SimOptions(jitter=...)``), in both orders (``SimOptions(order=...)``). Reported per policy and
case: median step time strict and ready, the speed-up, the bubble fraction (idle over total compute
time of all devices) and how many tasks ready order ran ahead of one before them in the table.

    python benchmarks/readiness.py [--quick]

Writes ``benchmarks/results/readiness.json`` and ``.md``. The stream sanitizer is off
(``RunConfig(sanitize=False)``), as in the other runtime benchmarks.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from _common import llama_model, write_results  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.partition.cost import model_costs  # noqa: E402
from roundpipe.presets import load_hardware  # noqa: E402
from roundpipe.sim.options import SimOptions  # noqa: E402
from roundpipe.sim.simulator import simulate  # noqa: E402
from roundpipe.sim.workload import workload_from_costs  # noqa: E402
from roundpipe.testing import faults  # noqa: E402

DEVICES = 4
VOCAB = 2048
MODEL = dict(hidden=128, layers=6, intermediate=512, vocab=VOCAB, heads=4)  # 8 layers: embed, 6, head
# SFT-like lengths (Alpaca/ShareGPT-style: median a few hundred tokens, a long tail) are log-normal,
# median 256 tokens, sigma 0.8, capped at 1024; here scaled by 1/8 so that a CPU step takes a
# fraction of a second: median 32, cap 128 (the shape of the distribution is what matters).
LENGTHS = dict(median=32, sigma=0.8, cap=128, minimum=4)
SLOW_DEVICE = 1
SIM_JITTER = 0.2  # sigma of the simulator's per-task log-normal time factor (the "jitter" case)
POLICIES = ("gpipe", "1f1b", "interleaved", "chimera", "hanayo", "roundpipe")
CASES = ("none", "variable length", "slow device")
ORDERS = ("strict", "ready")
LOSS_RTOL = 1e-4  # strict and ready train the same weights on the same batches: only round-off differs


@dataclass(frozen=True)
class Size:
    """How big a run is: the model, the microbatches of a step (one sample each, so that each
    microbatch has its own length), the policies measured and the measured steps per order."""

    microbatches: int = 8
    policies: tuple[str, ...] = POLICIES
    repeats: int = 7
    model: dict = field(default_factory=lambda: dict(MODEL))

    @property
    def batch(self) -> int:
        return self.microbatches

    @property
    def layers(self) -> int:
        """Layers of the pipeline: the embedding, the decoder layers, the head."""
        return self.model["layers"] + 2


FULL = Size()
# The CI smoke: every code path (both orders, every case, the simulator, the loss check, both kinds
# of verdict: 1f1b runs tasks ahead, roundpipe never does) on 2 decoder layers and 4 microbatches.
QUICK = Size(microbatches=4, policies=("1f1b", "roundpipe"), repeats=2, model=dict(MODEL, layers=2))


def sample_lengths(n: int, generator: torch.Generator) -> list[int]:
    """``n`` lengths from the log-normal of ``LENGTHS``, rounded, clipped to [minimum, cap]."""
    z = torch.randn(n, generator=generator, dtype=torch.float64)
    raw = torch.exp(math.log(LENGTHS["median"]) + LENGTHS["sigma"] * z)
    return [int(min(LENGTHS["cap"], max(LENGTHS["minimum"], round(float(x))))) for x in raw]


def make_batch(lengths: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded to the longest sample: ids, attention mask, labels (-100 on padding)."""
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def case_batches(steps: int, batch: int, seed: int) -> tuple[dict[str, list[dict]], int, list[list[int]]]:
    """Per case the batches of every step; the ``none`` length (the variable batches' mean
    microbatch length, so both cases carry about the same work); the variable lengths."""
    g = torch.Generator().manual_seed(seed)
    variable_lengths = [sample_lengths(batch, g) for _ in range(steps)]
    fixed = round(statistics.mean(n for lengths in variable_lengths for n in lengths))
    variable = [make_batch(lengths, g) for lengths in variable_lengths]
    uniform = [make_batch([fixed] * batch, g) for _ in range(steps)]
    return {"none": uniform, "variable length": variable, "slow device": uniform}, fixed, variable_lengths


def ran_ahead(order: list[str], table_order: list[str]) -> int:
    """Tasks of ``order`` that ran while a task before them in ``table_order`` had not run yet."""
    index = {name: i for i, name in enumerate(table_order)}
    pending = sorted(index.values())
    done: set[int] = set()
    ahead, low = 0, 0
    for name in order:
        i = index.get(name)
        if i is None:
            continue
        while low < len(pending) and pending[low] in done:
            low += 1
        if low < len(pending) and i > pending[low]:
            ahead += 1
        done.add(i)
    return ahead


def compute_order(pipe) -> dict[int, list[str]]:
    """Per device, the names of the tasks its compute stream ran in the last step, in order."""
    spans = sorted((s for s in pipe.last_timeline().spans if s.lane == "compute" and s.kind in ("F", "B", "FB")),
                   key=lambda s: s.start)  # fmt: skip
    out: dict[int, list[str]] = {}
    for s in spans:
        out.setdefault(s.device, []).append(s.name)
    return out


def bubble(stats: dict) -> float:
    busy = sum(d["busy_s"] for d in stats["devices"])
    return 1.0 - busy / (len(stats["devices"]) * stats["step_s"]) if stats["step_s"] > 0 else 0.0


def run_policy(
    model, policy: str, batches: dict[str, list[dict]], microbatches: int, warmup: int, slow: float, seed: int
) -> dict:
    """Both orders of ``policy`` through every case, steps alternating (and which goes first, too)."""
    pipes = {}
    for order in ORDERS:
        config = roundpipe.RunConfig(
            devices=f"cpu:{DEVICES}", num_microbatches=microbatches, policy=policy, partition=None,
            order=order, sanitize=False, seed=seed,
        )  # fmt: skip
        pipes[order] = roundpipe.wrap(copy.deepcopy(model), config)
        pipes[order].configure_optimizer(lr=1e-5)
    out: dict = {"table": None, "cases": {}}
    try:
        for case in CASES:
            times: dict[str, list[float]] = {o: [] for o in ORDERS}
            bubbles: dict[str, list[float]] = {o: [] for o in ORDERS}
            losses: dict[str, list[float]] = {o: [] for o in ORDERS}
            slow_share: dict[str, list[float]] = {o: [] for o in ORDERS}
            busy: dict[str, list[float]] = {o: [] for o in ORDERS}
            fault = faults.Fault("compute", kind="slow", device=f"cpu:{SLOW_DEVICE}", factor=slow)
            orders_seen: dict[str, dict[int, list[str]]] = {}
            if case == CASES[0]:  # warm both pipelines up once, on batches not measured
                for batch in batches[case][:warmup]:
                    for order in ORDERS:
                        _train_step(pipes[order], batch)
            for n, batch in enumerate(batches[case][warmup:]):
                for order in ORDERS if n % 2 == 0 else ORDERS[::-1]:
                    pipe = pipes[order]
                    with faults.injected(fault) if case == "slow device" else _nothing():
                        t0 = time.perf_counter()
                        loss = _train_step(pipe, batch)
                        took = time.perf_counter() - t0
                    losses[order].append(loss)
                    times[order].append(took)
                    stats = pipe.stats()
                    bubbles[order].append(bubble(stats))
                    slow_share[order].append(stats["devices"][SLOW_DEVICE]["busy_s"] / stats["step_s"])
                    busy[order].append(sum(d["busy_s"] for d in stats["devices"]))
                    orders_seen[order] = compute_order(pipe)
            table_order = orders_seen["strict"]
            ahead = sum(ran_ahead(orders_seen["ready"].get(d, []), names) for d, names in table_order.items())
            tasks = sum(len(names) for names in table_order.values())
            out["cases"][case] = {
                "step_s": times,
                "median_s": {o: statistics.median(times[o]) for o in ORDERS},
                "bubble": {o: statistics.median(bubbles[o]) for o in ORDERS},
                "paired_noise": _paired_noise(times["strict"], times["ready"]),
                "ran_ahead": ahead,
                "tasks": tasks,
                "loss_max_rel_diff": max(
                    abs(a - b) / abs(b) for a, b in zip(losses["ready"], losses["strict"])
                ),
                "slow_busy_share": {o: statistics.median(slow_share[o]) for o in ORDERS},
                "busy_s": {o: statistics.median(busy[o]) for o in ORDERS},
                "slow_fault_fired": fault.fired if case == "slow device" else 0,
            }
        out["table"] = pipes["strict"].last_plan.table
    finally:
        for pipe in pipes.values():
            pipe.close()
    return out


def _train_step(pipe, batch: dict) -> float:
    loss = pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
    ).loss
    pipe.step()
    return loss


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _paired_noise(strict: list[float], ready: list[float]) -> float:
    """Half the interquartile range of the step-by-step ratios strict / ready (the two orders' steps
    alternate, so each pair saw about the same machine): the run-to-run noise of a speed-up."""
    ratios = [s / r for s, r in zip(strict, ready)]
    if len(ratios) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (q3 - q1) / 2


def cpu_server(num_devices: int):
    """The cpu backend as a server for the simulator: copies are host memcpy, memory is ample, one
    host thread steps the optimizer; compute speed comes from the measured layer times."""
    return load_hardware(
        f"{num_devices}xrtx4090", gpu_host_link_bw=8e9, gpu_host_link_bw_measured=8e9,
        gpu_memory_bytes=64 << 30, gpu_workspace_reserve_bytes=0, host_memory_bw=8e9, cpu_cores=1,
    )  # fmt: skip


def measured_layers(model, fixed: int, microbatches: int, seed: int):
    """``pipe.profile``'s per-layer times and context time for microbatches of ``fixed`` tokens."""
    g = torch.Generator().manual_seed(seed + 1)
    batch = make_batch([fixed] * microbatches, g)
    config = roundpipe.RunConfig(
        devices=f"cpu:{DEVICES}",
        num_microbatches=microbatches,
        policy="roundpipe",
        partition=None,
        sanitize=False,
    )
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        times = pipe.profile(batch["input_ids"], batch["labels"], batch["attention_mask"], steps=2)
        return times, pipe.context_time


def simulate_policy(table, workload, hardware, variable_lengths, fixed: int, slow: float, seeds: int) -> dict:
    """Both orders of ``table`` in the simulator, per case (medians over batches or seeds)."""
    slowdown = tuple(slow if d == SLOW_DEVICE else 1.0 for d in range(DEVICES))
    cases = {
        "none": [(workload, {})],
        "variable length": [
            (replace(workload, microbatch_sizes=tuple(lengths), micro_batch_size=fixed), {})
            for lengths in variable_lengths
        ],
        "slow device": [(workload, {"slowdown": slowdown})],
        "jitter": [(workload, {"jitter": SIM_JITTER, "jitter_seed": s}) for s in range(seeds)],
    }
    out = {}
    for case, runs in cases.items():
        res = {o: [simulate(table, w, hardware, SimOptions(order=o, **kw)) for w, kw in runs] for o in ORDERS}
        out[case] = {
            "median_s": {o: statistics.median(r.iteration_s for r in res[o]) for o in ORDERS},
            "bubble": {o: statistics.median(r.bubble_total for r in res[o]) for o in ORDERS},
            "ran_ahead": statistics.median(r.reordered for r in res["ready"]),
            "peak_stash": {o: max(max(r.peak_activations) for r in res[o]) for o in ORDERS},
            "slow_busy_share": {
                o: statistics.median(r.compute_busy_s[SLOW_DEVICE] / r.iteration_s for r in res[o])
                for o in ORDERS
            },
        }
    return out


def noise_floor(results: dict) -> dict[str, float]:
    """Per case, how far apart the two orders measured where they ran the same execution (no task
    ahead, e.g. roundpipe): a speed-up smaller than that says nothing. 0 without such a run."""
    floor = dict.fromkeys(CASES, 0.0)
    for r in results.values():
        for case, c in (r["runtime"] or {}).items():
            if c["ran_ahead"] == 0:
                floor[case] = max(floor[case], abs(c["speedup"] - 1.0))
    return floor


def verdict(speedup: float, noise: float, ran_ahead: float) -> str:
    """How ready order compares: the same order when no task ran ahead (any gap is noise), else
    helps / hurts beyond ``noise`` (at least 1%), else no difference."""
    if ran_ahead == 0:
        return "same order"
    if speedup > 1.0 + max(noise, 0.01):
        return "helps"
    if speedup < 1.0 - max(noise, 0.01):
        return "hurts"
    return "no difference"


def explain(policy: str, rt: dict | None, sim: dict, slow: float) -> str:
    """Why ready order does or does not help ``policy``, read off the figures measured above."""
    gains = {c: sim[c]["speedup"] for c in sim}
    ahead = {c: sim[c]["ran_ahead"] for c in sim}
    lines = []
    if max(ahead.values()) == 0 and (rt is None or all(rt[c]["ran_ahead"] == 0 for c in CASES)):
        why = (
            "the round-robin deal hands each device its tasks in the order their inputs arrive, so it "
            "already dispatches in readiness order"
            if policy == "roundpipe"
            else "the table's next task is always the first one ready"
        )
        lines.append(
            f"ready order ran every task in the table's order (0 ran ahead, in the simulator"
            f"{' and on cpu:4' if rt is not None else ''}, in every case): {why}; strict and ready are the "
            "same execution"
            + (", and the runtime's gaps between them are run-to-run noise" if rt is not None else "")
        )
    else:
        lines.append(
            f"simulated, ready order ran {ahead['none']:.0f} / {ahead['variable length']:.0f} / "
            f"{ahead['slow device']:.0f} / {ahead['jitter']:.0f} tasks ahead (none / variable length / slow "
            f"device / jitter) for a speed-up of {gains['none']:.2f}x / {gains['variable length']:.2f}x / "
            f"{gains['slow device']:.2f}x / {gains['jitter']:.2f}x"
        )
        if gains["variable length"] > gains["none"] + 0.02:
            lines.append(
                "variable lengths help it most: a short microbatch's input arrives early and runs in the "
                "gap the table left for a long one"
            )
        share = sim["slow device"]["slow_busy_share"]
        if gains["slow device"] < 1.03:
            lines.append(
                f"with cpu:{SLOW_DEVICE} {slow:g}x slower it gains {gains['slow device']:.2f}x: that device "
                f"computes {share['strict']:.0%} of the step already, a bottleneck no order of the others' "
                "tasks shortens"
            )
        else:
            lines.append(
                f"with cpu:{SLOW_DEVICE} {slow:g}x slower it gains {gains['slow device']:.2f}x by keeping the "
                f"slowed device busy: it computes {share['ready']:.0%} of the step instead of "
                f"{share['strict']:.0%}"
            )
        stash = sim["none"]["peak_stash"]
        if stash["ready"] > stash["strict"]:
            lines.append(
                f"what runs ahead are forwards whose input is there while the table's next task, a "
                f"backward, waits for its gradient: a device holds up to {stash['ready']} stage inputs "
                f"instead of {stash['strict']} (the 1F1B bound on held activations is lost)"
            )
        worst = min(gains, key=gains.get)
        if gains[worst] < 0.99:
            lines.append(
                f"it can lose ({gains[worst]:.2f}x with {worst}): the first ready task is a greedy choice, "
                "and the table made a task wait on purpose"
            )
    if rt is not None:
        seen = ", ".join(
            f"{c} {rt[c]['speedup']:.2f}x ({rt[c]['verdict']}; noise ±{rt[c]['noise']:.0%}, "
            f"{rt[c]['ran_ahead']}/{rt[c]['tasks']} tasks ahead)"
            for c in CASES
        )
        lines.append(f"on cpu:4: {seen}")
        sim_says = {c: sim[c]["verdict"] for c in CASES}
        against = [c for c in CASES if {rt[c]["verdict"], sim_says[c]} == {"helps", "hurts"}
                   or (rt[c]["verdict"] == "hurts" and sim_says[c] != "hurts")]  # fmt: skip
        for c in against:
            more = rt[c]["busy_s"]["ready"] / rt[c]["busy_s"]["strict"] - 1.0
            lines.append(
                f"with {c} cpu:4 contradicts the simulator ({rt[c]['speedup']:.2f}x against "
                f"{sim[c]['speedup']:.2f}x): "
                + (
                    f"the same work took {more:.0%} more compute time under ready order: tasks run side by "
                    "side share the cores (with other jobs, when the load average is above the core count) "
                    "and run slower, which the simulator does not model"
                    if more > 0.03
                    else "its compute time did not grow, so these figures do not say why"
                )
            )
        if all(rt[c]["verdict"] in ("no difference", "same order") for c in CASES):
            lines.append(
                "no case differs beyond the noise, so these runs neither confirm nor refute the simulated "
                "figures; besides, the four virtual devices share the machine's cores, so one device's "
                "idle time goes to the others' compute instead of being lost, which hides part of what an "
                "order saves on GPUs"
            )
    return "; ".join(lines) + "."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="two policies, a smaller model, two measured steps (the CI smoke)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="measured steps per order and case (default 7)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--slow", type=float, default=2.0, help="how many times slower cpu:1 is in 'slow device'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-runtime", action="store_true", help="the simulator only (seconds)")
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.repeats:
        size = replace(size, repeats=args.repeats)
    repeats, mb = size.repeats, size.microbatches
    torch.set_num_threads(1)
    started = time.perf_counter()
    load = [_load()]

    model = llama_model(**size.model)
    batches, fixed, variable_lengths = case_batches(args.warmup + repeats, size.batch, args.seed)
    layer_times, context_s = measured_layers(model, fixed, mb, args.seed)
    hardware = cpu_server(DEVICES)
    costs = model_costs(model.config.to_dict(), fixed, 1, dtype="fp32")
    workload = workload_from_costs(costs, hardware, times=layer_times, context_s=context_s)

    results: dict = {}
    for policy in size.policies:
        rt = None
        if args.no_runtime:
            table = _table(policy, size)
        else:
            measured = run_policy(model, policy, batches, mb, args.warmup, args.slow, args.seed)
            table = measured.pop("table")
            rt = measured["cases"]
            for c in rt.values():
                c["speedup"] = c["median_s"]["strict"] / c["median_s"]["ready"]
        sim = simulate_policy(
            table, workload, hardware, variable_lengths[args.warmup :], fixed, args.slow, seeds=5
        )
        for c in sim.values():
            c["speedup"] = c["median_s"]["strict"] / c["median_s"]["ready"]
            c["verdict"] = verdict(c["speedup"], 0.0, c["ran_ahead"])
        results[policy] = {"runtime": rt, "sim": sim}
        print(f"{policy}: {time.perf_counter() - started:.1f} s", flush=True)
    floor = noise_floor(results)
    for policy, r in results.items():
        for case, c in (r["runtime"] or {}).items():
            c["noise"] = max(c["paired_noise"], floor[case])
            c["verdict"] = verdict(c["speedup"], c["noise"], c["ran_ahead"])
        r["why"] = explain(policy, r["runtime"], r["sim"], args.slow)

    rows = []
    for policy, r in results.items():
        for case in (*CASES, "jitter"):
            s = r["sim"][case]
            m = (r["runtime"] or {}).get(case)
            rt_cells = (
                [f"{m['median_s']['strict']:.3f}", f"{m['median_s']['ready']:.3f}", f"{m['speedup']:.2f}x",
                 f"{m['bubble']['strict']:.0%} / {m['bubble']['ready']:.0%}", f"{m['ran_ahead']}/{m['tasks']}",
                 m["verdict"]]
                if m else ["-"] * 6
            )  # fmt: skip
            rows.append(
                [policy, case, *rt_cells,
                 f"{s['median_s']['strict']:.3f}", f"{s['median_s']['ready']:.3f}", f"{s['speedup']:.2f}x",
                 f"{s['bubble']['strict']:.0%} / {s['bubble']['ready']:.0%}", f"{s['ran_ahead']:.0f}"]
            )  # fmt: skip
    header = [
        "policy", "case", "runtime strict s", "runtime ready s", "speed-up", "bubble strict / ready",
        "ran ahead", "verdict", "sim strict s", "sim ready s", "sim speed-up", "sim bubble strict / ready",
        "sim ran ahead",
    ]  # fmt: skip
    why = "\n".join(f"- **{p}**: {r['why']}" for p, r in results.items())
    problems = loss_problems(results)
    losses_line = (
        f"their losses agree to {_worst_loss_diff(results):.1e}, within rtol {LOSS_RTOL:.0e}"
        if not problems
        else "their losses DISAGREE: " + "; ".join(problems)
    )
    elapsed = time.perf_counter() - started
    load.append(_load())
    notes = f"""
Llama-shaped model (hidden {size.model["hidden"]}, {size.model["layers"]} blocks, MLP {size.model["intermediate"]},
vocab {VOCAB}; {size.layers} layers with embedding and head), fp32 full fine-tuning on `cpu:{DEVICES}` (one
intra-op thread per stream, stream sanitizer off), {size.batch} samples per step in {mb}
microbatches, each policy's default partition (`partition=None`), sync optimizer. Each configuration
runs {args.warmup} warm-up and {repeats} measured steps per order, the two orders alternating on the
same batches (and on the same weights: {losses_line}); medians.
"speed-up" is strict over ready (above 1: ready is faster); "noise" is the larger of half the
interquartile range of the step-by-step ratios strict / ready and, per case, how far the speed-up
strayed from 1 where both orders ran the same execution (roundpipe); a speed-up within it (or
within 1%) is "no difference";
"same order": no task ran ahead, so both orders ran the same execution. Machine: {_cpus()} cores, load
average {load[0]:.1f} at the start and {load[1]:.1f} at the end (other jobs shared the cores when
above the core count). "ran ahead": tasks
ready order ran while a task before them in the table had not run (the runtime's from its compute
spans, against the strict run's order).

Cases: `none`, every sample {fixed} tokens; `variable length`, lengths log-normal with median
{LENGTHS["median"]}, sigma {LENGTHS["sigma"]}, clipped to [{LENGTHS["minimum"]}, {LENGTHS["cap"]}]
(an SFT distribution, median 256 and cap 1024, scaled by 1/8), a new draw every step, each microbatch
cut to its own sample; `slow device`, the `none` batches with cpu:{SLOW_DEVICE} {args.slow:g}x slower
(fault kind `slow`). The simulator replays the runtime's tables on the layer times `pipe.profile`
measured for {fixed}-token microbatches (times scaled by tokens for the variable lengths), with
`SimOptions(slowdown=...)` for the slow device and, as a fourth case, `SimOptions(jitter={SIM_JITTER})`
(each task's time times a log-normal factor of mean 1, median of 5 seeds).

Where readiness-first helps and where not, read off the figures above:

{why}

Total time {elapsed:.0f} s.
"""
    payload = {
        "model": size.model,
        "devices": DEVICES,
        "microbatches": mb,
        "batch": size.batch,
        "lengths": LENGTHS,
        "fixed_length": fixed,
        "slow": {"device": SLOW_DEVICE, "factor": args.slow},
        "sim_jitter": SIM_JITTER,
        "repeats": repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "results": results,
        "elapsed_s": elapsed,
        "load_average": load,
        "noise_floor": floor,
        "loss_rtol": LOSS_RTOL,
        "loss_problems": problems,
    }
    write_results("readiness", payload, rows, header, notes)
    if problems:
        print("loss mismatch between strict and ready order:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def loss_problems(results: dict, rtol: float = LOSS_RTOL) -> list[str]:
    """The policies and cases whose two orders' losses differ by more than ``rtol`` at some step:
    both pipelines train the same weights on the same batches, so only round-off may differ."""
    return [
        f"{policy} / {case}: losses differ by {c['loss_max_rel_diff']:.1e} (rtol {rtol:.0e})"
        for policy, r in results.items()
        for case, c in (r["runtime"] or {}).items()
        if not c["loss_max_rel_diff"] <= rtol
    ]


def _worst_loss_diff(results: dict) -> float:
    diffs = [c["loss_max_rel_diff"] for r in results.values() if r["runtime"] for c in r["runtime"].values()]
    return max(diffs, default=0.0)


def _table(policy: str, size: Size):
    """The table the runtime runs with ``partition=None`` (``--no-runtime``): the policy's default."""
    from roundpipe.schedule import build_table
    from roundpipe.sim.choice import default_partition

    part = default_partition(policy, DEVICES, {}, size.layers)
    return build_table(policy, part, part, DEVICES, size.microbatches)


if __name__ == "__main__":
    sys.exit(main())
