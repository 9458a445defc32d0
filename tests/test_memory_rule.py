"""The memory rule is written once (``partition/memory.py``): the partitioner, the plan's report,
the runtime's memory guard and the simulator all call it, and its static stage bound covers what
one task of the stage needs. Torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from roundpipe.partition.cost import model_costs
from roundpipe.partition.memory import memory_vectors, stage_bytes, task_bytes
from roundpipe.presets import load_model_config
from roundpipe.schedule.table import Partition
from roundpipe.sim.workload import LayerWork

ROOT = Path(__file__).resolve().parents[1] / "roundpipe"
# Where a layer's transient bytes may be read: the rule, the cost model that defines them, the
# simulator's copy of a cost into its workload, and the rows ``roundpipe costs`` prints.
READERS = {
    "partition/memory.py",
    "partition/cost.py",
    "sim/workload.py",
    "partition/layer_rows.py",
    "commands/costs.py",
}


def _reads(path: Path, attribute: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(tree))


def test_only_the_memory_rule_turns_layer_bytes_into_a_working_set():
    readers = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if _reads(p, "transient_bytes")}
    assert readers <= READERS, sorted(readers - READERS)
    assert "partition/memory.py" in readers


@pytest.mark.parametrize("model, lora", [("qwen3-0.6b", None), ("qwen3-0.6b", 16), ("qwen3-30b-a3b", 8)])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_stage_bound_covers_its_weights_and_any_task_of_the_stage(model, lora, phase):
    """``stage_bytes`` (what the partitioner checks and the guard enforces) is at least the stage's
    weights plus the working set ``task_bytes`` gives one task of it (what the simulator and its
    engine count), for every stage of every even cut."""
    costs = model_costs(load_model_config(model), 1024, 2, lora_rank=lora, head_shards=2)
    n = len(costs)
    weights = memory_vectors(costs, phase)[0]
    for stages in (1, 2, 3, 5, 8):
        part = Partition.from_sizes([n // stages + (1 if i < n % stages else 0) for i in range(stages)])
        bound = stage_bytes(costs, part, phase)
        for s, (i, j) in enumerate(zip(part.bounds, part.bounds[1:])):
            layers = range(i, j)
            fwd = [k for k in layers if phase == "forward" and costs[k].recompute]
            bwd = [k for k in layers if k not in fwd]
            work, _ = task_bytes(costs, fwd, bwd)
            assert bound[s] >= sum(weights[i:j]) + work, (stages, s)


def test_the_simulators_layers_and_the_cost_models_give_a_task_the_same_bytes():
    costs = model_costs(load_model_config("qwen3-0.6b"), 512, 1, head_shards=1)
    work = [
        LayerWork(
            c.name,
            1.0,
            1.0,
            saved_bytes=c.saved_bytes,
            transient_bytes=c.transient_bytes,
            fwd_work_bytes=c.fwd_work_bytes,
        )  # fmt: skip
        for c in costs
    ]
    for fwd, bwd in [(range(0, 5), ()), ((), range(3, 9)), (range(0, 4), range(4, len(costs)))]:
        assert task_bytes(work, fwd, bwd) == task_bytes(costs, fwd, bwd)
    # The saved activations of the backward layers, and a working set at least the largest part.
    work_b, saved = task_bytes(costs, range(0, 2), range(2, 6))
    assert saved == sum(c.saved_bytes for c in costs[2:6])
    assert work_b >= max(c.fwd_work_bytes for c in costs[0:2])
