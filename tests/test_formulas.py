"""Closed forms of step time, bubble and peak activations (``roundpipe.schedule.formulas``)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from roundpipe.errors import ConfigError
from roundpipe.schedule.formulas import (
    POLICIES,
    bubble_fraction,
    closed_form,
    peak_activations,
    roundpipe_makespan,
)


@pytest.mark.parametrize("devices,microbatches", [(1, 1), (2, 5), (4, 8), (8, 64)])
def test_gpipe_and_1f1b_pay_d_minus_1_stage_times_of_fill_and_drain(devices, microbatches):
    for policy in ("gpipe", "1f1b"):
        cf = closed_form(policy, devices, microbatches, f=1.0, b=2.0)
        assert cf.makespan == 3 * (microbatches + devices - 1)
        assert cf.idle_over_total == pytest.approx((devices - 1) / (microbatches + devices - 1))
        assert cf.idle_over_ideal == pytest.approx((devices - 1) / microbatches)
    assert peak_activations("gpipe", devices, microbatches) == microbatches
    assert peak_activations("1f1b", devices, microbatches) == min(devices, microbatches)


def test_the_two_bubble_conventions_describe_the_same_idle_time():
    for policy in POLICIES:
        m = 8
        x = bubble_fraction(policy, 4, m, convention="total")
        y = bubble_fraction(policy, 4, m, convention="ideal")
        assert y == pytest.approx(x / (1 - x))


def test_interleaving_divides_the_bubble_by_the_stages_per_device():
    one = closed_form("1f1b", 4, 16).idle_over_ideal
    two = closed_form("interleaved", 4, 16, stages=8).idle_over_ideal
    assert two == pytest.approx(one / 2)
    assert peak_activations("interleaved", 4, 16, 8) == 2 * 3 + 4 + 1


def test_zero_bubble_h1_leaves_d_minus_1_forward_times_idle():
    cf = closed_form("zb", 8, 32, f=1.0, b=2.0)
    assert cf.makespan - cf.work == 7.0
    assert closed_form("zb", 4, 2).makespan == 2 * 3 + 3 * 1 + 2 * 1  # two missing microbatches: +2 W


def test_chimera_pays_d_minus_2_bubbles_of_the_longer_pass():
    cf = closed_form("chimera", 8, 64, f=1.0, b=2.0)
    assert cf.makespan == 64 * 3 + 6 * 2 < closed_form("1f1b", 8, 64).makespan == 71 * 3
    assert cf.peak_activations == 9
    # the paper's ratio (D - 2) / (2N + D - 2) when forward and backward take as long
    assert bubble_fraction("chimera", 8, 64, f=1.0, b=1.0) == pytest.approx(6 / (128 + 6))


def test_one_wave_hanayo_reaches_interleaved_step_with_two_chunks_for_any_m():
    assert closed_form("hanayo", 4, 10).makespan == (2 * 10 + 3) * 3  # 4 does not divide 10
    assert closed_form("hanayo", 4, 8).makespan == closed_form("interleaved", 4, 8, stages=8).makespan
    assert peak_activations("hanayo", 4, 8) == 16


def test_roundpipe_matches_interleaved_without_its_divisibility_constraint():
    for devices, v, m in [(4, 1, 8), (4, 2, 8), (8, 2, 12), (3, 3, 5)]:
        s = v * devices
        assert roundpipe_makespan(devices, s, m) == 3 * (v * m + devices - 1)
    # fewer microbatches than devices: the chain of one microbatch through all stages dominates
    assert roundpipe_makespan(8, 8, 2) == 3 * (8 + 2 - 1)
    # 9 stages on 8 devices: device 0 gets three deals and is the bottleneck
    assert roundpipe_makespan(8, 9, 32) == 32 * (1 + 3 + 2)
    assert peak_activations("roundpipe", 8, 64, 100) == 1


def test_roundpipe_takes_different_forward_and_backward_stage_counts():
    assert roundpipe_makespan(4, 4, 8, stages_backward=8) > roundpipe_makespan(4, 4, 8)


@pytest.mark.parametrize(
    "args,match",
    [
        (("pipedream", 4, 8), "no closed form"),
        (("1f1b", 4, 8, 8), "stages must equal devices"),
        (("interleaved", 4, 6, 8), "divisible by devices"),
        (("interleaved", 4, 8, 6), "multiple of 4 stages"),
        (("chimera", 4, 3), "even"),
        (("gpipe", 0, 8), "positive integer"),
    ],
)
def test_shapes_a_policy_cannot_run_are_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        closed_form(*args)
    with pytest.raises(ConfigError, match="convention"):
        bubble_fraction("1f1b", 2, 2, convention="other")


def test_formulas_and_timeline_never_import_torch():
    root = pathlib.Path(__file__).resolve().parents[1] / "roundpipe" / "schedule"
    for name in ("formulas.py", "timeline.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names)
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch")
