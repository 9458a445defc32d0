"""The plan search's shared rules: what one candidate is, which microbatch counts a policy tries, and
how a policy gets its partitions for a candidate.

Three searches decide a plan: the runtime's automatic choice (``sim/choice.py``, on measured layer
times, compute only), the tuner behind ``roundpipe plan`` (``sim/tune.py``, on the cost model, with
copies, memory and refinement) and a single scenario (``sim/scenario.py``). They differ in how they
*evaluate* a candidate, not in which candidates exist: the counts and the partitions come from here,
so for the same inputs the runtime's candidates are among the tuner's (which adds the levers the
runtime does not have: head shard counts and moved boundaries), and judged the same way both pick
the same plan (``tests/test_search.py``). Where they still part: the runtime predicts every count
from one profiled microbatch shape, scaled linearly, while the tuner's cost model times each
microbatch size on its own (kernels are less efficient on fewer tokens); the runtime also prefers
repeatable plans and, within 2%, fewer microbatches (``sim/choice.py``).

**Microbatch counts** (:func:`microbatch_candidates`): the device count times 1, 2, 4 and 8, and the
batch itself (one sample per microbatch) while that is at most 16 per device, up to the batch and
as far as the policy accepts them (uneven splits are fine: the runtime cuts by sample); where the
policy accepts none of them, the largest multiple of its step that the batch holds. More, smaller
microbatches shrink the fill and drain but not the fixed cost every task pays, which the runtime's
linear scaling of measured times cannot see: beyond 8 per device its predicted gains are within
that error, and every simulated count costs the tuner time.

**Stage options** (:func:`stage_options`): a policy with separate forward and backward partitions
(``roundpipe``) tries its free grain, :data:`COUNT_GRAINS` and the finest recompute grain (one
layer per backward stage); the others their registry grains
(interleaved and hanayo 2 and 4 stages per device, the rest one), or the grain its options set.

**Partitions** (:func:`partitions`, every option at once: :func:`stage_plans`): a free grain is the
:data:`OBJECTIVE_GRAINS` best grains of the RoundPipe objective ``(M * S + N * (N - 1)) * t_max``
for the candidate's microbatch count (``partition/grain.py``: free stage counts, the head fused in
the last stage); given (forward, backward) counts cut each phase on its own
(``partition.model_plan.cut_phases``); a policy with one partition is balanced on forward + backward
time for its stage count (:func:`stage_count`, or the one given). All under a device memory budget
when one is given.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from roundpipe.errors import ConfigError, PlanError
from roundpipe.partition.cost import LayerCost
from roundpipe.partition.grain import grain_choices
from roundpipe.partition.memory import memory_vectors
from roundpipe.partition.model_plan import EVERY_LAYER, cut_phases
from roundpipe.partition.partitioner import optimal_partition
from roundpipe.schedule import POLICIES, policy_options
from roundpipe.schedule.table import Partition
from roundpipe.sim.result import SimResult

MICROBATCHES_PER_DEVICE = (1, 2, 4, 8)
ONE_PER_MICROBATCH_UP_TO = 16  # one sample per microbatch is tried up to this many per device
OBJECTIVE_GRAINS = 3  # grains of the RoundPipe objective tried per microbatch count, best first
COUNT_GRAINS = ((1, 2), (2, 2))  # (forward, backward) stages per device, each phase cut on its own
FINEST_FORWARD_PER_DEVICE = (1, 2, 3)  # forward stages per device beside a layer per backward stage


@dataclass(frozen=True)
class Candidate:
    """One evaluated plan: a policy, its microbatch count and its partitions, with the evaluation.

    ``step_s`` is the predicted (or simulated) seconds of one step of the batch. The tuner's
    candidates carry the simulator's full ``result`` (``None`` for a runtime prediction), their
    ``head_shards`` and ``refined`` (accepted boundary moves); ``forward``/``backward`` are None
    where the plan could not be built (the result says why). ``simulated`` is False when a runtime
    prediction was extrapolated from ``2 * devices`` microbatches; ``repeatable``: every backward
    stage runs on one device (``sim/choice.py``).
    """

    policy: str
    num_microbatches: int
    forward: Partition | None
    backward: Partition | None
    step_s: float
    simulated: bool = True
    repeatable: bool = True
    head_shards: int = 1
    result: SimResult | None = None
    refined: int = 0
    round_size: int | None = None

    @property
    def stages(self) -> tuple[int, int]:
        if self.forward is None or self.backward is None:
            return 0, 0
        return self.forward.num_stages, self.backward.num_stages

    @property
    def bounds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The partitions' bounds (empty where the plan could not be built)."""
        if self.forward is None or self.backward is None:
            return (), ()
        return self.forward.bounds, self.backward.bounds

    @property
    def fits(self) -> bool:
        return self.result.fits if self.result is not None else True

    def summary(self) -> dict:
        """A JSON-ready dict: the simulator's numbers for a tuned candidate, the prediction for a
        runtime one."""
        r = self.result
        if r is None:
            return {
                "policy": self.policy,
                "num_microbatches": self.num_microbatches,
                "stages": list(self.stages),
                "predicted_step_s": self.step_s,
                "simulated": self.simulated,
                "repeatable": self.repeatable,
            }
        fwd, bwd = self.bounds
        return {
            "policy": self.policy,
            "num_microbatches": self.num_microbatches,
            "stages": list(self.stages),
            "head_shards": self.head_shards,
            "tokens_per_s": r.tokens_per_s,
            "iteration_s": r.iteration_s,
            "bubble_fraction": r.bubble_total,
            "peak_gpu_bytes": r.peak_gpu,
            "peak_host_bytes": r.peak_host_bytes,
            "fits": r.fits,
            "reason": r.reason,
            "refined_moves": self.refined,
            "round_size": self.round_size,
            "forward": list(fwd),
            "backward": list(bwd),
        }


