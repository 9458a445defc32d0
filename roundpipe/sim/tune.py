"""The tuner: which policy, partition, microbatch count and stage grain to run, decided by simulation.

Search (everything under the memory limits the simulator checks):

1. **Grid.** For each policy, the microbatch counts of ``search.microbatch_candidates`` (``D``,
   ``2D``, ``4D``, ``8D`` and one sequence per microbatch up to ``16D``, as far as the policy
   accepts them: the runtime's automatic choice tries the same); they need not divide the batch
   (uneven microbatches, cut as the runtime cuts them). Stage
   grains: a policy with a free grain (``roundpipe``) tries the best grains of the paper's objective
   for that microbatch count (``partition.grain``: one per slowest-deal level, the head fused in the
   last stage) and ``(kD, k'D)`` stage counts with the head shards spread like any layer; the
   others try their registry grains (interleaved and hanayo 2 and 4 stages per device, the rest one).
   A finer backward grain is a finer recompute grain: each backward stage recomputes from its own
   saved input. Each candidate starts from balanced partitions (the partitioner's) and is simulated
   once. Around each policy's best, half and twice as many LM-head vocabulary shards are tried too.
2. **Bubble-aware refinement.** For the two best candidates of each of the two best policies, the simulated timeline shows where devices
   wait: a task that waits for its input blames the stage that produced it. The most-blamed stage
   gives one layer to its lighter neighbour (when no stage is much to blame, the stage of the
   longest task, e.g. RoundPipe's fused head, does); the move is kept if the simulated step gets faster
   (and still fits), and the loop repeats while it improves (a bounded number of rounds).
3. **Rank.** Fitting candidates first, by tokens/s; the rest after, with their reasons.

The longest sequence that fits is ``sim.seq_limit``'s search, over the same microbatch counts and
stage options.
Pure Python.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, cast

from roundpipe.errors import ConfigError, PlanError, RoundpipeError, ScheduleError
from roundpipe.partition.cost import layer_times, model_costs
from roundpipe.partition.memory import device_reserve_bytes
from roundpipe.partition.positions import check_positions
from roundpipe.presets import load_model_config
from roundpipe.schedule import POLICIES, PROVISIONAL_POLICY, TaskKind, build_table
from roundpipe.schedule.table import Partition, ScheduleTable
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.scenario import Prepared, Scenario, check_scenario, cost_args, failed_result, prepare
from roundpipe.sim.search import (
    OBJECTIVE_GRAINS,
    Candidate,
    microbatch_candidates,
    overflows_host,
    partitions,
    round_size_for_host,
    stage_options,
)
from roundpipe.sim.simulator import simulate

DEFAULT_TIME_BUDGET_S = 15.0
REFINE_ROUNDS = 8
REFINE_TOP = 2  # policies whose best candidates are refined
REFINE_PER_POLICY = 2  # candidates refined per such policy


@dataclass(frozen=True)
class TuneResult:
    """The best candidate and every candidate ranked (fitting first, by tokens/s)."""

    best: Candidate
    ranked: tuple[Candidate, ...]
    elapsed_s: float
    notes: tuple[str, ...] = ()


def _rank_key(c: Candidate) -> tuple:
    return (not c.fits, -cast(SimResult, c.result).tokens_per_s, c.policy, c.num_microbatches)


GRAIN_ALTERNATIVES = OBJECTIVE_GRAINS - 1  # grains of the objective simulated besides its best
GRID_SHARE = 0.6  # of the time budget; the rest refines


def grain_alternatives(
    prep: Prepared, limit: int = GRAIN_ALTERNATIVES
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Partitions of the objective's next-best grains for ``prep``'s model and microbatch shape (the
    best one is ``prep``'s own when it was planned with a free grain)."""
    s, hw = prep.scenario, prep.hardware
    config = dict(s.model) if isinstance(s.model, Mapping) else load_model_config(s.model)
    costs = model_costs(
        config, s.seq_len, prep.micro_batch_size, **cost_args(s), head_shards=prep.head_shards
    )
    f, b = layer_times(costs, hw, efficiency=s.efficiency, times=s.times)
    try:
        choices = partitions(
            s.policy, costs, f, b, num_devices=hw.num_gpus, microbatches=prep.table.num_microbatches,
            budget=hw.memory_bytes, reserve_bytes=device_reserve_bytes(hw), limit=limit + 1,
            steady=s.optimizer == "async",
        )  # fmt: skip
    except PlanError:
        return []
    own = (prep.table.forward, prep.table.backward)
    return [(fwd.bounds, bwd.bounds) for fwd, bwd in choices if (fwd, bwd) != own][:limit]


