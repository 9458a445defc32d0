"""A model's :class:`PartitionPlan` on one device kind: head shards, both partitions, microbatches, estimates.

:func:`plan_partitions` is what ``roundpipe plan`` prints and the simulator's scenarios start from. For a free
stage grain it asks ``grain.py`` (the RoundPipe paper's objective); for given stage counts, or
where no grain fits, it cuts each phase with the exact partitioner of ``partitioner.py``, whose
memory rule the plan's byte figures follow. :func:`choose_head_shards` picks the vocabulary shard
count by planning each candidate.

Pure Python: no torch import.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from roundpipe.errors import ConfigError, PlanError
from roundpipe.partition.cost import DEFAULT_HEAD_CHUNK_TOKENS, LayerCost, layer_times, model_costs
from roundpipe.partition.grain import GrainChoice, grain_choices
from roundpipe.partition.memory import device_reserve_bytes, last_stage_bytes, memory_vectors, stage_bytes
from roundpipe.partition.partitioner import (
    DEFAULT_TARGET_BUBBLE,
    LEVERS,
    PartitionResult,
    auto_microbatches,
    optimal_partition,
    plan_error,
    roundpipe_bubble,
)
from roundpipe.presets import GPU, Server, load_hardware, load_model_config
from roundpipe.schedule.deps import TaskKind
from roundpipe.schedule.table import Partition

DEFAULT_TOLERANCE = 0.10  # a stage within 10% of the mean stage time counts as balanced
DEFAULT_MAX_HEAD_SHARDS = 32
HEAD_SHARD_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
HEAD_SHARD_GAIN = 0.01  # more head shards must lower the bottleneck by more than this to be worth it


@dataclass(frozen=True)
class PartitionPlan:
    """Forward and backward partitions of one model on one device kind, with their estimates.

    Times are seconds per microbatch, bytes per device. ``*_stage_peaks`` follow the memory rule of
    ``partitioner.py``; ``last_stage_peak`` is the device that interleaves the last forward and backward
    stages. ``layer_names[i]`` names layer ``i`` of both partitions.
    """

    model: str
    hardware: str
    num_devices: int
    seq_len: int
    micro_batch_size: int
    dtype: str
    lora_rank: int | None
    head_shards: int
    microbatches: int
    layer_names: tuple[str, ...]
    forward: Partition
    backward: Partition
    fwd_stage_times: tuple[float, ...]
    bwd_stage_times: tuple[float, ...]
    fwd_stage_weights: tuple[int, ...]
    bwd_stage_weights: tuple[int, ...]
    fwd_stage_peaks: tuple[int, ...]
    bwd_stage_peaks: tuple[int, ...]
    last_stage_peak: int
    budget: int
    reserve_bytes: int
    bubble: float
    notes: tuple[str, ...] = field(default=())

    @property
    def fwd_bottleneck(self) -> float:
        return max(self.fwd_stage_times)

    @property
    def bwd_bottleneck(self) -> float:
        return max(self.bwd_stage_times)

    @property
    def bottleneck(self) -> tuple[float, float]:
        """(slowest forward stage, slowest backward stage), seconds per microbatch."""
        return self.fwd_bottleneck, self.bwd_bottleneck

    @property
    def fwd_mean(self) -> float:
        return math.fsum(self.fwd_stage_times) / len(self.fwd_stage_times)

    @property
    def bwd_mean(self) -> float:
        return math.fsum(self.bwd_stage_times) / len(self.bwd_stage_times)

    @property
    def imbalance(self) -> tuple[float, float]:
        """Bottleneck over mean stage time, minus one, for (forward, backward)."""
        return self.fwd_bottleneck / self.fwd_mean - 1, self.bwd_bottleneck / self.bwd_mean - 1

    @property
    def peak_bytes(self) -> int:
        return max(*self.fwd_stage_peaks, *self.bwd_stage_peaks, self.last_stage_peak)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["forward"] = list(self.forward.bounds)
        d["backward"] = list(self.backward.bounds)
        d["layer_names"] = list(self.layer_names)
        d.update(
            fwd_bottleneck=self.fwd_bottleneck,
            bwd_bottleneck=self.bwd_bottleneck,
            fwd_mean=self.fwd_mean,
            bwd_mean=self.bwd_mean,
            peak_bytes=self.peak_bytes,
        )
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _stage_rows(self, kind: TaskKind) -> list[str]:
        part = self.forward if kind == TaskKind.F else self.backward
        times = self.fwd_stage_times if kind == TaskKind.F else self.bwd_stage_times
        weights = self.fwd_stage_weights if kind == TaskKind.F else self.bwd_stage_weights
        peaks = self.fwd_stage_peaks if kind == TaskKind.F else self.bwd_stage_peaks
        rows = []
        for s in range(part.num_stages):
            lay = part.layers(s)
            span = self.layer_names[lay.start]
            if len(lay) > 1:
                span += f" .. {self.layer_names[lay.stop - 1]}"
            rows.append(
                f"  {kind}{s:<4} {span:<28} {len(lay):>3}  {times[s] * 1e3:>9.2f} ms  "
                f"{_gb(weights[s]):>8}  {_gb(peaks[s]):>8}"
            )
        return rows

    def table(self) -> str:
        """A readable summary: one row per stage (layers, est. time, weights, peak bytes)."""
        tune = "full" if self.lora_rank is None else f"LoRA r={self.lora_rank}"
        fi, bi = self.imbalance
        lines = [
            f"{self.model} on {self.num_devices}x {self.hardware}: seq {self.seq_len} x mbs {self.micro_batch_size}, "
            f"{self.dtype}, {tune}; {self.forward.num_stages} forward + {self.backward.num_stages} backward stages, "
            f"head shards {self.head_shards}, microbatches {self.microbatches} (est. bubble {self.bubble:.1%})",
            f"budget {_gb(self.budget)} per device (workspace {_gb(self.reserve_bytes)} of it); "
            f"peak {_gb(self.peak_bytes)}; last F+B device {_gb(self.last_stage_peak)}",
            f"forward: bottleneck {self.fwd_bottleneck * 1e3:.2f} ms, mean {self.fwd_mean * 1e3:.2f} ms ({fi:+.1%})",
            f"  {'stage':<5} {'layers':<28} {'n':>3}  {'est. time':>12}  {'weights':>8}  {'peak':>8}",
            *self._stage_rows(TaskKind.F),
            f"backward (with recompute): bottleneck {self.bwd_bottleneck * 1e3:.2f} ms, "
            f"mean {self.bwd_mean * 1e3:.2f} ms ({bi:+.1%})",
            *self._stage_rows(TaskKind.B),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _resolve(
    model: str | Mapping[str, Any], hardware: str | GPU | Server
) -> tuple[str, dict, GPU | Server, str]:
    if isinstance(model, Mapping):
        config = dict(model)
        name = str(config.get("_name_or_path") or config.get("model_type") or "model")
    else:
        config = load_model_config(model)
        name = str(model)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    hw_name = hw.gpu.name if isinstance(hw, Server) else hw.name
    return name, config, hw, hw_name


EVERY_LAYER = -1  # a backward stage count: one layer per backward stage, however many layers


def _stage_counts(stages: int | tuple[int, int] | None) -> tuple[int | None, int | None]:
    if stages is None:
        return None, None
    if isinstance(stages, int):
        return stages, stages
    if len(stages) != 2:
        raise ConfigError(f"stages must be an int, a (forward, backward) pair or None, got {stages!r}")
    return stages[0], stages[1]


def _auto_stages(n: int, num_devices: int, fewest: int) -> int:
    """The smallest multiple of ``num_devices`` that is at least ``fewest`` (capped at ``n`` layers)."""
    return min(n, max(num_devices, -(-fewest // num_devices) * num_devices))


def _partition_phase(
    times: list[float],
    costs: list[LayerCost],
    phase: str,
    stages: int | None,
    num_devices: int,
    budget: int,
    reserve: int,
    min_stages: int = 1,
) -> PartitionResult:
    """Partition one phase; ``stages=None`` picks the smallest multiple of devices that fits."""
    w, a, p, d = memory_vectors(costs, phase)
    names = [c.name for c in costs]
    kw: dict[str, Any] = dict(
        weight_bytes=w, added_bytes=a, peak_bytes=p, drain_bytes=d, budget=budget, reserve_bytes=reserve,
        names=names,
    )  # fmt: skip
    if stages is not None:
        return optimal_partition(times, stages, what=phase, **kw)
    n = len(costs)
    count = _auto_stages(n, num_devices, min_stages)
    while True:
        try:
            return optimal_partition(times, count, what=phase, **kw)
        except PlanError as err:
            fewest = getattr(err, "min_stages", None)
            if fewest is None or count >= n or fewest > n:
                raise
            count = _auto_stages(n, num_devices, max(fewest, count + 1))


def partition_result(
    partition: Partition, times: Sequence[float], costs: Sequence[LayerCost], phase: str, reserve: int
) -> PartitionResult:
    """The per-stage numbers of a given partition, by the partitioner's memory rule."""
    spans = list(zip(partition.bounds, partition.bounds[1:]))
    w = memory_vectors(costs, phase)[0]
    return PartitionResult(
        partition,
        tuple(math.fsum(times[i:j]) for i, j in spans),
        tuple(sum(w[i:j]) for i, j in spans),
        tuple(stage_bytes(costs, partition, phase, reserve)),
        max(sum(w[i:j]) for i, j in spans),
    )


