"""The longest sequence a server can train a model at, and the limit that stops it there.

Three limits bound a sequence: the positions the model is configured for
(``partition.positions``), every GPU's memory and the host's RAM. :func:`max_seq_len` searches the
length (binary search in steps of ``grain`` tokens) and asks at each length whether *any* plan of
the policy fits, not one default plan: the microbatch counts of ``search.microbatch_candidates``,
smallest microbatches first (they need the least device memory), each with the policy's stage
options (``search.stage_options``, the finest recompute grain among them: one layer per backward
stage, the grain the paper runs its longest sequences at), and, when a
plan's saved inputs overflow the host, rounds of microbatches instead of the whole step
(``search.round_size_for_host``). Each plan is judged by the simulator: device memory by the memory
rule and the simulated peaks, host RAM against ``Server.host_memory_bytes``, both hard limits.

The answer (:class:`SeqLimit`) holds the fastest plan that fits at the longest length and, one step
longer, the limit that binds and by how much: of the plans that could be cut there, the one nearest
to fitting (its larger share of a GPU's memory or of the host's RAM the smallest) names the limit it
overruns more and what it needs of both; when none could be cut, the GPUs, with the memory rule's
bytes for one layer per stage. When
the positions bind, the search goes on past them on memory alone, so the answer also says how long
a sequence the memory would take and what rope scaling that needs.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from roundpipe.errors import RoundpipeError
from roundpipe.partition.cost import model_costs
from roundpipe.partition.memory import device_reserve_bytes, pair_peak_bytes
from roundpipe.partition.positions import position_limit, scaling_needed
from roundpipe.presets import load_model_config
from roundpipe.schedule import PROVISIONAL_POLICY
from roundpipe.schedule.table import Partition
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.scenario import Scenario, check_scenario, cost_args, failed_result, prepare
from roundpipe.sim.search import microbatch_candidates, overflows_host, round_size_for_host, stage_options
from roundpipe.sim.simulator import simulate

SEQ_LEN_GRAIN = 128
MEMORY_SEARCH_UPPER = 1 << 20  # tokens: how far past the positions the memory-only search looks
GPU, HOST, POSITIONS = "GPU memory", "host RAM", "position embeddings"


@dataclass(frozen=True)
class SeqLimit:
    """The longest sequence that fits and why not one ``grain`` longer.

    ``tokens``: the longest length (0: not even ``grain`` tokens); ``result``: the fastest plan
    there and ``plan`` its scenario (its microbatches, stages, round size; None when nothing
    fits); ``binding``: ``GPU``, ``HOST`` or ``POSITIONS``; ``detail``: the
    limit in figures; ``memory_tokens``: when the positions bind, the longest length the GPUs and
    the host would take, else None.
    """

    tokens: int
    result: SimResult | None
    binding: str
    detail: str
    memory_tokens: int | None = None
    plan: Scenario | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.tokens,
            "round_size": self.plan.round_size if self.plan is not None else None,
            "stages": self.plan.stages if self.plan is not None else None,
            "binding_limit": self.binding,
            "binding_detail": self.detail,
            "memory_max_seq_len": self.memory_tokens,
        }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plans_at(base: Scenario, seq_len: int, opts: SimOptions) -> Iterator[tuple[Scenario, SimResult]]:
    """Every plan of ``base``'s policy at ``seq_len`` tokens and its simulation, smallest
    microbatches first (the round-size variant after a plan whose saved inputs overflow the host),
    simulated as they are asked for."""
    hw, _, _ = check_scenario(base)
    n_dev = hw.num_gpus
    counts = microbatch_candidates(base.policy, n_dev, base.global_batch) or [base.global_batch]
    options = stage_options(base.policy, n_dev)
    for m in sorted(counts, reverse=True):
        for stages in options:
            plan: Scenario | None = replace(base, seq_len=seq_len, microbatches=m, stages=stages)
            while plan is not None:
                s = plan
                try:
                    prep = prepare(s)
                    res = simulate(prep.table, prep.workload, prep.hardware, opts, notes=prep.notes)
                except RoundpipeError as err:
                    res = failed_result(s, f"{type(err).__name__}: {err}")
                yield s, res
                short = overflows_host(res, hw.host_memory_bytes)
                rounds = round_size_for_host(s.policy, n_dev, m, s.round_size) if short else None
                plan = replace(s, round_size=rounds) if rounds is not None else None


def _fits(base: Scenario, seq_len: int, opts: SimOptions) -> bool:
    """Whether some plan fits ``seq_len`` tokens (simulating plans only until one does)."""
    return any(r.fits for _, r in plans_at(base, seq_len, opts))


def _fastest(plans: Iterable[tuple[Scenario, SimResult]]) -> tuple[Scenario, SimResult] | None:
    fitting = [(s, r) for s, r in plans if r.fits]
    return max(fitting, key=lambda p: p[1].tokens_per_s) if fitting else None


def _search(
    base: Scenario, lo: int, hi: int, grain: int, opts: SimOptions
) -> tuple[int, tuple[Scenario, SimResult] | None]:
    """The largest ``n`` in ``[lo, hi]`` (in grains) whose length some plan fits, by bisection, and
    the fastest plan there; ``(lo - 1, None)`` when none fits. Bisection takes fitting to be
    monotone in the length: true of each plan shape (a longer sequence never needs less memory),
    and of the search as a whole because the finest grain and the smallest rounds are always among
    the plans tried."""
    top = _fastest(plans_at(base, hi * grain, opts))  # every plan there: as many as a miss costs
    if top is not None:
        return hi, top
    best = None
    first, lo = lo, lo - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(base, mid * grain, opts):
            lo = mid
        else:
            hi = mid
    if lo >= first:
        best = _fastest(plans_at(base, lo * grain, opts))
    return lo, best


def _why_not(base: Scenario, config: Mapping[str, Any], seq_len: int, opts: SimOptions) -> tuple[str, str]:
    """The limit that binds at ``seq_len`` (where no plan fits) and its figures: of the plans that
    could be cut, the one nearest to fitting (its larger share of the GPU's memory or the host's
    RAM the smallest), and which of the two it overruns more; when none could be cut, the GPUs."""
    hw, _, _ = check_scenario(base)
    ran = [(s, r) for s, r in plans_at(base, seq_len, opts) if max(r.peak_gpu_bytes, default=0) > 0]

    def shares(plan: tuple[Scenario, SimResult]) -> tuple[float, float]:
        r = plan[1]
        host = r.peak_host_bytes / hw.host_memory_bytes if hw.host_memory_bytes else 0.0
        return max(r.peak_gpu_bytes) / hw.memory_bytes, host

    if not ran:
        need = finest_plan_bytes(base, config, seq_len)
        return GPU, (
            f"at {seq_len:,} tokens no plan can be cut: one layer per stage with one sequence per "
            f"microbatch needs {_gib(need)} per GPU of {_gib(hw.memory_bytes)}"
        )
    plan, nearest = min(ran, key=lambda p: max(shares(p)))
    gpu, host = shares((plan, nearest))
    rounds = f", rounds of {plan.round_size}" if plan.round_size else ""
    figures = (
        f"at {seq_len:,} tokens the plan nearest to fitting ({nearest.num_microbatches} microbatches"
        f"{rounds}) needs {_gib(max(nearest.peak_gpu_bytes))} per GPU of {_gib(hw.memory_bytes)}"
    )
    if hw.host_memory_bytes:
        figures += f" and {_gib(nearest.peak_host_bytes)} of host RAM of {_gib(hw.host_memory_bytes)}"
    return (HOST if host > gpu else GPU), figures


def finest_plan_bytes(base: Scenario, config: Mapping[str, Any], seq_len: int) -> int:
    """The memory rule's peak for one layer per stage, forward and backward, at the smallest
    microbatch (one sequence): no partition of the model needs less on a device."""
    hw, _, _ = check_scenario(base)
    costs = model_costs(config, seq_len, 1, **cost_args(base))
    singles = Partition(tuple(range(len(costs) + 1)))
    return pair_peak_bytes(costs, singles, singles, device_reserve_bytes(hw))


def max_seq_len(
    model,
    hardware="8xrtx4090",
    *,
    global_batch: int = 64,
    lora_rank: int | None = None,
    dtype: str = "bf16",
    policy: str = PROVISIONAL_POLICY,
    num_devices: int | None = None,
    grain: int = SEQ_LEN_GRAIN,
    label_fraction: float = 1.0,
    fp16_accumulation: bool = False,
    optimizer: str = "sync",
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
    lora_experts: bool = True,
    optimizer_state: str = "fp32",
) -> SeqLimit:
    """The longest sequence (a multiple of ``grain``) that some plan of ``policy`` fits on the
    GPUs and the host, its fastest plan there and the limit that binds (module docstring)."""
    config = dict(model) if isinstance(model, Mapping) else load_model_config(model)
    base = Scenario(
        model, hardware, policy, seq_len=grain, global_batch=global_batch, lora_rank=lora_rank,
        dtype=dtype, num_devices=num_devices, label_fraction=label_fraction,
        fp16_accumulation=fp16_accumulation, optimizer=optimizer, mlp_chunk_tokens=mlp_chunk_tokens,
        quantization=quantization, lora_experts=lora_experts,
        optimizer_state=optimizer_state,
    )  # fmt: skip
    check_scenario(base)
    opts = SimOptions(record_timeline=False, optimizer=optimizer)
    positions = position_limit(config)
    top = (positions if positions is not None else MEMORY_SEARCH_UPPER) // grain
    n, best = _search(base, 1, max(1, top), grain, opts)
    if n == top and positions is not None:
        # On memory alone: the same model with positions as far as the search looks.
        unbounded = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
        unbounded["max_position_embeddings"] = MEMORY_SEARCH_UPPER
        beyond, _ = _search(
            replace(base, model=unbounded), top + 1, MEMORY_SEARCH_UPPER // grain, grain, opts
        )
        memory = max(beyond, top) * grain
        detail = f"{base.model_name} is configured for {positions:,} positions"
        if beyond > top:
            detail += (
                f"; the GPUs and host would take {memory:,} tokens with {scaling_needed(config, memory)}"
            )
        return _answer(n * grain, best, POSITIONS, detail, memory)
    binding, detail = _why_not(base, config, (n + 1) * grain, opts)
    return _answer(n * grain, best, binding, detail)


def _answer(tokens: int, best, binding: str, detail: str, memory: int | None = None) -> SeqLimit:
    plan, result = best if best is not None else (None, None)
    return SeqLimit(tokens, result, binding, detail, memory, plan)


__all__ = [
    "GPU",
    "HOST",
    "POSITIONS",
    "SEQ_LEN_GRAIN",
    "SeqLimit",
    "finest_plan_bytes",
    "max_seq_len",
    "plans_at",
]
