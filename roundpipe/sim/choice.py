"""The runtime's automatic choice: which policy, partitions and microbatch count run a batch,
predicted from the layer times ``Pipeline.profile`` measured.

``RunConfig(policy="auto", partition="auto", num_microbatches="auto")`` (the defaults) ask for it;
``runtime/planning.py`` calls :func:`choose` once per batch shape, after the first batch has been
profiled, and caches the answer. Whatever the config gives (a policy, partitions, a count) pins
that part, and only the rest is chosen.

**Candidates** (the rules are ``sim/search.py``'s, shared with the tuner behind ``roundpipe
plan``). Policies: the one given, else every executable one that takes the configured options and
device count. Microbatch counts: the one given, else ``search.microbatch_candidates`` (the device
count times 1, 2, 4 and 8, and the batch up to 16 per device; uneven splits are fine: the runtime
cuts by sample). Partitions: given; the policy's default (``partition=None``: one layer per stage
for a policy that takes any stage count, even stages for the others); or ``"auto"``:
``search.stage_plans``, the tuner's stage options: a policy with separate forward and backward
partitions takes the objective's best grains (``(M * S + N * (N - 1)) * t_max`` for that count,
``partition/grain.py``, free stage counts, the head fused in the last stage) and the
``search.COUNT_GRAINS`` stage counts, each phase cut on its own; the others each of their registry
grains (interleaved: 2 and 4 stages per device) balanced on the measured times; under the device
memory budget in every case.

**Prediction.** Every candidate's table is simulated (``sim/simulator.py``) on the measured
per-layer times, scaled linearly to its microbatch size, with free copies and a free optimizer
(``SimOptions(transfers=False, optimizer_time=False)``): the runtime measures compute, not its
links. A count above ``2 * devices`` is not simulated: its step is the step at ``2 * devices``
plus, per further microbatch, the busiest device's work per microbatch (the pipeline is in its
steady state by then, so this is exact on even stages and an upper bound otherwise).

**Choice.** Among the *repeatable* candidates (below; all of them when none is), the fastest;
among those within :data:`PREFER_FEWER_WITHIN` of it, the one with the fewest microbatches, then
the policy listed first in the registry, then the fewest stages. Scaling measured times linearly
cannot see the fixed cost every task pays (launches, weight binding, host hand-shakes), which
favours fewer, larger microbatches and fewer stages; a few percent of predicted gain is within
that error. Deterministic: the same times, devices and batch give the same choice.

**Repeatable.** A table whose every backward stage runs on one device sends each stage's weight
gradients to the host once per step, so the host adds them in one order and two runs agree bit
for bit (what checkpoint resumes and the trainer's tests rely on). Where a stage's backward runs
on several devices (chimera's two pipelines, roundpipe's rounds) the host adds the parts in the
order they arrive, and fp32 sums differ in their last bits from run to run: still exact to
round-off, but not repeatable, so an automatic choice takes such a plan only when nothing else
can run. Name the policy to run it anyway.

Pure Python (no torch). Cost: well under a second for a 100-layer model on 8 devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import ConfigError, PlanError, ScheduleError
from roundpipe.partition.cost import LayerCost
from roundpipe.partition.memory import memory_vectors
from roundpipe.presets import load_hardware
from roundpipe.schedule import POLICIES
from roundpipe.schedule.deps import BACKWARD_KINDS
from roundpipe.schedule.table import Partition
from roundpipe.sim.options import SimOptions
from roundpipe.sim.search import (  # the search's rules; re-exported for the runtime's planner
    Candidate,
    default_partition,
    microbatch_candidates,
    runs_here,
    stage_count,
    stage_plans,
)
from roundpipe.sim.simulator import simulate
from roundpipe.sim.workload import LayerWork, Workload

PREFER_FEWER_WITHIN = 0.02  # predictions this close count as a tie (see the module docstring)
SIM_OPTIONS = SimOptions(transfers=False, optimizer_time=False, record_timeline=False, iterations=1)
PREDICTION = "simulated on the measured layer times, copies and the optimizer not modelled"


@dataclass(frozen=True)
class Choice:
    """The chosen candidate, every candidate by predicted step time, and what was left out."""

    best: Candidate
    ranked: tuple[Candidate, ...]
    skipped: tuple[str, ...] = ()  # "policy: reason" for policies that could not run this batch

    @property
    def faster_unrepeatable(self) -> Candidate | None:
        """The fastest candidate left out for not being repeatable, if it beat the choice."""
        c = self.ranked[0]
        return c if not c.repeatable and self.best.repeatable and c.step_s < self.best.step_s else None

    def fastest_other(self, same_policy: bool) -> Candidate | None:
        """The fastest eligible candidate of another policy (``same_policy=False``), or of the same
        policy with another microbatch count (``same_policy=True``)."""
        for c in self.ranked:
            if c.repeatable != self.best.repeatable:
                continue
            if (
                same_policy
                and c.policy == self.best.policy
                and c.num_microbatches != self.best.num_microbatches
            ):
                return c
            if not same_policy and c.policy != self.best.policy:
                return c
        return None


# --------------------------------------------------------------------------------------- the choice


def choose(
    times: Sequence[tuple[float, float]],
    tokens: float,
    costs: Callable[[float], Sequence[LayerCost]],
    *,
    num_devices: int,
    batch: int,
    seq_len: int,
    policies: Sequence[str],
    options: Mapping[str, Any] | None = None,
    partition: str | tuple[Partition, Partition] = "auto",
    microbatches: int | None = None,
    budget: int | None = None,
) -> Choice:
    """The fastest predicted (policy, partitions, microbatch count) for a batch (module docstring).

    Args:
        times: per layer, measured (forward s, backward-alone s) per microbatch of ``tokens`` tokens.
        costs: the layers' bytes for a microbatch of that many tokens (and which layers recompute:
            the head does not); only memory is read from them.
        batch, seq_len: samples and tokens per sample of the batch to run.
        policies: the candidates (one when the config names it), in the registry's order.
        options: the policy options (``round_size`` included) every candidate must take.
        partition: ``"auto"`` (chosen), ``"default"`` (each policy's default), or given partitions.
        microbatches: the given count (None: chosen).
        budget: bytes a stage may need on a device (None: memory is not checked).

    Raises:
        PlanError: no candidate can run (the message lists why, policy by policy).
    """
    options = dict(options or {})
    d = num_devices
    per_token = [(f / tokens, b / tokens) for f, b in times]
    # Which layers recompute (not the head) and which have weights to train: a backward stage
    # with none of the latter and nothing to hand on (a frozen embedding) runs nothing.
    flags = [(c.recompute, c.trainable_params) for c in costs(tokens)]
    hardware = load_hardware(f"{d}xcpu", max_gpus=None)  # only the device count matters without copies
    sims: dict[tuple, tuple[float, float, bool]] = {}
    out: list[Candidate] = []
    skipped: list[str] = []

    def unit_step(policy: str, fwd: Partition, bwd: Partition, m: int) -> tuple[float, float, bool]:
        """(step seconds, busiest device's seconds per microbatch, repeatable) at one token per
        microbatch."""
        key = (policy, fwd.bounds, bwd.bounds, m)
        if key not in sims:
            table = POLICIES[policy](fwd, bwd, d, m, **options)
            layers = tuple(
                LayerWork(f"layer {i}", f, b, recompute=flags[i][0], trainable_params=flags[i][1])
                for i, (f, b) in enumerate(per_token)
            )
            r = simulate(table, Workload(layers), hardware, SIM_OPTIONS)
            sims[key] = (r.iteration_s, max(r.compute_busy_s) / m, _one_device_per_backward_stage(table))
        return sims[key]

    def predict(policy: str, fwd: Partition, bwd: Partition, m: int) -> Candidate:
        spec = POLICIES[policy]
        m_sim = next(k for k in range(2 * d, 4 * d + 2) if spec.accepts_microbatches(k, d))
        if m <= m_sim:
            step, _, repeatable = unit_step(policy, fwd, bwd, m)
        else:
            step_sim, slope, repeatable = unit_step(policy, fwd, bwd, m_sim)
            step = step_sim + (m - m_sim) * slope
        return Candidate(
            policy, m, fwd, bwd, step * batch * seq_len / m, simulated=m <= m_sim, repeatable=repeatable
        )

    for policy in policies:
        spec = POLICIES[policy]
        why = runs_here(policy, d, options)
        counts = [microbatches] if microbatches is not None else microbatch_candidates(policy, d, batch)
        counts = [m for m in counts if m <= batch and spec.accepts_microbatches(m, d)]
        if why is None and not counts:
            why = f"takes no microbatch count of a batch of {batch} (multiples of {spec.microbatch_step(d)})"
        if why is not None:
            skipped.append(f"{policy}: {why}")
            continue
        found = 0
        for m in counts:
            tokens_mb = batch * seq_len / m
            try:
                for fwd, bwd in _partitions(
                    policy, partition, per_token, costs, tokens_mb, d, m, options, budget
                ):
                    out.append(predict(policy, fwd, bwd, m))
                    found += 1
            except (PlanError, ScheduleError, ConfigError) as err:
                skipped.append(f"{policy} with {m} microbatches: {err}")
        if not found and not any(s.startswith(f"{policy} ") for s in skipped):
            skipped.append(f"{policy}: no partition for these stage counts")
    if not out:
        raise PlanError("no policy, partition and microbatch count can run this batch: " + "; ".join(skipped))
    ranked = tuple(sorted(out, key=lambda c: (c.step_s, _tie_key(c))))
    eligible = [c for c in ranked if c.repeatable] or list(ranked)
    fastest = eligible[0].step_s
    near = [c for c in eligible if c.step_s <= fastest * (1 + PREFER_FEWER_WITHIN)]
    return Choice(min(near, key=_tie_key), ranked, tuple(skipped))


def _one_device_per_backward_stage(table) -> bool:
    """Every backward stage's tasks run on one device (the host then adds its gradients once)."""
    where: dict[int, int] = {}
    for d, row in enumerate(table.devices):
        for t in row:
            if t.kind in BACKWARD_KINDS and where.setdefault(t.stage, d) != d:
                return False
    return True


def _tie_key(c: Candidate) -> tuple:
    return (c.num_microbatches, list(POLICIES).index(c.policy), sum(c.stages), c.step_s)


def _partitions(policy, partition, per_token, costs, tokens_mb, d, m, options, budget):
    """The (forward, backward) partitions to predict for ``policy`` at ``m`` microbatches."""
    spec = POLICIES[policy]
    n = len(per_token)
    if isinstance(partition, tuple):
        fwd, bwd = partition
        if fwd != bwd and not spec.separate_partitions:
            raise ConfigError("its forward and backward partitions must be the same")
        if not spec.accepts_stages(fwd.num_stages, d):
            raise ConfigError(f"it does not take {fwd.num_stages} stages on {d} devices")
        return [(fwd, bwd)]
    if partition == "default":
        part = default_partition(policy, d, options, n)
        return [(part, part)]
    layer_costs = list(costs(tokens_mb))
    fwd_t = [f for f, _ in per_token]
    bwd_t = [b + (f if c.recompute else 0.0) for (f, b), c in zip(per_token, layer_costs)]
    pairs, why = stage_plans(
        policy, layer_costs, fwd_t, bwd_t, num_devices=d, microbatches=m, options=options,
        budget=_binding(layer_costs, budget),
    )  # fmt: skip
    if not pairs:
        raise PlanError("; ".join(why))
    return pairs


def _binding(costs: Sequence[LayerCost], budget: int | None) -> int | None:
    """``budget``, or None where no stage of any partition can exceed it (every layer's weights
    twice, every gradient and saved activation, every gradient again as downloading, the largest
    working set): the same partitions, found without the memory search."""
    if budget is None:
        return None
    w, a, p, d = memory_vectors(costs, "backward")
    p_fwd = memory_vectors(costs, "forward")[2]
    return None if 2 * sum(w) + sum(a) + sum(d) + max(p + p_fwd) <= budget else budget


def speedup(faster: Candidate, slower: Candidate | None) -> float:
    """How many times as fast ``faster`` is predicted to be (inf without a rival)."""
    if slower is None:
        return math.inf
    return slower.step_s / faster.step_s if faster.step_s > 0 else 1.0


__all__ = [
    "PREDICTION",
    "PREFER_FEWER_WITHIN",
    "Candidate",
    "Choice",
    "choose",
    "default_partition",
    "microbatch_candidates",
    "runs_here",
    "speedup",
    "stage_count",
]
