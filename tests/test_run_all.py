"""benchmarks/run_all.py: the CI smoke runs a benchmark end to end into a temporary directory and
fails when it fails; the summary page is built from the results on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402


def test_every_benchmark_script_is_in_the_list_and_exists():
    listed = {b.name for b in run_all.BENCHMARKS}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")} - {"run_all"}
    assert listed == scripts


def test_the_smoke_runs_a_benchmark_into_a_temporary_directory_and_leaves_the_results_alone(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").iterdir()}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--only", "choice_speed"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout and "choice_speed" in out.stdout
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").iterdir()} == before


def test_a_failing_benchmark_fails_the_run(tmp_path, monkeypatch):
    bad = run_all.Bench("missing_benchmark", "a script that is not there", quick=())
    result = run_all.run_one(bad, quick=True, results_dir=tmp_path)
    assert not result["ok"] and result["status"] != 0 and "missing_benchmark" in result["tail"]


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(SystemExit):
        run_all.main(["--quick", "--only", "nonesuch"])


def test_the_summary_names_the_machine_and_each_result():
    runs = [{"name": "sim_speed", "command": "python benchmarks/sim_speed.py", "seconds": 1.0, "ok": True}]
    text = run_all.summary_markdown(runs, {"cpus": 2})
    assert "- cpus: 2" in text and "## sim_speed" in text
