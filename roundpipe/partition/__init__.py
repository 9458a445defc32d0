"""Cost model and optimal partitioner (pure Python, no torch).

``cost``: per-layer FLOPs, bytes and times from a model config (analytic, or measured times per
layer). ``memory``: the memory rule (a stage's, a device's and a task's bytes). ``partitioner``: contiguous forward/backward stages that minimise the slowest stage within
a per-device memory budget, and the microbatch choice. ``grain``: a streaming policy's stage
counts. ``model_plan``: head sharding and the resulting :class:`PartitionPlan`.
"""

from roundpipe.partition.cost import LayerCost, layer_time, layer_times, model_costs, model_totals
from roundpipe.partition.memory import last_stage_bytes, memory_vectors, stage_bytes, task_bytes
from roundpipe.partition.model_plan import PartitionPlan, choose_head_shards, plan_partitions
from roundpipe.partition.partitioner import (
    PartitionResult,
    auto_microbatches,
    optimal_partition,
    roundpipe_bubble,
)

__all__ = [
    "LayerCost",
    "PartitionResult",
    "PartitionPlan",
    "auto_microbatches",
    "choose_head_shards",
    "last_stage_bytes",
    "layer_time",
    "layer_times",
    "memory_vectors",
    "model_costs",
    "model_totals",
    "optimal_partition",
    "plan_partitions",
    "roundpipe_bubble",
    "stage_bytes",
    "task_bytes",
]
