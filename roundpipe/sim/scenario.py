"""From a question ("Qwen3-8B, 8x RTX 4090, 1F1B, seq 4096, batch 64") to a simulated step.

:class:`Scenario` names the model, the hardware, the policy and the batch; :func:`prepare` turns it
into what the simulator replays (partitions from the partitioner, the policy's table, per-layer
work from the cost model) and :func:`run_scenario` simulates it. Settings the hardware or the policy
cannot take raise :class:`ConfigError`; a model that cannot be cut to fit comes back as a result
with ``fits=False`` and the partitioner's reason, so a table of policies can show it.

Partitions per policy (its facts are on its registry entry, ``schedule.POLICIES``): a policy with
separate forward and backward partitions (``roundpipe``) uses the memory-aware planner
(``partition.plan_partitions``: a free stage grain by the paper's objective, or the given stage counts, and
head shards); the others cut the model into their default stage count (``stages`` overrides it)
with one partition balanced on forward + backward time, and the simulator judges memory.
``partitions`` replays explicit bounds instead.

Microbatches: any count from 1 to the batch. An uneven split is cut as the runtime cuts it
(``tensor_split``: the first ``batch % M`` microbatches one sequence larger); the layers are costed
at the larger size and each microbatch's times and activation bytes scale with its size. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from roundpipe.errors import ConfigError, PlanError, RoundpipeError, ScheduleError
from roundpipe.partition.cost import layer_times, model_costs
from roundpipe.partition.cost_checks import (
    check_fp16_accumulation,
    check_label_fraction,
    check_mlp_chunk_tokens,
    check_quantized_lora,
)
from roundpipe.partition.model_plan import HEAD_SHARD_CANDIDATES, plan_partitions
from roundpipe.partition.positions import check_positions
from roundpipe.partition.quant_layout import moment_bytes_per_param
from roundpipe.presets import Server, load_hardware, load_model_config, normalize_dtype
from roundpipe.schedule import POLICIES, PROVISIONAL_POLICY, build_table, policy_options
from roundpipe.schedule.table import Partition, ScheduleTable
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.search import partitions
from roundpipe.sim.simulator import simulate
from roundpipe.sim.workload import Workload, workload_from_costs


@dataclass(frozen=True)
class Scenario:
    """One question for the simulator. ``global_batch`` is in sequences per optimizer step.

    ``microbatches`` defaults to ``global_batch`` (one sequence per microbatch); any count up to the
    batch (uneven sizes as the runtime cuts them). ``stages``: an int (or a ``(forward, backward)``
    pair for a policy with separate partitions) overrides the policy's default stage count;
    ``partitions``: explicit ``(forward bounds, backward bounds)`` (with an int ``head_shards``). ``times`` are measured per-layer ``(forward_s, backward_s)`` keyed by layer
    name (see ``partition.layer_times``).
    """

    model: str | Mapping[str, Any]
    hardware: str | Server = "8xrtx4090"
    policy: str = PROVISIONAL_POLICY
    seq_len: int = 4096
    global_batch: int = 64
    microbatches: int | None = None
    lora_rank: int | None = None
    dtype: str = "bf16"
    optimizer: str = "sync"
    num_devices: int | None = None
    head_shards: int | Literal["auto"] = "auto"
    stages: int | tuple[int, int] | None = None
    partitions: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    round_size: int | None = None  # a dealing policy's rounds of microbatches (RunConfig.round_size)
    times: Mapping[str, tuple[float, float]] | None = field(default=None, compare=False)
    efficiency: float | None = None
    label_fraction: float = 1.0  # share of tokens with a label: the head computes only those
    fp16_accumulation: bool = False  # fp16 matmuls accumulate in fp16 (RunConfig(fp16_accumulation=True))
    mlp_chunk_tokens: int | None = None  # the blocks' MLP in token chunks (RunConfig.mlp_chunk_tokens)
    quantization: str | None = None  # frozen block weights kept compressed (RunConfig.quantization)
    lora_experts: bool = True  # LoRA on each expert too (False: peft's target_modules on a fused MoE)
    optimizer_state: str = "fp32"  # AdamW's moments on the host (OptimizerConfig.state_dtype)

    @property
    def model_name(self) -> str:
        if isinstance(self.model, Mapping):
            return str(self.model.get("_name_or_path") or self.model.get("model_type") or "model")
        return str(self.model)


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` built: the table, the per-layer work and the server it runs on."""

    scenario: Scenario
    hardware: Server
    table: ScheduleTable
    workload: Workload
    micro_batch_size: int
    head_shards: int
    notes: tuple[str, ...] = ()