def _candidate(prep: Prepared | None, s: Scenario, result: SimResult, refined: int = 0) -> Candidate:
    if prep is None:
        return Candidate(
            s.policy, result.num_microbatches, None, None, result.iteration_s, result=result,
            refined=refined, round_size=s.round_size,
        )  # fmt: skip
    t = prep.table
    return Candidate(
        s.policy, t.num_microbatches, t.forward, t.backward, result.iteration_s,
        head_shards=prep.head_shards, result=result, refined=refined, round_size=s.round_size,
    )  # fmt: skip


def _evaluate(s: Scenario, opts: SimOptions) -> tuple[Prepared | None, SimResult]:
    try:
        prep = prepare(s)
    except (PlanError, ScheduleError) as err:
        return None, failed_result(s, str(err))
    return prep, simulate(prep.table, prep.workload, prep.hardware, opts, notes=prep.notes)


# --------------------------------------------------------------------------------------- refinement


def stage_blame(result: SimResult, table: ScheduleTable) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds devices waited, blamed on the forward / backward stage whose output they waited for.

    A compute span that starts after the previous one on its device ended waited that long; if the
    task is ``F(s, j)`` the wait is blamed on forward stage ``s - 1``, if ``B(s, j)`` on backward stage
    ``s + 1`` (the fused head's wait on the forward stage before it).
    """
    fwd_blame: dict[int, float] = defaultdict(float)
    bwd_blame: dict[int, float] = defaultdict(float)
    tl = result.timeline
    if tl is None:
        return fwd_blame, bwd_blame
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    by_dev: dict[int, list] = defaultdict(list)
    for sp in tl.spans:
        if sp.lane == "compute":
            by_dev[sp.device].append(sp)
    for spans in by_dev.values():
        spans.sort(key=lambda sp: sp.start)
        prev_end = 0.0
        for sp in spans:
            wait = sp.start - prev_end
            prev_end = sp.end
            if wait <= 0:
                continue
            head = sp.name.split("+")[0]
            kind, rest = head[0], head[1:]
            stage = int(rest.split(".")[0])
            if kind == TaskKind.F and stage > 0:
                fwd_blame[stage - 1] += wait
            elif kind in (TaskKind.B, TaskKind.I) and stage < last_b:
                bwd_blame[stage + 1] += wait
            elif kind in (TaskKind.B, TaskKind.I) and stage == last_b and last_f > 0:
                fwd_blame[last_f - 1] += wait
    return fwd_blame, bwd_blame


def heavy_stages(result: SimResult, table: ScheduleTable) -> list[tuple[str, int]]:
    """Stages of the longest tasks, longest first: a fused head task names both its stages.

    Blame finds who keeps a device waiting; when the waiting is spread thin (every device idles a
    little behind one slow deal, as behind RoundPipe's fused head) the slow deal itself is the
    stage to shrink.
    """
    tl = result.timeline
    if tl is None:
        return []
    longest: dict[tuple[str, int], float] = {}
    for sp in tl.spans:
        if sp.lane != "compute":
            continue
        for part in sp.name.split("+"):
            key = (TaskKind.F if part[0] == TaskKind.F else TaskKind.B, int(part[1:].split(".")[0]))
            longest[key] = max(longest.get(key, 0.0), sp.duration)
    return sorted(longest, key=longest.__getitem__, reverse=True)[:2]


def _unique(tries: list[tuple[float, str, int]]) -> list[tuple[float, str, int]]:
    seen, out = set(), []
    for t in tries:
        if (t[1], t[2]) not in seen:
            seen.add((t[1], t[2]))
            out.append(t)
    return out


def _move(bounds: tuple[int, ...], stage: int, times: Sequence[float]) -> list[tuple[int, ...]]:
    """Partitions where ``stage`` gives one layer to a neighbour, lighter neighbour first."""
    b = list(bounds)
    n_st = len(b) - 1
    if b[stage + 1] - b[stage] < 2:
        return []

    def stage_time(k: int) -> float:
        return sum(times[b[k] : b[k + 1]])

    options = []
    if stage > 0:
        options.append((stage_time(stage - 1), "left"))
    if stage < n_st - 1:
        options.append((stage_time(stage + 1), "right"))
    out = []
    for _, side in sorted(options):
        nb = list(b)
        if side == "left":
            nb[stage] += 1
        else:
            nb[stage + 1] -= 1
        out.append(tuple(nb))
    return out


def _moved(table: ScheduleTable, which: str, new: Partition, same: bool, options: dict, accept):
    """``table`` rebuilt with its forward (``which`` ``TaskKind.F``) or backward partition replaced by
    ``new`` (both when they are one partition), or None if the policy refuses it or ``accept`` vetoes it."""
    fwd, bwd = (
        (new, new) if same else ((new, table.backward) if which == TaskKind.F else (table.forward, new))
    )
    try:
        cand = build_table(table.policy, fwd, bwd, table.num_devices, table.num_microbatches, **options)
    except ScheduleError:
        return None
    return None if accept is not None and not accept(cand) else cand


def refine(
    prep: Prepared,
    result: SimResult,
    opts: SimOptions,
    deadline: float,
    rounds: int = REFINE_ROUNDS,
    accept: Callable[[ScheduleTable], bool] | None = None,
):
    """Move stage boundaries away from the bubbles while the simulated step improves.

    ``accept`` vetoes a moved table before it is simulated (e.g. a memory rule the workload does
    not carry). Returns ``(table, result, accepted_moves)``.
    """
    table, best = prep.table, result
    work = prep.workload
    f_times = [lw.fwd_s for lw in work.layers]
    b_times = [lw.fwd_s + lw.bwd_s for lw in work.layers]
    same = table.forward == table.backward
    options = {k: v for k, v in table.options.items() if k != "weight_bound"}
    accepted = 0
    timed = replace(opts, record_timeline=True)
    if best.timeline is None:
        best = simulate(table, work, prep.hardware, timed, notes=best.notes)
    for _ in range(rounds):
        if time.monotonic() > deadline:
            break
        fb, bb = stage_blame(best, table)
        tries: list[tuple[float, str, int]] = [(w, TaskKind.F, s) for s, w in fb.items()]
        tries += [(w, TaskKind.B, s) for s, w in bb.items()]
        tries.sort(reverse=True)
        tries = tries[:3] + [(0.0, which, stage) for which, stage in heavy_stages(best, table)]
        improved = False
        for _, which, stage in _unique(tries):
            part = table.forward if which == TaskKind.F else table.backward
            times = (
                [x + y for x, y in zip(f_times, b_times)]
                if same
                else (f_times if which == TaskKind.F else b_times)
            )
            for bounds in _move(part.bounds, stage, times):
                cand_table = _moved(table, which, Partition(bounds), same, options, accept)
                if cand_table is None:
                    continue
                res = simulate(cand_table, work, prep.hardware, timed, notes=best.notes)
                if res.fits and res.iteration_s < best.iteration_s * (1 - 1e-6):
                    table, best, improved = cand_table, res, True
                    accepted += 1
                    break
                if time.monotonic() > deadline:
                    break
            if improved or time.monotonic() > deadline:
                break
        if not improved:
            break
    return table, best, accepted


def polish(
    prep: Prepared,
    result: SimResult,
    opts: SimOptions,
    deadline: float,
    accept: Callable[[ScheduleTable], bool] | None = None,
    passes: int = 4,
):
    """Hill-climb every stage boundary: move each by one layer either way, keep a move when the
    simulated step gets faster (and ``accept`` allows the table), repeat while a pass improves.

    :func:`refine` only moves the stages the timeline blames; the step's fill and drain also depend
    on where the lighter stages sit, which only trying shows. Forward boundaries first (fewer, and
    they set the fill). Returns ``(table, result, accepted_moves)``.
    """
    table, best = prep.table, result
    work, hw = prep.workload, prep.hardware
    options = {k: v for k, v in table.options.items() if k != "weight_bound"}
    untimed = replace(opts, record_timeline=False)
    same = table.forward == table.backward
    moves = 0
    for _ in range(passes):
        improved = False
        for which in (TaskKind.F,) if same else (TaskKind.F, TaskKind.B):
            stage = 1
            while stage < (table.forward if which == TaskKind.F else table.backward).num_stages:
                part = table.forward if which == TaskKind.F else table.backward
                for delta in (-1, 1):
                    if time.monotonic() > deadline:
                        return table, best, moves
                    b = list(part.bounds)
                    b[stage] += delta
                    if not b[stage - 1] < b[stage] < b[stage + 1]:
                        continue
                    cand = _moved(table, which, Partition(tuple(b)), same, options, accept)
                    if cand is None:
                        continue
                    res = simulate(cand, work, hw, untimed, notes=best.notes)
                    if res.fits and res.iteration_s < best.iteration_s * (1 - 1e-6):
                        table, best, improved = cand, res, True
                        moves += 1
                        break
                stage += 1
        if not improved:
            break
    return table, best, moves


# --------------------------------------------------------------------------------------- search


def tune(
    model,
    hardware="8xrtx4090",
    *,
    seq_len: int,
    global_batch: int = 64,
    lora_rank: int | None = None,
    dtype: str = "bf16",
    optimizer: str = "sync",
    num_devices: int | None = None,
    policies: Sequence[str] | None = None,
    options: SimOptions | None = None,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    refine_top: int = REFINE_TOP,
    label_fraction: float = 1.0,
    fp16_accumulation: bool = False,
    head_shards: int | Literal["auto"] = "auto",
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
    lora_experts: bool = True,
    optimizer_state: str = "fp32",
) -> TuneResult:
    """Search policy x partition x microbatches x stage grain (head shards with the partition) and
    return the best plan and a ranked table of alternatives (see the module docstring).

    ``head_shards``: ``"auto"`` searches the LM head's vocabulary shards too; an int keeps the count
    a wrapped model already has (``RunConfig.head_shards``), as the runtime's choice does.

    Raises :class:`ConfigError` on bad settings (unknown model, hardware or policy, seq len < 1, more
    devices than the server holds); configurations that do not fit are ranked last, not raised.
    """
    t0 = time.monotonic()
    deadline = t0 + time_budget_s
    base = Scenario(
        model, hardware, PROVISIONAL_POLICY, seq_len=seq_len, global_batch=global_batch, lora_rank=lora_rank,
        dtype=dtype, optimizer=optimizer, num_devices=num_devices, label_fraction=label_fraction,
        fp16_accumulation=fp16_accumulation, head_shards=head_shards, mlp_chunk_tokens=mlp_chunk_tokens,
        quantization=quantization, lora_experts=lora_experts,
        optimizer_state=optimizer_state,
    )  # fmt: skip
    hw, _, _ = check_scenario(base)
    config = dict(model) if isinstance(model, Mapping) else load_model_config(model)
    check_positions(config, seq_len, base.model_name)  # one error before the search, not one per plan
    n_dev = hw.num_gpus
    names = list(policies) if policies else list(POLICIES)
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policies {unknown}; known policies: {', '.join(POLICIES)}")
    opts = replace(options or SimOptions(), optimizer=optimizer, record_timeline=False)
    notes: list[str] = []
    found: list[tuple[Candidate, Prepared | None]] = []
    seen: set[tuple] = set()

    def consider(s: Scenario) -> Prepared | None:
        try:
            prep, res = _evaluate(s, opts)
        except RoundpipeError as err:
            prep, res = None, failed_result(s, f"{type(err).__name__}: {err}")
        cand = _candidate(prep, s, res)
        key = (s.policy, cand.num_microbatches, cand.forward, cand.backward, cand.head_shards, s.round_size)
        if key not in seen:
            seen.add(key)
            found.append((cand, prep))
        rounds = round_size_for_host(s.policy, n_dev, cand.num_microbatches, s.round_size)
        if prep is not None and overflows_host(res, hw.host_memory_bytes) and rounds is not None:
            consider(replace(s, round_size=rounds))  # saved inputs of two rounds instead of the step
        return prep

    # Most promising first, so a cut grid still holds every policy: default grains before the
    # others, microbatch counts nearest 4 per device first.
    grid = [
        (stages is not None, abs(math.log(m / (4 * n_dev))), i, policy, m, stages)
        for i, policy in enumerate(names)
        for m in microbatch_candidates(policy, n_dev, global_batch) or [global_batch]  # the table says why
        for stages in stage_options(policy, n_dev)
    ]
    grid.sort(key=lambda g: g[:3])
    grid_deadline = t0 + GRID_SHARE * time_budget_s
    for _, _, _, policy, m, stages in grid:
        if time.monotonic() > grid_deadline and found:
            notes.append(f"time budget of {time_budget_s:.0f} s reached; the grid was cut short")
            break
        s = replace(base, policy=policy, microbatches=m, stages=stages)
        prep = consider(s)
        if stages is None and prep is not None and POLICIES[policy].separate_partitions:
            for bounds in grain_alternatives(prep):
                consider(replace(s, partitions=bounds, head_shards=prep.head_shards))
    found.sort(key=lambda cp: _rank_key(cp[0]))
    # Head shards: around each policy's best, half and twice as many vocabulary shards.
    for policy in names if head_shards == "auto" else ():
        top = next((c for c, p in found if c.policy == policy and c.fits and p is not None), None)
        if top is None or time.monotonic() > deadline:
            continue
        stages = top.stages if POLICIES[policy].separate_partitions else top.stages[0]
        for k in sorted({max(1, top.head_shards // 2), top.head_shards * 2} - {top.head_shards}):
            s = replace(base, policy=policy, microbatches=top.num_microbatches, stages=stages, head_shards=k)
            try:
                prep, res = _evaluate(s, opts)
            except RoundpipeError:
                continue
            cand = _candidate(prep, s, res)
            key = (policy, cand.num_microbatches, cand.forward, cand.backward, cand.head_shards)
            if key not in seen:
                seen.add(key)
                found.append((cand, prep))
    found.sort(key=lambda cp: _rank_key(cp[0]))
    # Refine the best few distinct policies.
    refined: dict[int, Candidate] = {}
    per_policy: dict[str, int] = defaultdict(int)
    shapes_refined: set[tuple] = set()
    for idx, (cand, prep) in enumerate(found):
        if time.monotonic() > deadline:
            notes.append("time budget reached during refinement")
            break
        if not cand.fits or prep is None or per_policy.get(cand.policy, 0) >= REFINE_PER_POLICY:
            continue
        if cand.policy not in per_policy and len(per_policy) >= refine_top:
            continue
        shape = (cand.policy, cand.num_microbatches, cand.stages)
        if shape in shapes_refined:
            continue  # the same shape with another head shard count: refine one of them
        shapes_refined.add(shape)
        per_policy[cand.policy] += 1
        table, res, moves = refine(prep, cast(SimResult, cand.result), opts, deadline)
        if moves:
            refined[idx] = replace(
                cand,
                forward=table.forward,
                backward=table.backward,
                step_s=res.iteration_s,
                result=res,
                refined=moves,
            )
    ranked = [refined.get(i, c) for i, (c, _) in enumerate(found)]
    ranked.sort(key=_rank_key)
    if not ranked:
        raise PlanError("no configuration could be evaluated")
    if not ranked[0].fits:
        notes.append("nothing fits: " + cast(SimResult, ranked[0].result).reason)
    return TuneResult(ranked[0], tuple(ranked), time.monotonic() - t0, tuple(notes))


def format_ranked(result: TuneResult, limit: int = 15) -> str:
    """The ranked candidates as a readable table."""
    rows = [
        f"{'#':>2} {'policy':<12} {'mb':>4} {'stages F/B':>10} {'shards':>6} {'tokens/s':>10} {'step s':>8} "
        f"{'bubble':>7} {'GPU GiB':>8} {'host GiB':>8}  fits"
    ]
    for i, c in enumerate(result.ranked[:limit], 1):
        r = cast(SimResult, c.result)
        step = f"{r.iteration_s:8.2f}" if math.isfinite(r.iteration_s) else f"{'-':>8}"
        bubble = f"{r.bubble_total:7.1%}" if math.isfinite(r.bubble_total) else f"{'-':>7}"
        rows.append(
            f"{i:>2} {c.policy:<12} {c.num_microbatches:>4} {c.stages[0]:>4}/{c.stages[1]:<5} {c.head_shards:>6} "
            f"{r.tokens_per_s:>10.0f} {step} {bubble} {r.peak_gpu / 2**30:>8.2f} {r.peak_host_bytes / 2**30:>8.1f}  "
            + ("yes" if r.fits else "no: " + r.reason[:90])
            + (f" (+{c.refined} moves)" if c.refined else "")
        )
    return "\n".join(rows)


__all__ = [
    "Candidate",
    "TuneResult",
    "format_ranked",
    "refine",
    "stage_blame",
    "tune",
]