def cut_phases(
    costs: list[LayerCost],
    fwd_t: list[float],
    bwd_t: list[float],
    *,
    stages: int | tuple[int, int] | None,
    num_devices: int,
    budget: int,
    reserve: int,
    grain: GrainChoice | None = None,
) -> tuple[PartitionResult, PartitionResult]:
    """The forward and backward partitions of a separate-partition plan: ``grain``'s when one is
    given, else each phase cut on its own by the exact minimum-bottleneck partitioner (``stages``:
    counts, or None for the smallest multiple of the devices that fits; a backward count of
    :data:`EVERY_LAYER` is one layer per stage, the forward count then at most the layers); then,
    while the device
    interleaving the last forward and backward stages is over ``budget`` and the forward count is
    free, more forward stages. The rule :func:`plan_partitions` and the plan search (``sim/search.py``) share.

    Raises:
        PlanError: no partition fits (the message names the bytes and the levers).
    """
    sf, sb = _stage_counts(stages)
    if sb == EVERY_LAYER:  # the finest recompute grain, whatever the layer count (head shards too)
        sb, sf = len(costs), None if sf is None else min(sf, len(costs))
    if grain is not None:
        fwd = partition_result(grain.forward, fwd_t, costs, "forward", reserve)
        bwd = partition_result(grain.backward, bwd_t, costs, "backward", reserve)
    else:
        bwd = _partition_phase(bwd_t, costs, "backward", sb, num_devices, budget, reserve)
        fwd = _partition_phase(fwd_t, costs, "forward", sf, num_devices, budget, reserve)
    last = last_stage_bytes(costs, fwd.partition, bwd.partition, reserve)
    while last > budget and sf is None and fwd.partition.num_stages < len(costs):
        # The device interleaving the last F and B stages holds both: shrink the forward stages.
        fwd = _partition_phase(
            fwd_t, costs, "forward", None, num_devices, budget, reserve, fwd.partition.num_stages + 1
        )
        last = last_stage_bytes(costs, fwd.partition, bwd.partition, reserve)
    if last > budget:
        raise plan_error(
            f"the device running the last forward stage ({fwd.partition.num_stages - 1}) and the last backward "
            f"stage ({bwd.partition.num_stages - 1}) interleaved needs {last:,} bytes, over the budget of "
            f"{budget:,}; use more forward stages. {LEVERS}",
            needed=last,
            budget=budget,
        )
    return fwd, bwd


