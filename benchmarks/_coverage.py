"""What the coverage walks share: ``model_coverage.py`` (every causal-LM family),
``family_tester_coverage.py`` (transformers' tester configs) and ``peft_coverage.py`` (peft's
configurations).

Each runs its cases in subprocesses and writes a JSON result file and a generated section of
``docs/models.md``; the pieces that are the same for all three live here: one case run in a fresh
interpreter of its own session with its result line read back (:func:`run_one`), the outcome
counts, the library versions a result file records, a markdown table cell, the progress line, and
the end of a run (an ``--update`` merged into the full run's rows, the files written, the counts
printed: :func:`finish`).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def run_one(script: Path, flag: str, name: str, mark: str, timeout: float, key: str) -> dict:
    """``script flag name`` in a fresh interpreter of its own session (a timeout kills it and all
    it started), and the JSON after ``mark`` on its last result line; a row ``{key: name, outcome:
    failed}`` saying how when there is none."""
    cmd = [sys.executable, str(script), flag, name]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {key: name, "outcome": "failed", "detail": f"timed out after {timeout:g} s"}
    for line in reversed(out.splitlines()):
        if line.startswith(mark):
            return json.loads(line[len(mark) :])
    return {key: name, "outcome": "failed", "detail": crashed(proc.returncode, err)}


def crashed(returncode: int, stderr: str) -> str:
    """What a case's subprocess ending without a result line is recorded as."""
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
    return f"crashed ({how}): {last[:200] or 'no output'}"


def counts(rows: Sequence[dict], outcomes: Sequence[str]) -> dict[str, int]:
    return {kind: sum(r["outcome"] == kind for r in rows) for kind in outcomes}


def versions(*packages: str) -> dict[str, str]:
    """``{package: version}`` in the order given, then Python's."""
    import importlib

    found = {name: importlib.import_module(name).__version__ for name in packages}
    return {**found, "python": platform.python_version()}


def cell(value) -> str:
    """``value`` as one markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def progress(i: int, total: int, name: str, row: dict, width: int, limit: int = 150) -> None:
    detail = f": {row['detail']}" if row.get("detail") else ""
    seconds = row.get("seconds", "?")
    print(f"[{i}/{total}] {name:<{width}} {row['outcome']}{detail[:limit]} ({seconds} s)", flush=True)


def finish(
    rows: list[dict],
    command: str,
    *,
    only: bool,
    update: bool,
    out: Path | None,
    docs: Path | None,
    results: Path,
    stem: str,
    key: str,
    list_key: str,
    default_docs: Path,
    write_json: Callable[[Path, list[dict], str], None],
    write_docs: Callable[[Path, list[dict], str], None],
    outcomes: Sequence[str],
) -> None:
    """The end of a walk. ``update`` (with ``only``): these rows replace theirs in the full run's
    ``results/stem.json`` (rows by ``key``, under ``list_key``). A whole run (or an update) writes
    ``stem.json`` and ``default_docs``; an ``only`` run ``stem_only.json`` and no docs; ``out`` and
    ``docs`` replace those paths."""
    if update:
        previous = json.loads((results / f"{stem}.json").read_text())
        fresh = {r[key]: r for r in rows}
        rows = [fresh.get(r[key], r) for r in previous[list_key]]
        command = f"{previous['command']}; then {command}"
    whole = not only or update
    out = out or results / (f"{stem}.json" if whole else f"{stem}_only.json")
    write_json(out, rows, command)
    docs = docs if docs is not None else (default_docs if whole else None)
    if docs is not None:
        write_docs(docs, rows, command)
    print(" ".join(f"{kind}: {n}," for kind, n in counts(rows, outcomes).items()).rstrip(","))
    print(f"wrote {out}" + (f" and {docs}" if docs is not None else ""))
