"""The RoundPipe paper's schedule study (benchmarks/paper_setting.py) on Qwen3-1.7B: the
plan roundpipe picks itself is no worse than the paper's partitions, async stays under 4.5% bubble
and sync cuts the best classic schedule's bubble by at least 23% (the paper's claims). The five
models' table is docs/paper_setting.md. Pure Python."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import paper_setting  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study():
    # No deadline: the search runs to convergence, so the result does not depend on the machine.
    return paper_setting.study(["qwen3-1.7b"], seconds=math.inf)["models"]


@pytest.mark.parametrize("name", ["qwen3-1.7b"])  # the other four: docs/paper_setting.md (a minute more)
def test_own_plans_are_no_worse_than_the_papers_partitions(study, name):
    r = study[name]
    for optimizer in ("sync", "async"):
        own, paper = r[f"roundpipe_{optimizer}_own"], r[f"roundpipe_{optimizer}_paper"]
        assert own["bubble"] <= paper["bubble"] + 1e-9, (optimizer, own, paper)
    assert r["roundpipe_async_own"]["bubble"] < 0.045
    assert r["summary"]["sync_cut_vs_best_classic"] >= 0.23


def test_the_papers_partitions_are_read_as_the_paper_states_them():
    setting = paper_setting.load_setting()
    model = paper_setting.paper_model("llama3.1-8b", setting)
    fwd, bwd = paper_setting.paper_roundpipe_partitions("llama3.1-8b", setting, model.workload.num_layers)
    assert paper_setting.stage_sizes(fwd) == [6, 5, 5, 5, 6, 6, 1]  # embedding joins the first stage
    assert paper_setting.stage_sizes(bwd) == [3] + [2] * 15 + [1]  # the head alone, fused