def _plan_with_shards(
    k: int,
    *,
    name: str,
    config: dict,
    hw: GPU | Server,
    hw_name: str,
    num_devices: int,
    seq_len: int,
    micro_batch_size: int,
    dtype: str,
    lora_rank: int | None,
    stages: int | tuple[int, int] | None,
    microbatches: int | str,
    budget: int,
    reserve: int,
    efficiency: float | None,
    times: Mapping[str, tuple[float, float]] | None,
    head_chunk_tokens: int,
    lora_experts: bool,
    target_bubble: float,
    label_fraction: float,
    mlp_chunk_tokens: int | None,
    quantization: str | None,
    optimizer_state: str,
) -> tuple[PartitionPlan, list[LayerCost], PartitionResult, PartitionResult]:
    costs = model_costs(
        config,
        seq_len,
        micro_batch_size,
        dtype=dtype,
        lora_rank=lora_rank,
        head_shards=k,
        head_chunk_tokens=head_chunk_tokens,
        lora_experts=lora_experts,
        label_fraction=label_fraction,
        mlp_chunk_tokens=mlp_chunk_tokens,
        quantization=quantization,
        optimizer_state=optimizer_state,
    )
    fwd_t, bwd_t = layer_times(costs, hw, efficiency=efficiency, times=times)
    notes = []
    grain = None
    if stages is None:
        # Free stage grain: the paper's objective for this microbatch count (partition/grain.py).
        grain_m = microbatches if isinstance(microbatches, int) else 2 * num_devices
        try:
            grain = grain_choices(
                costs, fwd_t, bwd_t, num_devices=num_devices, microbatches=grain_m, budget=budget,
                reserve_bytes=reserve, limit=1,
            )[0]  # fmt: skip
        except PlanError as err:
            notes.append(
                f"no free stage grain fits ({err}); stage counts are multiples of the devices instead"
            )
    fwd, bwd = cut_phases(
        costs,
        fwd_t,
        bwd_t,
        stages=stages,
        num_devices=num_devices,
        budget=budget,
        reserve=reserve,
        grain=grain,
    )
    last = last_stage_bytes(costs, fwd.partition, bwd.partition, reserve)
    if microbatches == "auto":
        m = auto_microbatches(fwd.stage_times, bwd.stage_times, num_devices, target_bubble)
    elif isinstance(microbatches, int) and microbatches >= 1:
        m = microbatches
    else:
        raise ConfigError(f"microbatches must be a positive int or 'auto', got {microbatches!r}")
    if times:
        notes.append(f"measured times for {len(times)} of {len(costs)} layers, analytic for the rest")
    plan = PartitionPlan(
        model=name,
        hardware=hw_name,
        num_devices=num_devices,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        dtype=costs[0].dtype,
        lora_rank=lora_rank,
        head_shards=k,
        microbatches=m,
        layer_names=tuple(c.name for c in costs),
        forward=fwd.partition,
        backward=bwd.partition,
        fwd_stage_times=fwd.stage_times,
        bwd_stage_times=bwd.stage_times,
        fwd_stage_weights=fwd.stage_weights,
        bwd_stage_weights=bwd.stage_weights,
        fwd_stage_peaks=fwd.stage_peaks,
        bwd_stage_peaks=bwd.stage_peaks,
        last_stage_peak=last,
        budget=budget,
        reserve_bytes=reserve,
        bubble=roundpipe_bubble(fwd.stage_times, bwd.stage_times, num_devices, m),
        notes=tuple(notes),
    )
    return plan, costs, fwd, bwd