def resolve_hardware(scenario: Scenario) -> Server:
    hw = load_hardware(scenario.hardware) if isinstance(scenario.hardware, str) else scenario.hardware
    n = scenario.num_devices
    if n is None:
        return hw
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_devices must be a positive integer, got {n!r}")
    if n > hw.num_gpus:
        raise ConfigError(
            f"{n} devices asked for, but the hardware {hw.name!r} has {hw.num_gpus}; use at most {hw.num_gpus} "
            f"or a larger server spec such as '{n}x{hw.gpu.name}'"
        )
    return replace(hw, num_gpus=n)


def check_scenario(s: Scenario) -> tuple[Server, int, int]:
    """Validate the numbers; return (server, microbatches, micro_batch_size)."""
    if s.policy not in POLICIES:
        raise ConfigError(f"unknown policy {s.policy!r}; known policies: {', '.join(POLICIES)}")
    for name in ("seq_len", "global_batch"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer, got {v!r}")
    check_label_fraction(s.label_fraction)
    check_mlp_chunk_tokens(s.mlp_chunk_tokens)
    check_quantized_lora(s.quantization, s.lora_rank)
    moment_bytes_per_param(s.optimizer_state)  # refuses an unknown one
    if s.lora_rank is not None and (not isinstance(s.lora_rank, int) or s.lora_rank < 1):
        raise ConfigError(
            f"lora rank must be a positive integer (or omitted for full fine-tuning), got {s.lora_rank!r}"
        )
    check_fp16_accumulation(s.fp16_accumulation, normalize_dtype(s.dtype))
    if s.optimizer not in ("sync", "async"):
        raise ConfigError(f"optimizer must be 'sync' or 'async', got {s.optimizer!r}")
    m = s.microbatches if s.microbatches is not None else s.global_batch
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"microbatches must be a positive integer, got {m!r}")
    if m > s.global_batch:
        raise ConfigError(
            f"{m} microbatches for a global batch of {s.global_batch} sequences leaves some empty; "
            f"use 1..{s.global_batch} microbatches"
        )
    return resolve_hardware(s), m, -(-s.global_batch // m)


def microbatch_sizes(batch: int, num_microbatches: int) -> tuple[int, ...]:
    """Sequences per microbatch as the runtime cuts a batch (``torch.tensor_split``)."""
    q, r = divmod(batch, num_microbatches)
    return (q + 1,) * r + (q,) * (num_microbatches - r)


def _classic_stages(policy: str, n_dev: int, stages) -> int:
    if stages is not None:
        if not isinstance(stages, int):
            raise ConfigError(f"{policy} uses one partition for forward and backward: give stages as an int")
        return stages
    return cast(int, POLICIES[policy].default_stages(n_dev))  # a classic policy's count is fixed


def _round(s: Scenario) -> dict:
    """The ``round_size`` option for the policy's table, if the scenario sets one."""
    if s.round_size is None:
        return {}
    if "round_size" not in policy_options(s.policy):
        raise ConfigError(
            f"round_size deals microbatches in rounds, which policy {s.policy!r} does not do; drop it"
        )
    return {"round_size": s.round_size}


def cost_args(s: Scenario) -> dict:
    """The scenario's settings that shape every layer's cost (``model_costs``'s keywords)."""
    return dict(
        dtype=s.dtype,
        lora_rank=s.lora_rank,
        label_fraction=s.label_fraction,
        fp16_accumulation=s.fp16_accumulation,
        mlp_chunk_tokens=s.mlp_chunk_tokens,
        quantization=s.quantization,
        lora_experts=s.lora_experts,
        optimizer_state=s.optimizer_state,
    )


def _classic_partition(
    s: Scenario, hw: Server, config: dict, m: int, mbs: int, n_stages: int
) -> tuple[Partition, int, list]:
    """The policy's partition (``sim/search.py``) for ``n_stages`` stages; head shards: the fewest
    within 1% of the best bottleneck."""
    shard_options = [s.head_shards] if s.head_shards != "auto" else list(HEAD_SHARD_CANDIDATES[:8])
    best = None
    for k in shard_options:
        costs = model_costs(config, s.seq_len, mbs, **cost_args(s), head_shards=k)
        if n_stages > len(costs):
            continue
        f, b = layer_times(costs, hw, efficiency=s.efficiency, times=s.times)
        part = partitions(s.policy, costs, f, b, num_devices=hw.num_gpus, microbatches=m, stages=n_stages)[0][
            0
        ]
        both = [x + y for x, y in zip(f, b)]
        bottleneck = max(math.fsum(both[i:j]) for i, j in zip(part.bounds, part.bounds[1:]))
        if best is None or bottleneck < best[0] * 0.99:
            best = (bottleneck, part, k, costs)
    if best is None:
        raise PlanError(f"{s.policy} needs {n_stages} stages but the model has fewer layers")
    return best[1], best[2], best[3]


def prepare(s: Scenario) -> Prepared:
    """Partitions, table and workload for ``s``. Raises ConfigError (bad settings), PlanError (the
    model cannot be cut to fit) or ScheduleError (the policy cannot take this shape)."""
    hw, m, mbs = check_scenario(s)
    config = dict(s.model) if isinstance(s.model, Mapping) else load_model_config(s.model)
    check_positions(config, s.seq_len, s.model_name)
    n_dev = hw.num_gpus
    notes: list[str] = []
    spec = POLICIES[s.policy]
    if s.partitions is not None:
        forward, backward = (Partition(tuple(b)) for b in s.partitions)
        if not spec.separate_partitions and forward != backward:
            raise ConfigError(
                f"{s.policy} uses one partition for forward and backward: give the same bounds twice"
            )
        shards = s.head_shards if isinstance(s.head_shards, int) else 1
        costs = model_costs(config, s.seq_len, mbs, **cost_args(s), head_shards=shards)
        if forward.num_layers != len(costs):
            raise ConfigError(
                f"the partitions cut {forward.num_layers} layers but the model has {len(costs)} with "
                f"{shards} head shard(s) ({costs[0].name} .. {costs[-1].name})"
            )
        table = build_table(s.policy, forward, backward, n_dev, m, **_round(s))
    elif spec.separate_partitions:
        p = plan_partitions(
            config,
            hw,
            seq_len=s.seq_len,
            micro_batch_size=mbs,
            num_devices=n_dev,
            dtype=s.dtype,
            lora_rank=s.lora_rank,
            stages=s.stages,
            head_shards=s.head_shards,
            microbatches=m,
            efficiency=s.efficiency,
            times=s.times,
            label_fraction=s.label_fraction,
            mlp_chunk_tokens=s.mlp_chunk_tokens,
            quantization=s.quantization,
            lora_experts=s.lora_experts,
            optimizer_state=s.optimizer_state,
        )
        forward, backward, shards = p.forward, p.backward, p.head_shards
        costs = model_costs(config, s.seq_len, mbs, **cost_args(s), head_shards=shards)
        notes += list(p.notes)
        table = build_table(s.policy, forward, backward, n_dev, m, **_round(s))
    else:
        n_stages = _classic_stages(s.policy, n_dev, s.stages)
        part, shards, costs = _classic_partition(s, hw, config, m, mbs, n_stages)
        table = build_table(s.policy, part, part, n_dev, m, **_round(s))
    work = workload_from_costs(costs, hw, times=s.times, efficiency=s.efficiency, name=s.model_name)
    if s.global_batch % m:
        work = replace(work, microbatch_sizes=microbatch_sizes(s.global_batch, m), micro_batch_size=mbs)
    return Prepared(s, hw, table, work, mbs, shards, tuple(notes))


def run_scenario(s: Scenario, options: SimOptions | None = None) -> SimResult:
    """Simulate ``s``. A model that cannot be partitioned to fit, or a shape the policy cannot
    schedule, comes back as a result with ``fits=False``, infinite step time and the reason."""
    opts = replace(options or SimOptions(), optimizer=s.optimizer)
    check_scenario(s)
    try:
        prep = prepare(s)
    except (PlanError, ScheduleError) as err:
        return failed_result(s, str(err))
    return simulate(prep.table, prep.workload, prep.hardware, opts, notes=prep.notes)


def failed_result(s: Scenario, reason: str) -> SimResult:
    hw, m, _ = check_scenario(s)
    n = hw.num_gpus
    return SimResult(
        policy=s.policy,
        num_devices=n,
        num_microbatches=m,
        iteration_s=math.inf,
        tokens_per_s=0.0,
        mfu=0.0,
        bubble_total=math.nan,
        bubble_ideal=math.nan,
        peak_gpu_bytes=(0,) * n,
        peak_host_bytes=0,
        peak_activations=(0,) * n,
        compute_busy_s=(0.0,) * n,
        h2d_bytes=0,
        d2h_bytes=0,
        optimizer_busy_s=0.0,
        weights_streamed=(False,) * n,
        fits=False,
        reason=reason,
        optimizer=s.optimizer,
    )


def safe_run(s: Scenario, options: SimOptions | None = None) -> SimResult:
    """:func:`run_scenario`, but any roundpipe error becomes a not-fitting result (for tables)."""
    try:
        return run_scenario(s, options)
    except RoundpipeError as err:
        return failed_result(s, f"{type(err).__name__}: {err}")


__all__ = [
    "Prepared",
    "Scenario",
    "check_scenario",
    "failed_result",
    "microbatch_sizes",
    "prepare",
    "run_scenario",
    "safe_run",
]
