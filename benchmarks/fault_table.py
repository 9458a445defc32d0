"""How each injected fault surfaces: the error the caller gets, how long it takes, and whether the
step redone after ``abandon_step`` ends exactly where a run without the fault ends.

The faults and their expected errors are ``tests/test_faults.py``'s ``CASES`` (a tiny Llama on
``cpu:2``, 1F1B, two microbatches, deferred updates, ``watchdog_s=1`` for the stall); each is injected into the
second of three steps, five times (the median time is reported).

    python benchmarks/fault_table.py [--repeats 5]

Writes ``benchmarks/results/fault_table.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def measure(case: str, repeats: int) -> dict:
    import torch
    from support.tiny_models import make_batch, make_model
    from test_faults import CASES, _pipe, _train, _weights

    from roundpipe.testing import faults

    model, batch = make_model("llama", num_layers=2), make_batch(batch=4)
    with _pipe(model) as pipe:
        _train(pipe, batch, 3)
        clean = _weights(pipe)
    fault, error, _ = CASES[case]
    times, exact, surfaced = [], [], ""
    for _ in range(repeats):
        injected = copy.copy(fault)
        injected.fired, injected.step = 0, None if fault.where == "optimizer" else 1
        with _pipe(model, watchdog_s=1.0 if fault.kind == "stall" else 300.0) as pipe:
            _train(pipe, batch, 1)
            with faults.injected(injected):
                t0 = time.perf_counter()
                try:
                    _train(pipe, batch, 1)
                    surfaced = "nothing raised"
                except Exception as err:  # noqa: BLE001 (what surfaced is the measurement)
                    times.append(time.perf_counter() - t0)
                    surfaced = f"{type(err).__name__}: {str(err).splitlines()[0][:140]}"
            if pipe.abandon_step():
                _train(pipe, batch, 2)
                got = _weights(pipe)
                exact.append(all(torch.equal(got[k], clean[k]) for k in clean))
            else:
                exact.append(None)
    return {
        "fault": case,
        "point": fault.where,
        "kind": fault.kind,
        "expected": error.__name__,
        "surfaced": surfaced,
        "median_s": statistics.median(times) if times else None,
        "redone_exactly": None if exact[0] is None else all(exact),
    }


def main() -> None:
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from test_faults import CASES

    rows = [measure(case, args.repeats) for case in CASES]
    out = Path(
        os.environ.get("ROUNDPIPE_BENCH_RESULTS") or REPO / "benchmarks" / "results"
    )  # run_all --quick
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/fault_table.py" + "".join(f" {a}" for a in sys.argv[1:])
    (out / "fault_table.json").write_text(json.dumps({"command": command, "faults": rows}, indent=1) + "\n")
    lines = [
        "| fault | point | kind | surfaced as | median time to surface | step redone exactly |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        redo = {True: "yes", False: "NO", None: "not redone: part of the update was applied"}[
            r["redone_exactly"]
        ]
        when = "-" if r["median_s"] is None else f"{r['median_s'] * 1e3:.0f} ms"
        lines.append(f"| {r['fault']} | {r['point']} | {r['kind']} | {r['surfaced']} | {when} | {redo} |")
    (out / "fault_table.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
