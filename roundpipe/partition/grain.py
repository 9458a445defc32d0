"""The stage grain of a streaming policy: how many forward and backward stages, chosen with the
microbatch count, by the RoundPipe paper's objective (section 4.4).

**Model.** A streaming policy (RoundPipe) deals ``S`` stages per step to ``N`` devices round-robin;
each deal runs its stage for all ``M`` microbatches. If every deal took the slowest stage's time
``t_max`` per microbatch, a device would run ``M * S / N`` stage slots and the step would add the
fill and drain of ``N - 1`` slots at each end, so the step time is proportional to::

    (M * S + N * (N - 1)) * t_max

(``S`` rounded up to whole rounds of ``N`` deals for a step that drains; see :func:`objective`.) More stages shorten ``t_max`` (and the fill) but add slots to pad; a stage holds whole layers, so
``t_max`` cannot go below the slowest layer, and a stage's memory (its weights, the prefetched next
stage, a backward stage's gradients and saved activations, an earlier stage's gradients still
downloading) must fit the device.

**Structure.** ``S`` counts deals: the forward stages before the head, the backward stages before
the head, and the *fused head stage*: the last forward and the last backward stage are the same
layers ``[c, n)`` (the head, its vocabulary shards and, when it pays, the last decoder layers),
run forward and backward back to back without recompute on one device (the runtime's fusion rule).
A decoder layer in the fused stage costs its backward-with-recompute time, the head its forward +
backward. ``c`` is chosen as small as ``t_max`` allows ("filled as far as it pays").

**Search (exact for the objective under the search's memory rule).** For each fused start ``c``
the fewest-stage question is answered once per stage count: ``B_f(k)`` and ``B_b(k)``, the optimal
bottleneck of ``k`` forward (backward) stages over ``[0, c)`` under the memory limits
(``optimal_partition``, exact for its sufficient rule, with the fused stage as every stage's
possible neighbour). The objective of ``(k_f, k_b)`` is ``(M * (k_f + k_b + 1) + N * (N - 1)) *
max(B_f(k_f), B_b(k_b), U(c))`` with ``U(c)`` the fused stage's time; every pair is scored and the
best few are returned with their balanced partitions, each checked against the full rule (a
pair none of whose cuts fits gives way to its level's next), for the simulator to judge (it sees
copies, hops and the real fill, which the objective does not). So the first grain is at least as
good as the best the sufficient rule allows and never better than the best that fits
(``tests/test_grain.py``, brute force).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from roundpipe.errors import PlanError
from roundpipe.partition.cost import LayerCost
from roundpipe.partition.memory import memory_vectors, pair_peak_bytes
from roundpipe.partition.partitioner import first_true, optimal_partition
from roundpipe.schedule.table import Partition

MAX_FUSED_LAYERS = 2  # decoder layers the fused head stage may take on (more never paid in practice)


@dataclass(frozen=True)
class GrainChoice:
    """One stage grain: both partitions (the fused head stage last in each) and its score."""

    forward: Partition
    backward: Partition
    t_max: float  # the slowest deal, seconds per microbatch
    deals: int  # forward stages + backward stages - 1 (the fused head stage is one deal)
    objective: float  # (M * deals + N * (N - 1)) * t_max
    fused_start: int  # first layer of the fused head stage

    @property
    def stages(self) -> tuple[int, int]:
        return self.forward.num_stages, self.backward.num_stages


def objective(microbatches: int, num_devices: int, deals: int, t_max: float, steady: bool = False) -> float:
    """The paper's step-time proxy ``(M * S + N * (N - 1)) * t_max``, with ``S`` counted in whole
    rounds of the devices unless ``steady``.

    A deal is indivisible: a device dealt ``ceil(S / N)`` stages runs ``ceil(S / N) * M`` slots,
    and in a step that ends with a drain (the sync optimizer) the others wait for it, so ``S`` is
    rounded up to a multiple of ``N``. The paper's unrounded ``M * S`` spreads the slots evenly,
    which holds in the steady state of overlapping steps (``steady``: the async optimizer, where
    the next step's deal fills the gap). Unrounded, the proxy picked 3 forward + 8 backward stages
    of Qwen3-1.7B (seq 4096) on 8 GPUs: two devices ran two long deals each, 1.6x slower in the
    simulator than the 8 + 16 stages the rounded form prefers.

    With every deal at ``t_max``, ``N | deals`` and ``M >= N`` this is ``N`` times the exact step of
    the table (``schedule.policies.closed_forms.deal_makespan``); the ``N`` does not change the
    ranking. Elsewhere it is the paper's proxy, not the table's step (``tests/test_policy_facts.py``).
    """
    slots = deals if steady else -(-deals // num_devices) * num_devices
    return (microbatches * max(slots, num_devices) + num_devices * (num_devices - 1)) * t_max


def _bottlenecks(times: Sequence[float], vectors, budget, reserve, names, what, outside) -> list[float]:
    """``out[k]``: the optimal bottleneck of ``k`` stages over ``times`` (inf when none fits);
    stops at the stage count where the slowest single layer is reached (more cannot help).
    Cached: head shard counts and microbatch counts with the same layers share the tables."""
    if budget is None:  # memory ignored: the table depends on the times alone
        return list(_free_bottleneck_table(tuple(float(x) for x in times)))
    w, a, p, d = (tuple(int(x) for x in v) for v in vectors)
    return list(_bottleneck_table(tuple(times), w, a, p, d, budget, reserve, tuple(names), what, outside))


@lru_cache(maxsize=256)
def _bottleneck_table(times, w, a, p, d, budget, reserve, names, what, outside) -> tuple[float, ...]:
    n = len(times)
    out = [math.inf] * (n + 1)
    floor = max(times) if times else 0.0
    k = 1
    while k <= n:
        try:
            res = optimal_partition(
                times, k, weight_bytes=w, added_bytes=a, peak_bytes=p, drain_bytes=d, budget=budget,
                reserve_bytes=reserve, names=names, what=what, outside=outside,
            )  # fmt: skip
        except PlanError as err:
            fewest = getattr(err, "min_stages", None)
            if fewest is None or fewest > n:
                break  # a layer alone does not fit: no stage count does
            k = max(k + 1, fewest)  # the fewest stages that fit memory: skip straight there
            continue
        out[k] = res.bottleneck
        if res.bottleneck <= floor * (1 + 1e-12):
            break
        k += 1
    return tuple(out)


@lru_cache(maxsize=256)
def _free_bottleneck_table(times: tuple[float, ...]) -> tuple[float, ...]:
    """``_bottleneck_table`` without memory limits, every stage count in one search.

    The same test as ``optimal_partition``'s (the bottleneck is an interval sum of prefix sums; the
    greedy cut that extends each stage while its prefix-sum difference stays within the bound gives
    the fewest stages), but the sorted interval sums are made once and the optimal bound of ``k + 1``
    stages is searched below that of ``k`` (it never grows), so a 100-layer table takes milliseconds
    instead of one full partition (and its smoothing pass) per stage count.
    """
    n = len(times)
    out = [math.inf] * (n + 1)
    if n == 0:
        return tuple(out)
    pt = [0.0, *accumulate(float(x) for x in times)]
    bounds = sorted({pt[j] - pt[i] for i in range(n) for j in range(i + 1, n + 1)})
    single = max(pt[i + 1] - pt[i] for i in range(n))
    lo = next(k for k, b in enumerate(bounds) if b >= single)
    floor = max(times)

    def fewest(bound: float, limit: int) -> int:
        """Greedy stage count under ``bound``; ``limit + 1`` as soon as it exceeds ``limit``."""
        i = count = 0
        while i < n:
            j = bisect_right(pt, pt[i] + bound, i + 1) - 1
            while j < n and pt[j + 1] - pt[i] <= bound:  # pt[i] + bound rounds either way
                j += 1
            while j > i and pt[j] - pt[i] > bound:
                j -= 1
            count += 1
            if j == i or count > limit:
                return limit + 1
            i = j
        return count

    top = len(bounds) - 1
    for k in range(1, n + 1):
        top = first_true(lo, top, lambda m, k=k: fewest(bounds[m], k) <= k)
        out[k] = bounds[top]
        if bounds[top] <= floor * (1 + 1e-12):
            break
    return tuple(out)


def _partition(times, k, vectors, budget, reserve, n, ascending, outside) -> tuple[int, ...]:
    # Without a budget the bytes play no part in the cut: leave them out, so that microbatch
    # counts (whose activation bytes differ) share the cached cuts.
    w, a, p, d = ((), (), (), ()) if budget is None else (tuple(int(x) for x in v) for v in vectors)
    return _cut(tuple(float(x) for x in times), k, w, a, p, d, budget, reserve, ascending, outside) + (n,)


@lru_cache(maxsize=1024)
def _cut(times, k, w, a, p, d, budget, reserve, ascending, outside) -> tuple[int, ...]:
    res = optimal_partition(
        times, k, weight_bytes=w or None, added_bytes=a or None, peak_bytes=p or None,
        drain_bytes=d or None, budget=budget, reserve_bytes=reserve, ascending=ascending, outside=outside,
    )  # fmt: skip
    return res.partition.bounds  # then the fused head stage [len(times), n)


def grain_choices(
    costs: Sequence[LayerCost],
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    *,
    num_devices: int,
    microbatches: int,
    budget: int | None = None,
    reserve_bytes: int = 0,
    limit: int = 4,
    steady: bool = False,
) -> list[GrainChoice]:
    """The best stage grains by :func:`objective`, one per slowest-deal level, at most ``limit``
    (see the module docstring). Each level comes up to three times where the cuts differ: the
    smoothest, one with lighter early stages (a shorter fill and drain), and one packed to
    ``t_max`` from the head down, checked with each stage's largest *other* stage as its prefetch
    (the exact search counts the largest stage as everyone's, one stage-size conservative).

    ``fwd_times``/``bwd_times`` are ``layer_times``' per-layer forward and backward-stage
    (recompute + backward) seconds. ``budget=None`` ignores memory. Raises :class:`PlanError` when
    no grain fits.
    """
    costs = list(costs)
    n = len(costs)
    if n == 0:
        raise PlanError("nothing to partition: no layers")
    f, b = [float(x) for x in fwd_times], [float(x) for x in bwd_times]
    fused = [b[i] if c.recompute else f[i] + b[i] for i, c in enumerate(costs)]
    head_start = next((i for i, c in enumerate(costs) if not c.recompute), n)
    names = [c.name for c in costs]
    fwd_vec, bwd_vec = memory_vectors(costs, "forward"), memory_vectors(costs, "backward")
    scored: list[tuple[float, int, int, int, float]] = []  # (objective, c, k_f, k_b, t_max)
    for c in range(min(head_start, n - 1), max(-1, head_start - MAX_FUSED_LAYERS - 1), -1):
        u = math.fsum(fused[c:])
        if c == 0:
            scored.append((objective(microbatches, num_devices, 1, u, steady), 0, 0, 0, u))
            continue
        near = _fused_neighbour(bwd_vec, c)
        bf = _bottlenecks(f[:c], [v[:c] for v in fwd_vec], budget, reserve_bytes, names[:c], "forward", near)
        bb = _bottlenecks(b[:c], [v[:c] for v in bwd_vec], budget, reserve_bytes, names[:c], "backward", near)
        # Tables never grow with the stage count, so once a side is no slower than the rest, more
        # stages on it keep t_max and only add deals: dominated on their level, not scored.
        for kf in range(1, c + 1):
            if math.isinf(bf[kf]):
                continue
            for kb in range(1, c + 1):
                if math.isinf(bb[kb]):
                    continue
                t = max(bf[kf], bb[kb], u)
                scored.append((objective(microbatches, num_devices, kf + kb + 1, t, steady), c, kf, kb, t))
                if bb[kb] <= max(bf[kf], u):
                    break
            if bf[kf] <= u:
                break
    # The best pair per slowest-deal level, best levels first: the objective pads every deal to
    # t_max, so grains of other levels are the alternatives worth simulating. Where none of a
    # pair's cuts fits the full rule (the fused stage's own neighbours), the level's next pair is tried.
    scored.sort()
    levels: dict[float, list[tuple]] = {}
    for entry in scored:
        levels.setdefault(round(entry[4], 12), []).append(entry)
    out: list[GrainChoice] = []
    seen: set[tuple] = set()
    for entries in sorted(levels.values()):
        for _obj, c, kf, kb, t in entries:
            found = len(out)
            for variant in ("smooth", "ascending", "packed"):
                if len(out) >= limit:
                    break
                grain = _variant(variant, c, kf, kb, t, costs, f, b, fwd_vec, bwd_vec, budget, reserve_bytes)
                if grain is None or grain in seen:
                    continue
                seen.add(grain)
                fwd, bwd = grain
                deals = fwd.num_stages + bwd.num_stages - 1
                out.append(
                    GrainChoice(fwd, bwd, t, deals, objective(microbatches, num_devices, deals, t, steady), c)
                )
            if len(out) > found or len(out) >= limit:
                break
    if not out:
        raise PlanError(
            f"no stage grain of the {n} layers fits the per-device budget of {budget:,} bytes with the head "
            "in one fused stage; use more head shards, a smaller microbatch, or LoRA"
        )
    # Merging an idle stage can take a deal off a grain of a later level: best objective first.
    out.sort(key=lambda g: g.objective)
    return out


def _fused_neighbour(bwd_vec, c: int) -> tuple[int, int]:
    """The fused stage ``[c, n)``'s weights and gradients: either partition's stages before it may
    hold them as a neighbour's (prefetched, still downloading), as they may another stage's."""
    return sum(bwd_vec[0][c:]), sum(bwd_vec[3][c:])


def _variant(variant, c, kf, kb, t, costs, f, b, fwd_vec, bwd_vec, budget, reserve):
    """The (forward, backward) partitions of one scored pair cut the ``variant`` way, or None where
    they do not fit ``budget`` by the full rule."""
    n = len(costs)
    if c == 0:
        fwd = bwd = Partition((0, n))
    elif variant == "packed":  # stages filled to t_max from the head down, memory checked below
        fwd, bwd = Partition(_packed(f[:c], t) + (n,)), Partition(_packed(b[:c], t) + (n,))
    else:
        fv, bv = [v[:c] for v in fwd_vec], [v[:c] for v in bwd_vec]
        ascending, near = variant == "ascending", _fused_neighbour(bwd_vec, c)
        fwd = Partition(_partition(f[:c], kf, fv, budget, reserve, n, ascending, near))
        bwd = Partition(_partition(b[:c], kb, bv, budget, reserve, n, ascending, near))
    if budget is None:
        return fwd, bwd
    fwd = _merge_idle(fwd, f, lambda p, bwd=bwd: _fits(costs, p, bwd, budget, reserve))
    bwd = _merge_idle(bwd, b, lambda p, fwd=fwd: _fits(costs, fwd, p, budget, reserve))
    return (fwd, bwd) if _fits(costs, fwd, bwd, budget, reserve) else None


def _packed(times: Sequence[float], bound: float) -> tuple[int, ...]:
    """Bounds of the fewest stages of at most ``bound`` each, filled from the last layer down (the
    first stage takes the remainder, and a stage of no time, such as the embedding, joins it)."""
    cuts = [len(times)]
    acc = 0.0
    for i in range(len(times) - 1, -1, -1):
        if acc + times[i] > bound * (1 + 1e-12) and acc > 0:
            cuts.append(i + 1)
            acc = 0.0
        acc += times[i]
    cuts.append(0)
    return tuple(sorted(set(cuts)))


def _merge_idle(part: Partition, times: Sequence[float], fits) -> Partition:
    """Merge a stage that takes no time (an embedding alone) into a neighbour before the fused head
    stage, where ``fits`` allows it: a deal fewer for nothing. The search's memory rule counts the
    largest stage as every stage's prefetch; the final check (each stage with the largest *other*
    stage, ``memory.largest_others``) sometimes has room for it."""
    bounds = list(part.bounds)
    s = 0
    while s < len(bounds) - 3:  # stages before the last (the fused head stage)
        if math.fsum(times[bounds[s] : bounds[s + 1]]) == 0.0:
            merged = Partition(tuple(bounds[: s + 1] + bounds[s + 2 :]))
            if fits(merged):
                bounds = list(merged.bounds)
                continue
        s += 1
    return Partition(tuple(bounds))


def _fits(costs, fwd: Partition, bwd: Partition, budget: int, reserve: int) -> bool:
    """Every stage and the fused head device fit ``budget``."""
    return pair_peak_bytes(costs, fwd, bwd, reserve) <= budget


__all__ = ["MAX_FUSED_LAYERS", "GrainChoice", "grain_choices", "objective"]
