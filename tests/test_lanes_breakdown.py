"""benchmarks/virtual_server.py --lanes: the per-lane breakdown the GPU check prints for a real run
beside the virtual server's prediction, here on a cpu device (its dry run). Slow: two small runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import virtual_server as bench  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_lanes_breakdown_accounts_for_each_step_on_both_sides(tmp_path, capsys):
    torch.set_num_threads(1)
    path = tmp_path / "lanes.json"
    assert bench.main(["--lanes", "cpu:1", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["virtual_spec"] == "virtual:1xrtx4090"
    for side in ("real", "virtual"):
        run = r[side]
        assert run["step_s"] > 0 and run["wall_s"] >= run["step_s"] * 0.99
        assert run["host"] > 0  # the optimizer's and the accumulation's spans on the host lane
        (device,) = run["devices"]
        for lane in ("compute", "h2d_weights", "d2h_grads"):
            assert device[lane] > 0, (side, lane)
        # the compute lane's spans fit inside the step (its idle time is what is left of the step)
        assert device["compute"] + device["compute_idle"] == pytest.approx(run["step_s"], rel=1e-6)
    out = capsys.readouterr().out
    assert "device 0 compute_idle idle s:" in out and "host         busy s:" in out
