"""The real runtime on the virtual 8x RTX 4090 server, at full model size, against the simulator.

Each case wraps a preset model built on the meta device (no weights) with
``RunConfig(devices="virtual:SPEC")`` (``roundpipe/backend/virtual.py``, ``docs/virtual.md``): the
runtime's own code runs, device time and memory are modelled, the host's Python is real. The
settings are the RoundPipe paper's end-to-end ones (``../shared/reference``: sequence length 2048,
fp16 with fp16 accumulation, asynchronous optimizer, ``microbatches_per_call`` microbatches per
``forward_backward``, ``accum_calls`` calls per optimizer step), with the policy pinned to RoundPipe
and the partition the runtime chooses: full fine-tuning of Qwen3-1.7B, Llama-3.1-8B and Qwen3-32B on
8 GPUs and on one, and LoRA of Qwen3-235B-A22B on 8. For each case, steady-state steps (after the
first):

- tokens/s of the runtime, and of the simulator for the same table, microbatch sizes and workload
  (``sim.simulator.simulate``), and their ratio; and the simulator's tokens/s for one call on its
  own, drained (no overlap with the next call). The runtime overlaps consecutive calls
  (``RunConfig(overlap_calls=True)``), as the simulator's steady period does; ``--drained`` also
  runs cases with each call drained;
- each GPU's reserved peak (the caching-allocator model) against the GPU's memory;
- page-locked host bytes the store and hand-offs would take; host syncs per step;
- host CPU seconds per task (process CPU time over the step's tasks) and the share of the step the
  process was on a CPU (``process_time / wall``: with every thread in Python under one GIL, the GIL
  share; it can exceed 1 only when torch's C code runs without the GIL);
- where each GPU's compute lane lost time against the simulator's: modelled compute, idle with
  nothing issued yet (the host's issue), idle waiting for another stream's event (copies, other
  devices), against the simulator's idle time for the same step;
- the host jobs' modelled seconds per step (``backend.modelled()["host_work_s"]``) against the
  simulator's optimizer time and the step.

``--without-token NAME ...`` also runs those cases with the issue token off
(``roundpipe/backend/issue_token.py``), before the rest: what it saves, side by side;
``--drained NAME ...`` likewise with each ``forward_backward`` drained (``overlap_calls`` off).

    python benchmarks/virtual_server.py [--quick] [--cases NAME ...] [--steps N]
        [--without-token NAME ...]

Writes ``benchmarks/results/virtual_server.json`` and ``.md``. ``--quick``: one small case (two
decoder layers of Llama-3.1-8B on 2x RTX 4090), for CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

import roundpipe  # noqa: E402
from roundpipe.backend.issue_token import ISSUE_TOKEN  # noqa: E402
from roundpipe.presets import load_model_config  # noqa: E402
from roundpipe.sim.options import SimOptions  # noqa: E402
from roundpipe.sim.simulator import simulate  # noqa: E402

GIB = 1 << 30
SEQ = 2048


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str
    hardware: str
    batch: int  # sequences per forward_backward call
    microbatches: int
    calls: int = 1  # calls per optimizer step
    layers: int | None = None  # keep only this many decoder layers (the quick case)
    seq: int = SEQ
    lora_rank: int | None = None


CASES = (
    Case("qwen3-1.7b 8x", "qwen3-1.7b", "8xrtx4090", 128, 10, 4),
    Case("llama3.1-8b 8x", "llama3.1-8b", "8xrtx4090", 128, 10, 2),
    Case("qwen3-32b 8x", "qwen3-32b", "8xrtx4090", 64, 10, 2),
    Case("qwen3-1.7b 1x", "qwen3-1.7b", "rtx4090", 16, 4),
    Case("llama3.1-8b 1x", "llama3.1-8b", "rtx4090", 8, 4),
    Case("qwen3-32b 1x", "qwen3-32b", "rtx4090", 4, 4),
    # LoRA r=32 on every nn.Linear (transformers >= 5 fuses each layer's experts into 3-D
    # parameters, which "all-linear" does not reach: attention projections only)
    Case("qwen3-235b-a22b lora 8x", "qwen3-235b-a22b", "8xrtx4090", 64, 16, 1, lora_rank=32),
)
QUICK = Case("llama3.1-8b 2 layers 2x", "llama3.1-8b", "2xrtx4090", 4, 2, 1, layers=2, seq=4096)


def meta_model(case: Case):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(load_model_config(case.model))
    if case.layers is not None:
        config["num_hidden_layers"] = case.layers
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    if case.lora_rank is not None:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=case.lora_rank, lora_alpha=16, target_modules="all-linear")
        )
    return model


def emulation_us_per_op(repeats: int = 3, ops: int = 2000) -> float:
    """What the cpu backend's issue mode adds to one operation: a closure of ``ops`` small additions
    issued on a virtual device, against the same additions run directly by torch's dispatcher on a
    small CPU tensor (median of ``repeats``), in microseconds per operation. On CUDA the dispatcher
    and a kernel launch take the place of the issue mode."""
    from roundpipe.backend import make_backend

    backend = make_backend("virtual:rtx4090", sanitize=False)
    stream = backend.devices[0].streams["compute"]
    try:

        def issue():
            x = torch.empty(64, 64)  # device memory (the allocator model's)
            for _ in range(ops):
                x = x + 1.0
            del x

        def plain():
            x = torch.empty(64, 64)
            for _ in range(ops):
                x = x + 1.0

        mode, direct = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            stream.submit(issue, name="emulation probe")
            mode.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain()
            direct.append(time.perf_counter() - t0)
        stream.wait_until_issued()
        return 1e6 * (statistics.median(mode) - statistics.median(direct)) / ops
    finally:
        backend.close()


def rows_of(batch: int, microbatches: int) -> list[int]:
    """Sequences per microbatch as the runtime splits a batch (the first ones one larger)."""
    return [batch // microbatches + (1 if j < batch % microbatches else 0) for j in range(microbatches)]


def run_case(case: Case, steps: int, overlap: bool = True) -> dict:
    pipe = roundpipe.wrap(
        meta_model(case),
        roundpipe.RunConfig(
            devices=f"virtual:{case.hardware}",
            dtype="fp16",
            fp16_accumulation=True,
            policy="roundpipe",
            num_microbatches=case.microbatches,
            optimizer_mode="async",
            overlap_calls=overlap,
            sanitize=False,
        ),  # fmt: skip
    )
    backend = pipe.backend
    try:
        rows = rows_of(case.batch, case.microbatches)
        # What a profile would measure on the virtual server is the cost model's layer times: given
        # at once, the runtime makes its automatic choice without a profiling step.
        w = backend.costs._workload(max(rows), case.seq)
        pipe._planner.load_measured(
            {
                "layer_times": {ly.name: [ly.fwd_s, ly.bwd_s] for ly in w.layers},
                "microbatch_tokens": max(rows) * case.seq,
                "shape": [case.batch, case.seq],
            }
        )
        pipe.configure_optimizer(lr=1e-5)
        ids = torch.randint(0, 1000, (case.batch, case.seq))
        measured = []
        for _ in range(steps):
            syncs, before = 0, backend.modelled()
            t0, c0 = time.perf_counter(), time.process_time()
            for call in range(case.calls):
                if call:  # each forward_backward starts the count afresh: the last call's is read
                    syncs += backend.host_syncs.count  # after the optimizer step, which it includes
                pipe.forward_backward(ids, ids, accumulate=call < case.calls - 1)
            pipe.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            syncs += backend.host_syncs.count
            measured.append((wall, cpu, syncs, before, backend.modelled()))
        table = pipe.last_plan.table
        workload = dataclasses.replace(
            backend.costs._workload(max(rows), case.seq),
            microbatch_sizes=tuple(rows),
            micro_batch_size=max(rows),
        )
        sim = simulate(table, workload, backend.server, SimOptions(optimizer="async"))
        # One call on its own, drained (as the runtime's calls are without overlap_calls): from its
        # first upload to its last copy or host job (the steady period overlaps consecutive calls).
        alone = simulate(table, workload, backend.server, SimOptions(optimizer="async", iterations=1))
        drained_s = max(s.end for s in alone.timeline.spans)
        steady = measured[1:] or measured
        wall = statistics.median(m[0] for m in steady)
        cpu = statistics.median(m[1] for m in steady)
        _, _, syncs, before, after = steady[-1]
        ops = after["issued_ops"] - before["issued_ops"]
        tasks = case.calls * sum(len(row) for row in table.devices)
        tokens = case.calls * case.batch * case.seq
        sim_call_s = sim.iteration_s
        lanes = []
        for d in range(table.num_devices):
            busy = after["compute_busy_s"][d] - before["compute_busy_s"][d]
            lanes.append(
                {
                    "compute_s": busy,
                    "idle_issue_s": after["compute_idle_issue_s"][d] - before["compute_idle_issue_s"][d],
                    "idle_wait_s": after["compute_idle_wait_s"][d] - before["compute_idle_wait_s"][d],
                    "sim_compute_s": case.calls * sim.compute_busy_s[d],
                    "sim_idle_s": case.calls * (sim_call_s - sim.compute_busy_s[d]),
                }
            )
        runtime_tps, sim_tps = tokens / wall, case.batch * case.seq / sim_call_s
        return {
            "case": case.name,
            "hardware": case.hardware,
            "tokens_per_step": tokens,
            "forward": list(table.forward.bounds),
            "backward": list(table.backward.bounds),
            "step_s": [round(m[0], 3) for m in measured],
            "runtime_tokens_per_s": runtime_tps,
            "sim_tokens_per_s": sim_tps,
            "ratio": runtime_tps / sim_tps,
            "sim_drained_tokens_per_s": case.batch * case.seq / drained_s,
            "ratio_drained": runtime_tps * drained_s / (case.batch * case.seq),
            "reserved_peak_gib": [d.memory.reserved_peak / GIB for d in backend.devices],
            "gpu_memory_gib": backend.server.gpu.memory_bytes / GIB,
            "sim_peak_gib": [b / GIB for b in sim.peak_gpu_bytes],
            "pinned_host_gib": backend.pinned_bytes / GIB,
            "host_syncs_per_step": syncs,
            "host_cpu_ms_per_task": 1000 * cpu / tasks,
            "ops_per_task": ops / tasks,
            "cpu_share": cpu / wall,
            "lanes": lanes,
            "step_wall_s": wall,
            "host_work_s": after["host_work_s"] - before["host_work_s"],
            "sim_optimizer_s": sim.optimizer_busy_s,
            "sim_host_work_s": sim.host_busy_s,
        }
    finally:
        pipe.close()


LANES_CASE = Case("lanes", "qwen3-1.7b", "", 8, 4, 1, layers=4, seq=2048)


def lane_breakdown(pipe) -> dict:
    """The last step's wall time and, per device, the seconds each lane was busy (the union of its
    spans: CUDA events on a GPU, modelled time on the virtual server), the compute lane's gaps (the
    step's time it was not busy), and the host lane's busy seconds (optimizer steps, gradient
    accumulation: measured on the host either way)."""
    from roundpipe.schedule.timeline import HOST_DEVICE

    timeline, step_s = pipe.last_timeline(), pipe.stats()["step_s"]
    devices = []
    for d in range(len(pipe.backend.devices)):
        busy = {lane: timeline.busy(d, lane) for lane in timeline.lanes(d)}
        devices.append({**busy, "compute_idle": max(0.0, step_s - busy.get("compute", 0.0))})
    return {"step_s": step_s, "devices": devices, "host": timeline.busy(HOST_DEVICE, "host")}


def lanes(device: str, steps: int = 3) -> dict:
    """A small Qwen3-1.7B-shaped run (4 decoder layers, bf16, 8 sequences of 2048 in 4 microbatches,
    RoundPipe) on ``device`` with random weights, and the same on the virtual server of the
    simulator's preset for that device (``train.forecast.simulator_hardware``): each lane's busy
    seconds in the last of ``steps`` steps, side by side."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from roundpipe.backend import parse_device_spec
    from roundpipe.train.forecast import simulator_hardware

    spec = parse_device_spec(device)
    preset, how = simulator_hardware(spec)
    if spec.kind != "cuda":  # the dry run: any preset exercises the comparison
        preset, how = f"{spec.count}xrtx4090", "a dry run: cpu devices against an RTX 4090's model"
    # On cpu devices (the GPU check's dry run) a smaller run, which the CPU computes in seconds.
    case = (
        LANES_CASE
        if spec.kind == "cuda"
        else dataclasses.replace(LANES_CASE, layers=1, seq=128, batch=4, microbatches=2)
    )
    config = dict(load_model_config(case.model), num_hidden_layers=case.layers)
    if spec.kind != "cuda":  # and a small vocabulary: a full step of a 151,936-row embedding takes 20 s here
        config["vocab_size"] = 4096
    out: dict = {"device": device, "virtual_spec": f"virtual:{preset}", "preset_from": how}
    ids = torch.randint(0, 1000, (case.batch, case.seq))
    t0 = time.perf_counter()

    def progress(what: str) -> None:  # where the time goes, in the log of a run cut short
        print(f"lanes: {what} at {time.perf_counter() - t0:.1f} s", flush=True)

    for name, run_on in (("real", device), ("virtual", f"virtual:{preset}")):
        if name == "virtual":
            model = meta_model(case)
        elif spec.kind == "cuda":  # random init on the GPU: on the host it takes most of a minute
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
            model = model.cpu()
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
        progress(f"{name} model built")
        # The wrap-time proof runs on a tiny twin: on the model itself (0.4-0.5B parameters, under
        # the size at which the proof goes tiny by itself) it takes minutes of host CPU time.
        run = roundpipe.RunConfig(
            devices=run_on,
            dtype="bf16",
            policy="roundpipe",
            num_microbatches=case.microbatches,
            sanitize=False,
            verify_model=False,
        )
        with roundpipe.wrap(model, run) as pipe:
            pipe.configure_optimizer(lr=1e-5)
            progress(f"{name} model wrapped on {run_on}")
            for i in range(steps):
                t_step = time.perf_counter()
                pipe.forward_backward(ids, ids)
                pipe.step()
                wall = time.perf_counter() - t_step
                progress(f"{name} step {i + 1} of {steps}")
            out[name] = {**lane_breakdown(pipe), "wall_s": wall}
    return out