def plan_partitions(
    model: str | Mapping[str, Any],
    hardware: str | GPU | Server,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    num_devices: int | None = None,
    dtype: str = "bf16",
    lora_rank: int | None = None,
    stages: int | tuple[int, int] | None = None,
    head_shards: int | str = "auto",
    microbatches: int | str = "auto",
    memory_budget: int | None = None,
    reserve_bytes: int | None = None,
    efficiency: float | None = None,
    times: Mapping[str, tuple[float, float]] | None = None,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
    lora_experts: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    max_head_shards: int = DEFAULT_MAX_HEAD_SHARDS,
    target_bubble: float = DEFAULT_TARGET_BUBBLE,
    label_fraction: float = 1.0,
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
    optimizer_state: str = "fp32",
) -> PartitionPlan:
    """PartitionPlan forward and backward partitions of ``model`` on ``hardware`` (one device kind).

    ``model``: preset name, config path or config dict. ``hardware``: spec (``"8xrtx4090"``),
    :class:`Server` or :class:`GPU`; ``num_devices`` defaults to the server's GPU count.

    ``stages``: an int for both partitions, a ``(forward, backward)`` pair, or ``None`` (default):
    a free stage grain chosen by the RoundPipe paper's objective for ``microbatches`` (``"auto"``:
    ``2 * num_devices``), with the head and its shards in one fused last stage of both partitions
    (``partition/grain.py``). Where no such grain fits (the whole head is too large for one device),
    and for given counts, the exact minimum-bottleneck partitioner cuts each phase, head shards
    spread like any layer; ``None`` then takes for each partition the smallest multiple of
    ``num_devices`` whose stages fit the budget.

    ``head_shards``: an int, or ``"auto"`` (:func:`choose_head_shards`' rule). ``microbatches``: an
    int or ``"auto"`` (:func:`auto_microbatches`). ``memory_budget`` defaults to the GPU's memory,
    ``reserve_bytes`` to what its devices keep out of a plan (``memory.device_reserve_bytes``: the preset
    workspace reserve and cuBLAS's workspaces); ``efficiency`` to its preset matmul
    efficiency; ``times`` are measured per-layer ``(forward_s, backward_s)`` overrides.
    ``label_fraction``: the share of tokens with a label; the head works on those only.
    ``mlp_chunk_tokens``: the blocks run their MLP in token chunks (``model_costs``).
    ``quantization``: the blocks' frozen weights kept compressed (``model_costs``; LoRA only).
    ``optimizer_state``: AdamW's moments on the host (``model_costs``).

    Raises :class:`PlanError` when nothing fits (the message names the layer, the bytes, the budget
    and the levers), :class:`ConfigError` on bad arguments.
    """
    name, config, hw, hw_name = _resolve(model, hardware)
    if num_devices is None:
        num_devices = hw.num_gpus if isinstance(hw, Server) else 1
    if num_devices < 1:
        raise ConfigError(f"num_devices must be >= 1, got {num_devices}")
    budget = int(memory_budget if memory_budget is not None else hw.memory_bytes)
    reserve = int(reserve_bytes if reserve_bytes is not None else device_reserve_bytes(hw))
    common: dict[str, Any] = dict(
        name=name,
        config=config,
        hw=hw,
        hw_name=hw_name,
        num_devices=num_devices,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        lora_rank=lora_rank,
        stages=stages,
        microbatches=microbatches,
        budget=budget,
        reserve=reserve,
        efficiency=efficiency,
        times=times,
        head_chunk_tokens=head_chunk_tokens,
        lora_experts=lora_experts,
        target_bubble=target_bubble,
        label_fraction=label_fraction,
        mlp_chunk_tokens=mlp_chunk_tokens,
        quantization=quantization,
        optimizer_state=optimizer_state,
    )
    if head_shards != "auto":
        if not isinstance(head_shards, int) or head_shards < 1:
            raise ConfigError(f"head_shards must be a positive int or 'auto', got {head_shards!r}")
        return _plan_with_shards(head_shards, **common)[0]
    return _choose(common, tolerance, max_head_shards)[0]


