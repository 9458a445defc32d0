"""benchmarks/run_all.py: the CI smoke runs a benchmark end to end into a temporary directory and
fails when it fails; the summary page is built from the results on disk."""

from __future__ import annotations

import json
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


def test_a_rerun_of_some_keeps_the_others_records_and_unknown_ones_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    assert [r["seconds"] for r in run_all.recorded_runs({})] == ["-"] * len(run_all.BENCHMARKS)
    first, second = run_all.BENCHMARKS[0].name, run_all.BENCHMARKS[1].name
    old = [{"name": first, "command": "python old", "seconds": 5.0, "ok": True},
           {"name": second, "command": "python old", "seconds": 7.0, "ok": True}]  # fmt: skip
    (tmp_path / "run_all.json").write_text(json.dumps({"runs": old}))
    new = {"name": second, "command": "python new", "seconds": 9.0, "ok": False}
    runs = run_all.recorded_runs({second: new})
    assert [r["name"] for r in runs] == [b.name for b in run_all.BENCHMARKS]
    assert runs[0] == old[0] and runs[1] == new and runs[2]["seconds"] == "-"
    text = run_all.summary_markdown(runs, {"cpus": 2})
    assert "| 5.0 | ok |" in text and "| 9.0 | FAILED |" in text


def test_a_smoke_that_exits_0_without_writing_its_results_file_fails(tmp_path):
    silent = run_all.Bench(
        "choice_speed", "writes choice_speed.md only", quick=("--repeats", "1"), results=("nonesuch.md",)
    )
    result = run_all.run_one(silent, quick=True, results_dir=tmp_path)
    assert result["status"] == 0 and not result["ok"] and result["missing_results"] == ["nonesuch.md"]
    assert (tmp_path / "choice_speed.md").is_file()


def test_only_a_smoke_redirects_the_results_so_a_measured_run_writes_the_docs_pages(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen[kwargs["timeout"]] = env.get("ROUNDPIPE_BENCH_RESULTS")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    monkeypatch.setenv("ROUNDPIPE_BENCH_RESULTS", "/somewhere/else")
    bench = run_all.Bench("policies", "a docs page", results=("policies.md",), timeout_s=1000)
    run_all.run_one(bench, quick=True, results_dir=tmp_path)
    run_all.run_one(bench, quick=False, results_dir=run_all.RESULTS)
    assert seen == {300: str(tmp_path), 1000: None}