# --------------------------------------------------------------------------------------- counts


def microbatch_candidates(policy: str, num_devices: int, batch: int) -> list[int]:
    """Counts worth trying for a batch of ``batch`` samples (module docstring)."""
    spec = POLICIES[policy]
    wanted = {k * num_devices for k in MICROBATCHES_PER_DEVICE}
    if batch <= ONE_PER_MICROBATCH_UP_TO * num_devices:
        wanted.add(batch)
    out = sorted(m for m in wanted if 1 <= m <= batch and spec.accepts_microbatches(m, num_devices))
    if not out:
        step = spec.microbatch_step(num_devices)
        out = [step * (batch // step)] if batch >= step else []
    return out


def overflows_host(result: SimResult, host_memory_bytes: int | None) -> bool:
    """Whether a simulated plan needs more host RAM than the host has (None: not modelled)."""
    return host_memory_bytes is not None and result.peak_host_bytes > host_memory_bytes


def round_size_for_host(
    policy: str, num_devices: int, num_microbatches: int, round_size: int | None
) -> int | None:
    """The next round size to try when a plan's saved inputs do not fit the host's RAM, or None.

    A dealing policy (``round_size`` among its options) that runs the whole step as one round
    keeps every microbatch's stage inputs until its backward; in rounds it keeps two rounds' worth.
    Rounds of two microbatches per device come first, then one (each round adds a fill and a
    drain), as long as the step holds more than one round.
    """
    if "round_size" not in policy_options(policy):
        return None
    for size in (2 * num_devices, num_devices):
        if size < num_microbatches and (round_size is None or size < round_size):
            return size
    return None


def stage_count(policy: str, num_devices: int, options: Mapping[str, Any], num_layers: int) -> int | None:
    """Stages ``policy`` places on the devices by default: None for a policy that takes any count,
    else its default stages per device, or ``stages_per_device`` times the grain option it was given
    (interleaved's ``virtual_stages``: ``v`` per device; hanayo's ``waves``: ``2 x waves``).
    Raises ConfigError when the model has fewer layers than that."""
    spec = POLICIES[policy]
    if spec.stages_per_device is None:
        return None
    grain = options.get(spec.grain_option) if spec.grain_option else None
    stages = (
        num_devices * spec.stages_per_device * grain if grain else cast(int, spec.default_stages(num_devices))
    )
    if stages > num_layers:
        raise ConfigError(
            f"policy {policy!r} on {num_devices} devices needs {stages} stages but the model has only "
            f"{num_layers} layers; use fewer devices or the 'roundpipe' policy"
        )
    return stages


def stage_options(
    policy: str, num_devices: int, count_grains: Sequence[tuple[int, int]] = COUNT_GRAINS
) -> list:
    """Stage counts a search tries: ``None`` is the policy's default (for a free grain, the
    objective's best grains); a free-grain policy adds ``(f * devices, b * devices)`` for each of
    ``count_grains`` and the finest recompute grain, one layer per backward stage
    (``EVERY_LAYER``) beside :data:`FINEST_FORWARD_PER_DEVICE` forward stages per device (what a
    long sequence needs, and the objective's grains seldom reach); the others their registry
    grains."""
    spec = POLICIES[policy]
    if not spec.separate_partitions:
        return spec.stage_options(num_devices)
    return [
        None,
        *((f * num_devices, b * num_devices) for f, b in count_grains),
        *((f * num_devices, EVERY_LAYER) for f in FINEST_FORWARD_PER_DEVICE),
    ]


def default_partition(
    policy: str, num_devices: int, options: Mapping[str, Any], num_layers: int
) -> Partition:
    """One layer per stage for a policy that takes any stage count (roundpipe streams them), else
    as many even stages as the policy places on the devices."""
    stages = stage_count(policy, num_devices, options, num_layers) or num_layers
    n = num_layers
    return Partition.from_sizes([n // stages + (1 if i < n % stages else 0) for i in range(stages)])


def runs_here(policy: str, num_devices: int, options: Mapping[str, Any]) -> str | None:
    """Why ``policy`` cannot run with these options on this many devices (None: it can)."""
    spec = POLICIES[policy]
    unknown = sorted(set(options) - set(policy_options(policy)))
    if unknown:
        return f"takes no option {', '.join(unknown)}"
    if spec.even_devices and num_devices % 2:
        return f"needs an even device count, not {num_devices}"
    return None


# --------------------------------------------------------------------------------------- partitions


def partitions(
    policy: str,
    costs: Sequence[LayerCost],
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    *,
    num_devices: int,
    microbatches: int,
    stages: int | tuple[int, int] | None = None,
    options: Mapping[str, Any] | None = None,
    budget: int | None = None,
    reserve_bytes: int = 0,
    limit: int = 1,
    steady: bool = False,
) -> list[tuple[Partition, Partition]]:
    """The (forward, backward) partitions ``policy`` runs ``microbatches`` microbatches with
    (module docstring), best first.

    ``fwd_times``/``bwd_times``: per layer, forward and backward-stage (recompute + backward)
    seconds, as ``partition.layer_times`` gives them. ``stages``: a policy with one partition cuts
    that many stages (default: :func:`stage_count` with ``options``); a policy with separate
    partitions given ``(forward, backward)`` counts cuts each phase on its own
    (``partition.model_plan.cut_phases``, as ``roundpipe plan`` does for such counts). ``limit``: grains of the
    objective returned for a policy with separate partitions (one partition for the others).
    ``budget=None`` ignores memory; ``steady`` is ``grain_choices``' (an asynchronous optimizer).

    Raises:
        PlanError: no partition fits the budget.
        ConfigError: the model has fewer layers than the policy's stages.
    """
    spec = POLICIES[policy]
    if spec.separate_partitions and stages is not None:
        fwd, bwd = cut_phases(
            list(costs), list(fwd_times), list(bwd_times), stages=stages, num_devices=num_devices,
            budget=_UNBOUNDED if budget is None else budget, reserve=reserve_bytes,
        )  # fmt: skip
        return [(fwd.partition, bwd.partition)]
    if spec.separate_partitions:
        grains = grain_choices(
            costs, fwd_times, bwd_times, num_devices=num_devices, microbatches=microbatches,
            budget=budget, reserve_bytes=reserve_bytes, limit=limit, steady=steady,
        )  # fmt: skip
        return [(g.forward, g.backward) for g in grains]
    if stages is None:
        stages = stage_count(policy, num_devices, options or {}, len(costs))
    vectors = ((), (), (), ()) if budget is None else memory_vectors(costs, "backward")
    both = tuple(f + b for f, b in zip(fwd_times, bwd_times))
    names = tuple(c.name for c in costs)
    part = _balanced(both, stages, *(tuple(v) for v in vectors), budget, reserve_bytes, names)
    return [(part, part)]


_UNBOUNDED = 1 << 62  # a budget no stage reaches: memory is not checked


def stage_plans(
    policy: str,
    costs: Sequence[LayerCost],
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    *,
    num_devices: int,
    microbatches: int,
    options: Mapping[str, Any] | None = None,
    budget: int | None = None,
    reserve_bytes: int = 0,
    steady: bool = False,
) -> tuple[list[tuple[Partition, Partition]], list[str]]:
    """Every (forward, backward) partition pair a search tries for ``policy`` at ``microbatches``:
    :func:`partitions` for each of :func:`stage_options` (the objective's :data:`OBJECTIVE_GRAINS`
    best grains and :data:`COUNT_GRAINS` for a free-grain policy; the registry's grains for the
    others, or the one ``options`` sets), without repeats. Returns the pairs and, per stage option
    that could not be cut, why."""
    spec = POLICIES[policy]
    pinned = spec.grain_option is not None and (options or {}).get(spec.grain_option) is not None
    choices = [None] if pinned else stage_options(policy, num_devices)
    found: list[tuple[Partition, Partition]] = []
    why: list[str] = []
    for stages in choices:
        try:
            pairs = partitions(
                policy, costs, fwd_times, bwd_times, num_devices=num_devices, microbatches=microbatches,
                stages=stages, options=options, budget=budget, reserve_bytes=reserve_bytes,
                limit=OBJECTIVE_GRAINS, steady=steady,
            )  # fmt: skip
        except (PlanError, ConfigError) as err:
            why.append(f"{stages or 'default'} stages: {err}")
            continue
        found += [pair for pair in pairs if pair not in found]
    return found, why


@lru_cache(maxsize=256)
def _balanced(times, stages, w, a, p, d, budget, reserve, names) -> Partition:
    """One partition for forward and backward (weight-bound policies), balancing both times."""
    return optimal_partition(
        times, stages, weight_bytes=w or None, added_bytes=a or None, peak_bytes=p or None,
        drain_bytes=d or None, budget=budget, reserve_bytes=reserve, names=names,
        what="forward+backward",
    ).partition  # fmt: skip


__all__ = [
    "Candidate",
    "default_partition",
    "microbatch_candidates",
    "overflows_host",
    "partitions",
    "runs_here",
    "stage_count",
    "stage_options",
    "stage_plans",
]
