"""The schedule study and the joint-tuning benchmark (benchmarks/schedule_study.py, joint_tuning.py)
run in quick mode into a temporary results directory (``ROUNDPIPE_BENCH_RESULTS``): the JSON has the
keys the docs are written from, every verdict is one of the three allowed, and a quick run leaves
the docs alone. No timing is asserted. Pure Python (the simulator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import joint_tuning  # noqa: E402
import schedule_study  # noqa: E402

from roundpipe.errors import ConfigError  # noqa: E402

# A benchmark's smoke: `make test-slow` runs it (and `make bench-quick` runs the benchmark itself).
pytestmark = pytest.mark.slow

VERDICTS = {"reproduced", "not reproduced", "only under stated conditions"}
DOC = REPO / "docs" / "schedule_study.md"


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_BENCH_RESULTS", str(tmp_path))
    return tmp_path


def _doc() -> str | None:
    return DOC.read_text(encoding="utf-8") if DOC.exists() else None


def test_schedule_study_quick_writes_results_with_computed_verdicts(results):
    doc_before = _doc()
    assert schedule_study.main(["--quick"]) == 0
    assert _doc() == doc_before, "a quick run must not rewrite docs/schedule_study.md"
    data = json.loads((results / "schedule_study.json").read_text())
    assert (results / "schedule_study.md").read_text().startswith("# schedule_study")
    assert data["quick"] is True
    assert set(data["conclusions"]) == {"a", "b", "c"}
    for c in data["conclusions"].values():
        assert c["verdict"] in VERDICTS and c["claim"]
        for v in c["per_setting"].values():
            assert v["verdict"] in VERDICTS and v["sentence"]
            assert bool(v["condition"]) == (v["verdict"] == "only under stated conditions")
    (setting,) = data["settings"]
    assert set(setting["policies"]) == set(schedule_study.STUDIED)
    links = setting["links_fastest_first"]
    assert set(links) == set(schedule_study.QUICK_LINKS)
    chimera_m1 = setting["policies"]["chimera"]["points"][0]
    assert chimera_m1["m"] == 1 and "multiples of 2" in chimera_m1["skipped"]
    point = setting["policies"]["1f1b"]["points"][-1]
    for key in ("closed_unit", "closed_actual", "table_unit", "table_actual"):
        assert key in point
    assert set(point["sim"]) == set(links)
    assert set(setting["rankings"]) == {str(m) for m in schedule_study.QUICK_MICROBATCHES}
    assert data["closed_vs_table"]["defined"] > 0
    assert data["closed_vs_table"]["equal"] == data["closed_vs_table"]["defined"]


def test_joint_tuning_quick_writes_ratios_and_a_verdict(results):
    doc_before = _doc()
    assert joint_tuning.main(["--quick"]) == 0
    assert _doc() == doc_before
    data = json.loads((results / "joint_tuning.json").read_text())
    assert (results / "joint_tuning.md").exists()
    assert data["verdict"]["verdict"] in VERDICTS
    (case,) = data["cases"]
    assert case["model"] == "qwen3-0.6b" and case["verdict"] in VERDICTS
    for key in ("joint", "partition_only", "schedule_only"):
        assert case[key]["tokens_per_s"] > 0 and case[key]["policy"]
    assert case["partition_only"]["policy"] == "1f1b"
    assert case["schedule_only"]["head_shards"] == 1
    for key in ("ratio_vs_partition_only", "ratio_vs_schedule_only"):
        assert case[key] is None or case[key] > 0  # None: only the joint plan fits (inf in JSON)
    assert case["layers"]["head_in_layers"] > 1


def test_even_partition_splits_decoder_layers_and_keeps_embedding_and_head_at_the_ends():
    # embed + 28 decoder layers + head; 8 stages: four of 4 layers, four of 3
    assert joint_tuning.even_bounds(28, 8) == (0, 5, 9, 13, 17, 20, 23, 26, 30)
    assert joint_tuning.even_bounds(4, 1) == (0, 6)
    with pytest.raises(ConfigError, match="at most 4"):
        joint_tuning.even_bounds(4, 5)