def print_lanes(r: dict) -> None:
    print(f"lanes of the last step: {r['device']} against {r['virtual_spec']} ({r['preset_from']})")
    print(
        f"  step s: {r['real']['step_s']:.3f} real, {r['virtual']['step_s']:.3f} virtual (forward_backward)"
    )
    print(
        f"  wall s: {r['real']['wall_s']:.3f} real, {r['virtual']['wall_s']:.3f} virtual (with the optimizer step)"
    )
    print(
        f"  host         busy s: {r['real'].get('host', 0.0):.3f} real, {r['virtual'].get('host', 0.0):.3f} virtual"
    )
    for d, (real, virt) in enumerate(zip(r["real"]["devices"], r["virtual"]["devices"])):
        for lane in sorted(set(real) | set(virt)):
            print(
                f"  device {d} {lane:12s} {'idle' if lane == 'compute_idle' else 'busy'} s: "
                f"{real.get(lane, 0.0):.3f} real, {virt.get(lane, 0.0):.3f} virtual"
            )


def _row(r: dict) -> list[str]:
    lanes = r["lanes"]
    idle_issue = max(lane["idle_issue_s"] for lane in lanes)
    idle_wait = max(lane["idle_wait_s"] for lane in lanes)
    sim_idle = max(lane["sim_idle_s"] for lane in lanes)
    return [
        r["case"],
        f"{r['runtime_tokens_per_s']:,.0f}",
        f"{r['sim_tokens_per_s']:,.0f}",
        f"{r['ratio']:.2f}",
        f"{r['sim_drained_tokens_per_s']:,.0f} ({r['ratio_drained']:.2f})",
        f"{max(r['reserved_peak_gib']):.1f} / {r['gpu_memory_gib']:.0f}",
        f"{r['pinned_host_gib']:.0f}",
        str(r["host_syncs_per_step"]),
        f"{r['host_cpu_ms_per_task']:.1f} ({r['emulation_ms_per_task']:.1f})",
        f"{r['cpu_share']:.2f}",
        f"{idle_issue:.1f} / {idle_wait:.1f} / {sim_idle:.1f}",
        f"{r['host_work_s']:.1f} / {r['sim_host_work_s']:.1f} / {r['step_wall_s']:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case, for CI")
    parser.add_argument("--cases", nargs="*", help="names of cases to run (default: all)")
    parser.add_argument(
        "--steps", type=int, default=3, help="optimizer steps per case (the first is warm-up)"
    )
    parser.add_argument(
        "--lanes", metavar="DEVICE", help="only the per-lane breakdown of a small run on DEVICE (e.g. cuda:0) "
        "beside the virtual server's prediction for it; prints, and writes no results unless --json is given"
    )  # fmt: skip
    parser.add_argument(
        "--json", metavar="PATH", help="with --lanes: also write the breakdown to PATH as JSON"
    )
    parser.add_argument(
        "--drained", nargs="*", default=[], metavar="NAME",
        help="also run these cases with every call drained (overlap_calls off), before the rest: "
        "what overlapping consecutive calls gains, side by side in one run"
    )  # fmt: skip
    parser.add_argument(
        "--without-token", nargs="*", default=[], metavar="NAME",
        help="also run these cases with the issue token off (roundpipe/backend/issue_token.py), before "
        "the same cases with it: what the token saves, side by side in one run"
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.lanes:
        breakdown = lanes(args.lanes)
        print_lanes(breakdown)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(breakdown, f, indent=1)
        return 0
    cases = (QUICK,) if args.quick else tuple(c for c in CASES if not args.cases or c.name in args.cases)
    steps = 2 if args.quick else args.steps
    load = os.getloadavg()[0]
    overhead_us = emulation_us_per_op()
    print(f"the issue mode adds {overhead_us:.1f} us per operation", flush=True)
    results = []
    runs = (
        [(c, False, True) for c in CASES if c.name in args.without_token]
        + [(c, True, False) for c in CASES if c.name in args.drained]
        + [(c, True, True) for c in cases]
    )
    for case, token, overlap in runs:
        label = "" if token else " (no issue token)"
        label += "" if overlap else " (drained calls)"
        print(f"{case.name}{label} ...", flush=True)
        ISSUE_TOKEN.enabled = token
        try:
            r = run_case(case, steps, overlap)
        finally:
            ISSUE_TOKEN.enabled = True
        r["case"] += label
        r["issue_token"], r["overlap_calls"] = token, overlap
        r["emulation_ms_per_task"] = r["ops_per_task"] * overhead_us / 1000
        results.append(r)
        print(" | ".join(_row(r)), flush=True)
        write(results, overhead_us, load)  # after every case: a run cut short keeps what it measured

    write(results, overhead_us, load)
    return 0


def write(results: list[dict], overhead_us: float, load: float) -> None:
    header = [
        "case", "runtime tokens/s", "simulator tokens/s", "ratio",
        "simulator, each call drained: tokens/s (runtime's ratio)", "reserved peak GiB / GPU",
        "pinned host GiB", "host syncs / step", "host CPU ms / task (of it emulation)", "CPU share",
        "worst GPU idle s: issue / waits / simulator", "host work s / step: runtime / simulator / step",
    ]  # fmt: skip
    notes = (
        "Each case: the paper's end-to-end setting (sequence 2048, fp16 with fp16 accumulation, async "
        "optimizer, RoundPipe policy), steady-state steps after the first. The simulator replays the "
        "runtime's own table, microbatch sizes and layer costs; its steady period overlaps one call's "
        "tail with the next call's start, as the runtime does with overlap_calls (a case marked "
        "'drained calls' runs without it): the drained column is the simulator's one call on its own, "
        "from its first upload to its last copy or host job. Idle: per GPU, seconds of one step its "
        "compute lane had nothing issued (the host's issue) or waited for another stream's event, "
        "against the simulator's idle time of the same step; the GPU with the most is shown. Host work: "
        "the modelled seconds of the host thread's jobs (gradient accumulation, the finiteness check, "
        "AdamW, the refresh of compute copies) per step, against the simulator's host lane (the same "
        "jobs at the bytes of sim/host_traffic.py, for one forward_backward: the cases of 2 or 4 calls "
        "per step make that many calls' additions) and the step's wall time. Qwen3-235B-A22B: LoRA r=32, alpha 16, on every "
        "nn.Linear (transformers fuses each layer's experts into 3-D parameters, which peft's "
        "all-linear does not reach), transformers' grouped experts; the routing is modelled as the "
        "cost model's uniform expert load, and each grouped product's read of its offsets is a host "
        "sync on an RTX 4090 (torch's fallback; docs/virtual.md). The host "
        "CPU time includes the cpu backend's issue mode, a Python layer per operation that CUDA does "
        f"not have (docs/virtual.md): measured here at {overhead_us:.1f} us per operation, times the "
        f"operations a task issues, in brackets. Load average at the start: {load:.2f}."
    )
    write_results(
        "virtual_server", {"results": results, "emulation_us_per_op": overhead_us, "load_average": os.getloadavg()}, [_row(r) for r in results], header,
        notes,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
