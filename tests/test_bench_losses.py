"""The loss checks of the benchmarks that compare systems (benchmarks/_common.py ``check_losses``,
scaling.py, overhead.py, readiness.py): every system of a comparison trains the same weights on
the same batches, so a loss that differs beyond round-off fails the benchmark. The two smokes run
scaling.py and overhead.py in quick mode into a temporary results directory
(``ROUNDPIPE_BENCH_RESULTS``); no timing is asserted."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import _common  # noqa: E402
import readiness  # noqa: E402


def test_agreeing_losses_pass_and_a_loss_past_the_tolerance_fails():
    ref = [2.0, 1.9, 1.8]
    assert _common.check_losses({"a": ref, "b": [x * (1 + 1e-6) for x in ref]}) == []
    first = _common.check_losses({"a": ref, "b": [2.0 * (1 + 3 * _common.RTOL_FIRST), 1.9, 1.8]})
    assert len(first) == 1 and first[0].startswith("b step 0:")
    later = _common.check_losses({"a": ref, "b": [2.0, 1.9, 1.8 * (1 + 3 * _common.RTOL_LATER)]})
    assert len(later) == 1 and later[0].startswith("b step 2:")
    assert _common.check_losses({"a": ref, "b": ref[:2]}) == ["b: 2 losses, a: 3"]
    assert len(_common.check_losses({"a": ref, "b": [2.0, math.nan, 1.8]})) == 1


def test_readiness_names_the_policy_and_case_whose_orders_disagree():
    def result(diff):
        return {"runtime": {"none": {"loss_max_rel_diff": diff}, "slow device": {"loss_max_rel_diff": 0.0}}}

    assert readiness.loss_problems({"1f1b": result(1e-7), "roundpipe": result(0.0)}) == []
    problems = readiness.loss_problems(
        {"1f1b": result(2 * readiness.LOSS_RTOL), "roundpipe": result(math.nan)}
    )
    assert [p.split(":")[0] for p in problems] == ["1f1b / none", "roundpipe / none"]
    assert readiness.loss_problems({"gpipe": {"runtime": None}}) == []  # --no-runtime: nothing to compare


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_BENCH_RESULTS", str(tmp_path))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, systems",
    [
        ("scaling", ["cpu:1", "cpu:2"]),
        ("overhead", ["plain PyTorch + per-layer checkpointing", "roundpipe, cpu:1", "roundpipe, cpu:1, stream sanitizer on"]),
    ],
)  # fmt: skip
def test_a_quick_comparison_records_every_systems_losses_and_they_agree(results, name, systems):
    module = __import__(name)
    assert module.main(["--quick"]) == 0
    data = json.loads((results / f"{name}.json").read_text())
    assert data["quick"] and data["loss_problems"] == []
    assert list(data["losses"]) == systems
    steps = {len(v) for v in data["losses"].values()}
    assert steps == {2}  # one warm-up and one timed step each
    assert "agree at every step" in (results / f"{name}.md").read_text()
