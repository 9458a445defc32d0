"""The loss-agreement part of benchmarks/vs_torch_pipelining.py at a tiny size: torch's GPipe,
1F1B and interleaved 1F1B schedules on 2 gloo processes (with and without per-layer
checkpointing) and roundpipe's gpipe, 1f1b and roundpipe policies on ``cpu:2`` compute the same
losses step for step; the check rejects a loss a little outside its tolerance; a failing torch
rank surfaces as ``RankFailed`` instead of hanging. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vs_torch_pipelining as bench  # noqa: E402

# A benchmark's smoke (two torch ranks start, about a minute here): `make test-slow` runs it, and
# `make bench-quick` runs the benchmark itself.
pytestmark = pytest.mark.slow

TINY = bench.Setup(
    hidden=64,
    layers=4,
    intermediate=128,
    vocab=512,
    heads=4,
    batch=4,
    seq=16,
    microbatches=4,
    steps=1,
    warmup=1,
)


@pytest.fixture(scope="module")
def ranks():
    # One pair of ranks for the module (starting one costs an import of torch and transformers);
    # the generous timeout only matters on a hang, which would fail the test rather than stall it.
    with bench.TorchRanks(TINY, pin=False, timeout_s=600) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def compared(ranks):
    splits = {(s, c): bench.default_split(s, TINY.layers) for c in (True, False) for s in bench.SCHEDULES}
    # sanitize=None: the stream sanitizer follows ROUNDPIPE_SANITIZE, which conftest turns on
    return bench.compare(TINY, ranks=ranks, splits=splits, sanitize=None, log=lambda *_: None)


def test_every_system_computes_the_same_losses(compared):
    losses = compared["losses"]
    expected = [bench.torch_name(s, c) for c in (True, False) for s in bench.SCHEDULES]
    expected += [f"roundpipe {p}" for p in bench.ROUNDPIPE_POLICIES]
    assert sorted(losses) == sorted(expected)
    assert all(len(v) == TINY.warmup + TINY.steps for v in losses.values())
    assert bench.check_losses(losses) == []
    # the steps trained: a later loss differs from the first (the batches differ, the weights moved)
    first = losses[expected[0]]
    assert first[-1] != first[0]


def test_the_check_rejects_a_loss_just_outside_its_tolerance(compared):
    losses = compared["losses"]
    name = "roundpipe roundpipe"
    for step, rtol in ((0, bench.RTOL_FIRST), (TINY.warmup + TINY.steps - 1, bench.RTOL_LATER)):
        bad = {n: list(v) for n, v in losses.items()}
        bad[name][step] *= 1 + 3 * rtol
        problems = bench.check_losses(bad)
        assert len(problems) == 1 and problems[0].startswith(f"{name} step {step}:"), problems
    short = {n: list(v) for n, v in losses.items()}
    short[name].pop()
    n = TINY.warmup + TINY.steps
    assert bench.check_losses(short) == [f"{name}: {n - 1} losses, torch gpipe + ckpt: {n}"]
    nan = {n: list(v) for n, v in losses.items()}
    nan[name][1] = float("nan")
    assert len(bench.check_losses(nan)) == 1


def test_candidate_splits_cover_every_layer():
    for schedule in bench.SCHEDULES:
        for layers in (4, 8):
            splits = bench.candidate_splits(schedule, layers)
            assert splits and all(sum(s) == layers for s in splits)
            assert all(len(s) == (4 if schedule == "interleaved" else 2) for s in splits)


def test_a_failing_rank_surfaces_instead_of_hanging(ranks):
    # last in the module: the failure ends the ranks
    with pytest.raises(bench.RankFailed, match="rank 1 failed"):
        ranks.build("broken", "gpipe", (1, 99), True)  # rank 1's stage names layers the model lacks
    assert not ranks.alive()


def test_the_goal_is_judged_and_a_reading_under_load_says_it_is_not_fair():
    assert bench.judge(0.7, 1.5, 2, pinned=True) | {"text": ""} == {
        "met": True, "fair": True, "median_load": 1.5, "cores": 2, "text": ""
    }  # fmt: skip
    assert bench.judge(1.2, 1.5, 2, pinned=True)["text"] == "missed"
    loaded = bench.judge(0.7, 7.6, 2, pinned=True)
    assert loaded["met"] and not loaded["fair"]
    assert "not a fair reading" in loaded["text"] and "7.6" in loaded["text"] and "pinned" in loaded["text"]
    assert "pinned" not in bench.judge(0.7, 7.6, 2, pinned=False)["text"]
