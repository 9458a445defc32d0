"""Run every benchmark, one subprocess each, and summarise them in ``docs/benchmarks.md``.

``python benchmarks/run_all.py`` (``make bench``) runs the full set: each benchmark writes its own
``benchmarks/results/NAME.{json,md}`` (and, for some, its docs page), then this script writes
``benchmarks/results/run_all.json`` (what ran, how long, its exit status) and ``docs/benchmarks.md``:
the machine, then every benchmark's markdown result, in the order below.

``--summarise`` runs nothing and writes ``docs/benchmarks.md`` from the results already on disk
(each result file names the command and machine that produced it), with the run times and
statuses ``run_all.json`` recorded. ``--only a,b`` (measured) reruns a subset: their records in
``run_all.json`` replace the old ones and the summary is rewritten, the others' pages as they were.

``--quick`` is the CI smoke (``.ci/run``): every benchmark that has a run of a few seconds, at that
size (the others are full-run only and listed as skipped),
its results written into a temporary directory (``ROUNDPIPE_BENCH_RESULTS``), so that a smoke run
never overwrites the measured results or the docs. It checks that each one runs end to end, exits
0 and still writes its results file; it measures nothing worth quoting. ``--only a,b`` runs a subset.

A benchmark that fails or runs past its timeout is reported with the tail of its output; the exit
status is 1 if any did.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DOCS = REPO / "docs"  # where a few benchmarks write their pages (policies.md, paper_setting.md)
DOC = DOCS / "benchmarks.md"


@dataclass(frozen=True)
class Bench:
    name: str  # the script benchmarks/NAME.py, and its results/NAME.md
    what: str  # one line for the summary
    full: tuple[str, ...] = ()  # arguments of the measured run
    # Arguments of the CI smoke; None: full run only (its smallest run takes 30 s or more here, and
    # the smoke as a whole must stay under 2 minutes; `make test` covers what those measure).
    quick: tuple[str, ...] | None = ("--quick",)
    results: tuple[str, ...] = ()  # its results files, when not NAME.md
    timeout_s: float = 3600.0


BENCHMARKS = (
    Bench("vs_torch_pipelining", "roundpipe against torch.distributed.pipelining on 2 gloo processes"),
    Bench("readiness", "readiness-first against fixed order when the work varies (RRFP)"),
    Bench("schedule_study", "GPipe, 1F1B, Chimera and Hanayo through three abstractions"),
    Bench("joint_tuning", "joint partition + schedule search against single-phase baselines (OctoPipe)"),
    Bench("paper_setting", "the RoundPipe paper's setting replayed in the simulator", quick=None),
    Bench("policies", "every dispatch policy simulated on 8x RTX 4090", quick=None, results=("policies.md",)),
    Bench("scaling", "one worker to two on two cores", quick=None),
    Bench("overhead", "the streaming runtime against plain PyTorch on one worker", quick=None),
    Bench("masked_head", "skipping unlabelled tokens in the LM head", quick=None),
    Bench("fault_table", "how each injected fault surfaces and whether the step is redone exactly", quick=None),
    Bench("model_coverage", "which causal-LM families of the installed transformers train exactly", quick=None, results=("models.md",)),
    Bench("peft_coverage", "which peft configurations (from peft's test suite) train exactly or are refused", quick=None, results=("models.md",), timeout_s=7200.0),
    Bench("family_tester_coverage", "whether families built from transformers' own tester configs, dropout on, train exactly and replay it", quick=None, results=("models.md",)),
    Bench("host_syncs", "device values a steady step reads on the host, per model family (CUDA's clock)"),
    Bench("long_context_bytes", "where a long sequence's bytes go on a GPU and the host: Qwen3-32B and Qwen3-235B-A22B", quick=()),
    Bench("quantization", "frozen weights kept in nf4, int8 or fp8: host RAM, PCIe and time against bf16 (235B on 256 GiB, 32B on one GPU)"),
    Bench("sim_speed", "how long one simulation takes", quick=("--repeats", "1")),
    Bench("choice_speed", "how long the runtime's automatic choice takes", quick=("--repeats", "1")),
    Bench("readiness_virtual", "readiness-first against fixed order on a virtual 4x RTX 4090 server, against the simulator"),
    Bench("virtual_server", "the real runtime on a virtual 8x RTX 4090 server at full model size, against the simulator", timeout_s=3600.0),
    Bench("gpu_throughput", "tokens/s on one GPU against plain HF and FSDP2 offload (dry run on cpu here)", full=("--dry-run",), quick=("--dry-run", "--tiny"), results=("gpu_throughput_dry_run.md",)),
)  # fmt: skip


def machine() -> dict:
    """The machine the figures come from."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": _cpu_model(),
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch
        import transformers

        info["torch"], info["transformers"] = torch.__version__, transformers.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_one(bench: Bench, quick: bool, results_dir: Path) -> dict:
    """Run one benchmark in a subprocess; what it did."""
    args = bench.quick if quick else bench.full
    cmd = [sys.executable, str(HERE / f"{bench.name}.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ROUNDPIPE_SANITIZE", None)  # a debugging aid, not what a user runs
    # Only a smoke redirects: a benchmark that writes a docs page (policies, paper_setting) takes
    # the variable to mean "a smoke run, everything into that directory", so a measured run leaves
    # it unset and each file goes where the benchmark puts it (benchmarks/results, docs/).
    env.pop("ROUNDPIPE_BENCH_RESULTS", None)
    if quick:
        env["ROUNDPIPE_BENCH_RESULTS"] = str(results_dir)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=bench.timeout_s if not quick else 300,
        )
        status, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status = "timeout"
        output = (
            (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        )
    seconds = time.perf_counter() - t0
    files = bench.results or (f"{bench.name}.md",)
    # A smoke writes everything into its temporary directory; a measured run may write a docs page.
    missing = [f for f in files if not (results_dir / f).is_file() and (quick or not (DOCS / f).is_file())]
    ok = status == 0 and not missing
    return {
        "name": bench.name,
        "command": " ".join(["python", f"benchmarks/{bench.name}.py", *args]),
        "seconds": round(seconds, 1),
        "status": status,
        "ok": ok,
        "missing_results": missing,
        "tail": "" if ok else output[-3000:],
    }


def summary_markdown(runs: list[dict], info: dict) -> str:
    """``docs/benchmarks.md``: the machine, then each benchmark's result page."""
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by `python benchmarks/run_all.py` (`make bench`); do not edit. -->",
        "",
        "Every figure below was measured by the command beside it, on this machine "
        "(shared and noisy: medians are quoted; ratios are measured side by side in one run):",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "What `scripts/gpu_check.sh` measured on a real GPU is in [gpu.md](gpu.md).",
        "",
        "| benchmark | what | seconds | status |",
        "|---|---|---|---|",
    ]
    by_name = {b.name: b for b in BENCHMARKS}
    for r in runs:
        lines.append(
            f"| `{r['command']}` | {by_name[r['name']].what} | {r['seconds']} | {'ok' if r['ok'] else 'FAILED'} |"
        )
    for r in runs:
        bench = by_name[r["name"]]
        for file in bench.results or (f"{bench.name}.md",):
            path = RESULTS / file
            if not path.is_file():
                if (DOCS / file).is_file():  # a page of its own: linked, not copied
                    lines += ["", f"## {bench.name}", "", f"`{r['command']}`: see [{file}]({file})."]
                continue
            text = path.read_text().strip()
            body = text.split("\n", 1)[1] if text.startswith("# ") else text  # its own title becomes ##
            lines += ["", f"## {bench.name}", "", f"`{r['command']}`", "", body.strip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI smoke: every benchmark at its smallest")
    ap.add_argument("--only", help="comma-separated benchmark names (default: all)")
    ap.add_argument(
        "--summarise",
        action="store_true",
        help="run nothing: write docs/benchmarks.md from the results already in benchmarks/results",
    )
    args = ap.parse_args(argv)
    if args.summarise:
        DOC.write_text(summary_markdown(recorded_runs({}), machine()))
        print(f"wrote {DOC.relative_to(REPO)} from the results on disk")
        return 0
    chosen = BENCHMARKS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {b.name for b in BENCHMARKS})
        if unknown:
            ap.error(
                f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(b.name for b in BENCHMARKS)}"
            )
        chosen = tuple(b for b in BENCHMARKS if b.name in wanted)
    if args.quick:
        for b in chosen:
            if b.quick is None:
                print(f"skipped        {b.name} (full run only: make bench)")
        chosen = tuple(b for b in chosen if b.quick is not None)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="roundpipe-bench-") as tmp:
        results_dir = Path(tmp) if args.quick else RESULTS
        runs = []
        for bench in chosen:
            r = run_one(bench, args.quick, results_dir)
            runs.append(r)
            print(f"{'ok    ' if r['ok'] else 'FAILED'} {r['seconds']:7.1f} s  {r['command']}", flush=True)
            if not r["ok"]:
                print(f"  status {r['status']}; missing {r['missing_results']}\n{r['tail']}", flush=True)
    total = time.perf_counter() - t0
    print(f"{len(runs)} benchmarks in {total:.0f} s; {sum(not r['ok'] for r in runs)} failed")
    if not args.quick:
        info = machine()
        RESULTS.mkdir(exist_ok=True)
        if args.only:  # the others keep what their last run recorded
            merged = recorded_runs({r["name"]: r for r in runs})
            before = _recorded()
            reruns = [*before.get("reruns", []), {"only": sorted(wanted), "total_s": round(total, 1)}]
            payload = {**before, "runs": merged, "reruns": reruns}
        else:
            merged = runs
            payload = {"machine": info, "runs": runs, "total_s": round(total, 1)}
        (RESULTS / "run_all.json").write_text(json.dumps(payload, indent=2) + "\n")
        DOC.write_text(summary_markdown(merged, info))
    return 0 if all(r["ok"] for r in runs) else 1


def _recorded() -> dict:
    """``results/run_all.json`` as the last measured run wrote it (empty when there is none)."""
    path = RESULTS / "run_all.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def recorded_runs(newer: dict[str, dict]) -> list[dict]:
    """Every benchmark's run record in the order of :data:`BENCHMARKS`: from ``newer`` when it has
    one, else as ``run_all.json`` recorded it, else unknown (seconds ``-``, its full command)."""
    old = {r["name"]: r for r in _recorded().get("runs", [])}
    out = []
    for b in BENCHMARKS:
        unknown = {
            "name": b.name,
            "command": " ".join(["python", f"benchmarks/{b.name}.py", *b.full]),
            "seconds": "-",
            "ok": True,
        }
        out.append(newer.get(b.name) or old.get(b.name) or unknown)
    return out


if __name__ == "__main__":
    sys.exit(main())
