"""The memory rule: what a stage, a device and one task need on a device, from the layers' costs.

Written once and called by everyone who asks: the partitioner's search (:func:`memory_vectors`,
per-layer terms it sums over candidate stages), the plan's report and the runtime's memory guard
(:func:`stage_bytes`, :func:`last_stage_bytes`, :func:`pair_peak_bytes`), and the simulator's
engine and residency check (:func:`task_bytes`).

A stage on a device holds (``partitioner.py``'s docstring gives the why of each term)::

    weights(stage) + prefetch + draining + added(stage) + max(peak over the stage's layers) + reserve

A layer's ``peak`` adds the next task's hand-offs (:data:`HELD_HAND_OFFS` of the model's largest
layer input), which the runtime uploads while a task runs, into memory the ``h2d`` stream allocates
and frees (``runtime/transfers.py``).

``reserve`` is what every device keeps out of the plan (:func:`device_reserve_bytes`): the preset's
workspace reserve (CUDA context, cuDNN, allocator slack) plus cuBLAS's workspaces
(:func:`cublas_reserve_bytes`), which the runtime's cuda backend also keeps out of a device's
capacity and free bytes.

One task (:func:`task_bytes`) works in the larger of its forward layers' working set (no autograd)
and its backward layers' saved activations plus one layer's transient. :func:`stage_bytes` takes,
for a forward stage with layers that do not recompute (the head), their saved activations *plus* the
largest peak of any layer (a bound, as the search needs sums over layers), where a task of that
stage peaks at the larger of the two: the static rule bounds the task's (``tests/test_memory_rule.py``).

Pure Python: no torch import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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


# The uploaded hand-offs a device holds beside those of the task it runs (which that task's working
# set counts): the next task's, which go up while it runs; a worker frees a task's hand-offs before
# it uploads those of the task two after it (``runtime/worker.py`` ``Worker._free_uploads``). At most
# two a task: a backward reads its stage input, for the recompute, and a gradient.
HELD_HAND_OFFS = 2

# cuBLAS workspaces, as torch's aten/src/ATen/cuda/CublasHandlePool.cpp allocates them: one per
# (cuBLAS handle, stream) a matmul ran with, from the caching allocator, kept until the process ends.
# Handles are per thread, so each compute stream has two: the worker thread's (forward, recompute)
# and the autograd engine's device thread's (the backward runs there, on the forward's stream).
CUBLAS_WORKSPACES_PER_COMPUTE_STREAM = 2
_KIB = 1024
_CUBLAS_DEFAULT_SM90 = 4096 * _KIB * 8  # ":4096:8", for sm90 exactly (H100, H200)
_CUBLAS_DEFAULT = 4096 * _KIB * 2 + 16 * _KIB * 8  # ":4096:2:16:8", 8.125 MiB, every other GPU
_CUBLASLT_DEFAULT = 1024 * _KIB  # CUBLASLT_WORKSPACE_SIZE's default, KiB


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, env: Mapping[str, str] = {}) -> int:
    """The bytes torch's cuBLAS allocates for one (handle, stream) on a GPU of ``compute_capability``
    (None: not a GPU, 0): the cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT``
    pairs; default 32 MiB on sm90, 8.125 MiB otherwise) and the cuBLASLt one beside it (matmuls with
    a bias epilogue; ``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1 MiB, at most the cuBLAS one; none
    when ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` shares the cuBLAS one). ``env``: the environment."""
    if compute_capability is None:
        return 0
    default = _CUBLAS_DEFAULT_SM90 if tuple(compute_capability) == (9, 0) else _CUBLAS_DEFAULT
    pairs = re.findall(r":([0-9]+):([0-9]+)", env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    cublas = sum(int(size) * _KIB * int(count) for size, count in pairs) if pairs else default
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return cublas
    lt_kib = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    lt = int(lt_kib) * _KIB if lt_kib.strip().isdigit() else _CUBLASLT_DEFAULT
    return cublas + min(lt, cublas)


def cublas_reserve_bytes(
    compute_capability: tuple[int, int] | None, compute_streams: int = 1, env: Mapping[str, str] = {}
) -> int:
    """cuBLAS's workspaces on one worker device: two (handle, stream) pairs per compute stream
    (``CUBLAS_WORKSPACES_PER_COMPUTE_STREAM``), each :func:`cublas_workspace_bytes`."""
    return (
        CUBLAS_WORKSPACES_PER_COMPUTE_STREAM
        * compute_streams
        * cublas_workspace_bytes(compute_capability, env)
    )


class DeviceFacts(Protocol):
    """What :func:`device_reserve_bytes` reads of a GPU preset (``presets.GPU``, ``presets.Server``)."""

    @property
    def workspace_reserve_bytes(self) -> int: ...
    @property
    def compute_capability(self) -> tuple[int, int] | None: ...


def device_reserve_bytes(hw: DeviceFacts) -> int:
    """What every device of ``hw`` keeps out of a plan: its preset workspace reserve plus cuBLAS's
    workspaces for one compute stream (:func:`cublas_reserve_bytes`, torch's defaults)."""
    return hw.workspace_reserve_bytes + cublas_reserve_bytes(hw.compute_capability)


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
    gradients downloading while the device's next backward stage runs (``drain``). Every layer's
    ``peak`` adds the next task's uploaded hand-offs (``HELD_HAND_OFFS``).
    """
    if phase not in ("forward", "backward"):
        raise ConfigError(f"phase must be 'forward' or 'backward', got {phase!r}")
    weights = [c.param_bytes for c in costs]
    held = HELD_HAND_OFFS * max((c.act_in_bytes for c in costs), default=0)
    added, peak, drain = [], [], []
    for c in costs:
        if phase == "backward" or not c.recompute:
            added.append(c.grad_device_bytes + c.saved_bytes)
            peak.append(c.transient_bytes + held)
            drain.append(c.grad_device_bytes)
        else:
            added.append(0)
            peak.append(c.fwd_work_bytes + held)
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
    "CUBLAS_WORKSPACES_PER_COMPUTE_STREAM",
    "DeviceFacts",
    "HELD_HAND_OFFS",
    "LayerBytes",
    "cublas_reserve_bytes",
    "cublas_workspace_bytes",
    "device_reserve_bytes",
    "last_stage_bytes",
    "largest_others",
    "memory_vectors",
    "pair_peak_bytes",
    "stage_bytes",
    "task_bytes",
]