def _head_fused(p: PartitionPlan, shards: int) -> bool:
    """The plan's last stage, in both partitions, is the fused head stage holding every head shard,
    and it is not the slowest stage of either (else more shards could spread it over stages)."""
    start = len(p.layer_names) - shards
    slowest = p.fwd_stage_times[-1] >= p.fwd_bottleneck or p.bwd_stage_times[-1] >= p.bwd_bottleneck
    return p.forward.bounds[-2] == p.backward.bounds[-2] <= start and not slowest


def _choose(common: dict, tolerance: float, max_head_shards: int) -> tuple[PartitionPlan, int]:
    """PartitionPlan every candidate shard count and keep the smallest that is (nearly) as fast as the best."""
    plans: list[PartitionPlan] = []
    last_error: PlanError | None = None
    for k in (c for c in HEAD_SHARD_CANDIDATES if c <= max_head_shards):
        try:
            plans.append(_plan_with_shards(k, **common)[0])
            if _head_fused(plans[-1], k):
                break  # every shard sits in the fused head stage: more shards cannot speed it up
        except PlanError as err:
            layer = getattr(err, "layer", None)
            if layer is not None and not str(layer).startswith("head"):
                raise  # a block or the embedding does not fit: more head shards cannot help
            last_error = err
    if not plans:
        assert last_error is not None
        raise last_error
    best = min(sum(p.bottleneck) for p in plans)
    chosen = next(p for p in plans if sum(p.bottleneck) <= (1 + HEAD_SHARD_GAIN) * best)
    notes = list(chosen.notes)
    for phase, imb in zip(("forward", "backward"), chosen.imbalance):
        if imb > tolerance:
            notes.append(
                f"the {phase} bottleneck is {imb:+.1%} over the mean stage time: stages hold whole layers and no "
                f"head shard count does better with {chosen.forward.num_stages if phase == 'forward' else chosen.backward.num_stages} "
                f"stages; another stage count may balance better"
            )
    return replace(chosen, notes=tuple(notes)), chosen.head_shards


def choose_head_shards(
    model: str | Mapping[str, Any],
    hardware: str | GPU | Server,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    max_head_shards: int = DEFAULT_MAX_HEAD_SHARDS,
    **plan_kwargs: Any,
) -> int:
    """The smallest head shard count with which the head is no longer the bottleneck.

    The head (LM head + loss) is one big layer: 2-5x a decoder block for the models here. With
    ``k`` vocabulary shards it becomes ``k`` layers the partitioner can spread over stages.

    Rule: plan every candidate ``k`` in ``HEAD_SHARD_CANDIDATES`` up to ``max_head_shards`` (shard
    counts whose plan does not fit memory are skipped) and return the smallest ``k`` whose
    forward + backward bottleneck is within ``HEAD_SHARD_GAIN`` (1%) of the best candidate's. This
    is "the head is no longer the bottleneck" in the strong sense: sharding it further would not make
    the slowest stage faster. The weaker rule "the slowest stage is within 10% of the mean or holds
    no head shard" stops too early: for Qwen3-1.7B on 8 stages it accepts 2 shards with the forward
    bottleneck +20% over the mean, while 8 shards bring it to +12% (stages hold whole blocks, so
    the head shards are the only fine-grained filler). ``plan_kwargs`` are those of :func:`plan_partitions`
    (``seq_len`` is required).
    """
    return plan_partitions(
        model, hardware, tolerance=tolerance, max_head_shards=max_head_shards, **plan_kwargs
    ).head_shards
