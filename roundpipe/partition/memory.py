"""The memory rule: what a stage, a device and one task need on a device, from the layers' costs.

Written once and called by everyone who asks: the partitioner's search (:func:`memory_vectors`,
per-layer terms it sums over candidate stages), the plan's report and the runtime's memory guard
(:func:`stage_bytes`, :func:`last_stage_bytes`, :func:`pair_peak_bytes`), and the simulator's
engine and residency check (:func:`task_bytes`).

A stage on a device holds (``partitioner.py``'s docstring gives the why of each term)::

    weights(stage) + prefetch + draining + added(stage) + max(peak over the stage's layers) + reserve

One task (:func:`task_bytes`) works in the larger of its forward layers' working set (no autograd)
and its backward layers' saved activations plus one layer's transient. :func:`stage_bytes` takes,
for a forward stage with layers that do not recompute (the head), their saved activations *plus* the
largest peak of any layer (a bound, as the search needs sums over layers), where a task of that
stage peaks at the larger of the two: the static rule bounds the task's (``tests/test_memory_rule.py``).

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import LayerCost
from roundpipe.schedule.table import Partition


class LayerBytes(Protocol):
    """What :func:`task_bytes` reads of a layer (``partition.cost.LayerCost`` and the simulator's
    ``LayerWork`` both have it)."""

    @property
    def saved_bytes(self) -> int: ...
    @property
    def transient_bytes(self) -> int: ...
    @property
    def fwd_work_bytes(self) -> int: ...


def task_bytes(
    layers: Sequence[LayerBytes], fwd_layers: Sequence[int], bwd_layers: Sequence[int]
) -> tuple[int, int]:
    """``(working set, saved)`` of one task that runs ``fwd_layers`` forward without autograd and
    ``bwd_layers`` forward with autograd and backward: the larger of the forward layers' working
    set and the saved activations plus one backward layer's transient; and the saved activations
    (what an input-gradient task leaves on the device for its weight-gradient task)."""
    fwd = max((layers[i].fwd_work_bytes for i in fwd_layers), default=0)
    saved = sum(layers[i].saved_bytes for i in bwd_layers)
    bwd = saved + max((layers[i].transient_bytes for i in bwd_layers), default=0)
    return max(fwd, bwd), saved


def memory_vectors(
    costs: Sequence[LayerCost], phase: str
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per-layer ``(weight_bytes, added_bytes, peak_bytes, drain_bytes)`` for the forward or
    backward partition.

    Forward stages run without autograd (only the stage input is kept, on the CPU): a layer adds
    nothing and peaks at its ``fwd_work_bytes``; the head is the exception, its forward runs with
    its backward, so it counts as in backward. Backward stages keep every layer's gradients and
    saved activations (``added``) and one layer's transient at a time (``peak``), and leave their
    gradients downloading while the device's next backward stage runs (``drain``).
    """
    if phase not in ("forward", "backward"):
        raise ConfigError(f"phase must be 'forward' or 'backward', got {phase!r}")
    weights = [c.param_bytes for c in costs]
    added, peak, drain = [], [], []
    for c in costs:
        if phase == "backward" or not c.recompute:
            added.append(c.grad_device_bytes + c.saved_bytes)
            peak.append(c.transient_bytes)
            drain.append(c.grad_device_bytes)
        else:
            added.append(0)
            peak.append(c.fwd_work_bytes)
            drain.append(0)
    return weights, added, peak, drain


def stage_bytes(
    costs: Sequence[LayerCost], partition: Partition, phase: str, reserve_bytes: int = 0
) -> list[int]:
    """Peak device bytes of every stage by the memory rule of this module (its prefetch and its
    draining gradients: the largest other stage's, :func:`largest_others`)."""
    w, a, p, d = memory_vectors(costs, phase)
    spans = [(partition.bounds[s], partition.bounds[s + 1]) for s in range(partition.num_stages)]
    nxt = largest_others([sum(w[i:j]) for i, j in spans])
    down = largest_others([sum(d[i:j]) for i, j in spans])
    return [
        sum(w[i:j]) + nxt[s] + down[s] + sum(a[i:j]) + max(p[i:j]) + reserve_bytes
        for s, (i, j) in enumerate(spans)
    ]


def pair_peak_bytes(
    costs: Sequence[LayerCost], forward: Partition, backward: Partition, reserve_bytes: int = 0
) -> int:
    """The fullest device of a forward and backward partition pair by this module's rule: every
    stage (:func:`stage_bytes`) and the device running the last stages of both (:func:`last_stage_bytes`)."""
    stages = stage_bytes(costs, forward, "forward", reserve_bytes) + stage_bytes(
        costs, backward, "backward", reserve_bytes
    )
    return max(*stages, last_stage_bytes(costs, forward, backward, reserve_bytes))


def largest_others(stage_values: Sequence[int]) -> list[int]:
    """Per stage, the largest *other* stage's value: given stage weights, what its device may hold
    prefetched; given stage gradients, what may still be downloading from the device's previous
    stage.

    The next stage a device runs is another stage (or the same one again, whose weights are
    already there), so the largest other stage bounds it for every policy; so for the previous
    one. The search itself uses the largest stage for all (a stage that is the largest counted
    twice): a sufficient check, so every partition it returns also fits this one.
    """
    if len(stage_values) < 2:
        return [0] * len(stage_values)
    order = sorted(range(len(stage_values)), key=stage_values.__getitem__, reverse=True)
    first, second = stage_values[order[0]], stage_values[order[1]]
    return [second if s == order[0] else first for s in range(len(stage_values))]


def last_stage_bytes(
    costs: Sequence[LayerCost], forward: Partition, backward: Partition, reserve_bytes: int = 0
) -> int:
    """Peak bytes of the device that runs the last forward and last backward stage interleaved.

    RoundPipe runs ``F.j B.j`` of the two last stages (both end with the head) back to back on one
    device, so it holds the weights of their union; while they run it prefetches a backward stage
    (bounded by the largest backward stage) and may still be downloading the gradients of another
    backward stage it ran before (under a policy that runs one first; the largest other backward
    stage's). Gradients and saved activations are those of the last backward stage; the working
    set is the larger of the two stages'.
    """
    n = len(costs)
    fa, ba = forward.bounds[-2], backward.bounds[-2]
    w_f, _, p_f, _ = memory_vectors(costs, "forward")
    w_b, a_b, p_b, d_b = memory_vectors(costs, "backward")
    spans = list(zip(backward.bounds, backward.bounds[1:]))
    prefetch = max(sum(w_b[i:j]) for i, j in spans)
    draining = max((sum(d_b[i:j]) for i, j in spans[:-1]), default=0)
    union = range(min(fa, ba), n)
    peak = max([p_b[i] for i in range(ba, n)] + [p_f[i] for i in range(fa, ba)])
    return sum(w_b[i] for i in union) + prefetch + draining + sum(a_b[ba:n]) + peak + reserve_bytes


__all__ = [
    "LayerBytes",
    "last_stage_bytes",
    "largest_others",
    "memory_vectors",
    "pair_peak_bytes",
    "stage_bytes",
    "task_bytes",
]
