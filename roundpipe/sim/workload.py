"""What the simulator replays: per-layer times and bytes, and per-task operations of a table.

A :class:`Workload` is the model cut into layers (the runtime's layer list) for one microbatch
shape: for each layer its forward and backward seconds and the bytes that move or sit somewhere.
Build one from the analytic cost model (:func:`workload_from_costs`, optionally with measured
per-layer times keyed by layer name, exactly like ``partition.layer_times(..., times=...)``) or
synthetically (:func:`uniform_workload`, what the closed-form checks use).

Which operations a table runs on each device (fused F+B pairs, the hand-offs each consumes and
produces, the layers each runs forward and backward) is ``roundpipe/schedule/flow.py``'s, shared
with the runtime; the simulator reads it there. :func:`device_ops` is the same, one self-contained
:class:`Op` per operation, for readers who want the ops of one table spelled out.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import GRAD_HOST_BYTES_PER_PARAM, LayerCost, layer_times, model_totals
from roundpipe.presets import GPU, Server
from roundpipe.schedule.deps import TaskKey, TaskKind
from roundpipe.schedule.flow import FUSED, FlowOp, device_flows, layers_of
from roundpipe.schedule.table import ScheduleTable

DEFAULT_W_FRACTION = 0.5  # share of a layer's backward that is weight gradient (I/W split)
FP32_BYTES = 4  # the runtime accumulates weight gradients in fp32 on the device and sends them down so


@dataclass(frozen=True)
class LayerWork:
    """One layer for one microbatch: seconds and bytes (see ``partition/cost.py`` for the bytes)."""

    name: str
    fwd_s: float
    bwd_s: float  # backward alone, without the recompute forward
    recompute: bool = True  # a backward stage re-runs this layer's forward first
    param_bytes: int = 0  # weights on the device
    grad_bytes: int = 0  # the fp32 weight-gradient accumulator of this layer on the device (sent down)
    act_in_bytes: int = 0  # the layer's input (a hand-off if a stage starts here)
    saved_bytes: int = 0  # what autograd keeps for this layer while its stage backpropagates
    transient_bytes: int = 0  # one layer's backward transient
    fwd_work_bytes: int = 0  # forward working set without autograd
    trainable_params: int = 0  # parameters whose optimizer step this layer owns
    flops: float = 0.0  # useful forward + backward FLOPs (no recompute), for MFU


@dataclass(frozen=True)
class Workload:
    """The layers of one model at one microbatch shape, plus what the host holds for it."""

    layers: tuple[LayerWork, ...]
    tokens_per_microbatch: int = 0
    host_state_bytes: int = 0  # pinned weights + fp32 gradients + AdamW state
    name: str = "model"
    dtype: str = "bf16"
    w_fraction: float = DEFAULT_W_FRACTION
    # Uneven microbatches: the sequences in each microbatch of the step, against ``micro_batch_size``
    # (the size the layer numbers are for); a microbatch's times and activation bytes scale with it.
    microbatch_sizes: tuple[int, ...] = ()
    micro_batch_size: int = 1
    # Seconds a device spends building one microbatch's layer context (inputs, masks, rotary
    # tables) before the first of its operations that runs another microbatch than the one before.
    # On CUDA a few small kernels (the cost model leaves it 0); on the cpu backend measured by
    # ``Pipeline.profile`` (``Pipeline.context_time``), where it is a fair share of a small layer.
    context_s: float = 0.0
    # Seconds a device stands idle before each operation with work while the host gets it going
    # (the worker's Python between operations: events, hooks, closures), on top of its compute. The
    # cost model leaves it 0; on the cpu backend ``Pipeline.profile`` measures it
    # (``Pipeline.task_time``): there each stream is a Python thread, so the gap is serial with
    # the device's work.
    task_s: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def scales(self, num_microbatches: int) -> list[float]:
        """Per microbatch, its size over the workload's (all 1.0 unless ``microbatch_sizes`` is set)."""
        if not self.microbatch_sizes:
            return [1.0] * num_microbatches
        if len(self.microbatch_sizes) != num_microbatches:
            raise ConfigError(
                f"the workload has {len(self.microbatch_sizes)} microbatch sizes but the table "
                f"{num_microbatches} microbatches; give one size per microbatch"
            )
        return [k / self.micro_batch_size for k in self.microbatch_sizes]


def workload_from_costs(
    costs: Sequence[LayerCost],
    hw: GPU | Server,
    *,
    times: Mapping[str, tuple[float, float]] | None = None,
    efficiency: float | None = None,
    name: str = "model",
    context_s: float = 0.0,
    task_s: float = 0.0,
) -> Workload:
    """Per-layer times from ``layer_times`` (analytic, or ``times[name] = (forward_s, backward_s)``
    measured for one microbatch, backward without recompute) and bytes from the cost model;
    ``context_s`` and ``task_s`` as measured with ``times`` (``Workload.context_s``, ``Workload.task_s``)."""
    for what, seconds in (("context_s", context_s), ("task_s", task_s)):
        if seconds < 0:
            raise ConfigError(f"{what} must be >= 0 seconds, got {seconds}")
    fwd, bwd_stage = layer_times(list(costs), hw, efficiency=efficiency, times=times)
    layers = []
    for c, f, bs in zip(costs, fwd, bwd_stage):
        layers.append(
            LayerWork(
                name=c.name,
                fwd_s=f,
                bwd_s=max(0.0, bs - (f if c.recompute else 0.0)),
                recompute=c.recompute,
                param_bytes=c.param_bytes,
                grad_bytes=c.trainable_params * FP32_BYTES,
                act_in_bytes=c.act_in_bytes,
                saved_bytes=c.saved_bytes,
                transient_bytes=c.transient_bytes,
                fwd_work_bytes=c.fwd_work_bytes,
                trainable_params=c.grad_host_bytes // GRAD_HOST_BYTES_PER_PARAM,
                flops=c.fwd_flops + c.bwd_flops,
            )
        )
    totals = model_totals(list(costs))
    return Workload(
        tuple(layers),
        tokens_per_microbatch=costs[0].tokens if costs else 0,
        host_state_bytes=int(totals["host_bytes"]),
        name=name,
        dtype=costs[0].dtype if costs else "bf16",
        context_s=float(context_s),
        task_s=float(task_s),
    )


def work_seconds(
    w: Workload,
    kind: str,
    fwd_layers: range,
    bwd_layers: range,
    *,
    first_forward: bool = False,
    split: bool = False,
) -> float:
    """Seconds one operation computes (one microbatch of ``w``'s shape): F runs its forward layers;
    B re-runs the forward of the layers that recompute (all of them when no forward ran them:
    ``first_forward``) and backpropagates; a fused F+B runs the head forward once with autograd;
    I and W split the backward by ``w.w_fraction`` (``split``: a fused F + I). The one rule the
    simulator and the virtual server (``backend/virtual.py``) time operations by."""
    ly, wf = w.layers, w.w_fraction
    fwd = sum(ly[i].fwd_s for i in fwd_layers)
    if kind == TaskKind.F:
        return fwd
    if kind == FUSED:
        share = (1 - wf) if split else 1.0
        return fwd + sum(ly[i].fwd_s + ly[i].bwd_s * share for i in bwd_layers)
    recompute = sum(ly[i].fwd_s for i in bwd_layers if ly[i].recompute or first_forward)
    back = sum(ly[i].bwd_s for i in bwd_layers)
    if kind == TaskKind.B:
        return recompute + back
    if kind == TaskKind.I:
        return recompute + back * (1 - wf)
    return back * wf


def flow_seconds(w: Workload, flow) -> float:
    """``work_seconds`` of a runtime task (``runtime/plan.TaskFlow``: its task, the B it is fused
    with, its layers; a fused op's ``first_forward`` only says that its layers run forward there)."""
    if flow.fused_with is not None:
        return work_seconds(w, FUSED, flow.layers_fwd, flow.layers_bwd)
    return work_seconds(w, flow.task.kind, flow.layers_fwd, flow.layers_bwd, first_forward=flow.first_forward)


def uniform_workload(
    num_layers: int,
    fwd_s: float = 1.0,
    bwd_s: float = 2.0,
    *,
    recompute: bool = False,
    **bytes_per_layer: int,
) -> Workload:
    """``num_layers`` identical, trainable layers (the closed forms' setting); bytes default to zero."""
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    bytes_per_layer.setdefault("trainable_params", 1)
    layers = tuple(
        LayerWork(f"layers.{i}", fwd_s, bwd_s, recompute=recompute, **bytes_per_layer)
        for i in range(num_layers)
    )
    return Workload(layers, name=f"uniform{num_layers}")


@dataclass(slots=True)
class Op:
    """One unit of device work: a task, or a fused F+B pair. Built by :func:`device_ops`."""

    device: int
    label: str
    kind: str  # F, B, FB, I, W
    tasks: tuple[TaskKey, ...]
    fwd_layers: range = range(0)  # run forward without autograd
    bwd_layers: range = range(0)  # run with autograd and backpropagated
    recompute: bool = True  # bwd_layers re-run their forward first (False when fused)
    consumes: list[tuple] = field(default_factory=list)
    produces: list[tuple] = field(default_factory=list)
    weight_grads: bool = False  # sends weight gradients of bwd_layers down
    first_forward: bool = False  # B/I whose layers no forward task ran: it pays their forward
    split: bool = False  # a fused F + I: the weight gradient is left to a W task

    @property
    def layers(self) -> range:
        return layers_of(self.fwd_layers, self.bwd_layers)

    @classmethod
    def of(cls, device: int, op: FlowOp) -> Op:
        w = op.work
        return cls(
            device, op.label, w.kind, tuple(t.key for t in op.tasks), w.fwd_layers, w.bwd_layers, w.recompute,
            op.consumes, op.produces, w.weight_grads, w.first_forward, w.split,
        )  # fmt: skip


def device_ops(table: ScheduleTable, *, classic: bool = False) -> list[list[Op]]:
    """Per device, the operations the runtime issues for ``table``, in order: ``flow.device_flows``
    (which F and B run fused, what each consumes, produces and runs), one :class:`Op` each.

    ``classic=True`` is the textbook pipeline instead (the closed forms' setting): every forward
    task runs all its stage's layers, so a backward re-runs only layers marked ``recompute``. The
    runtime's last forward stage, unless fused, runs nothing at all (nobody needs its output) and
    its backward runs the head's forward too (``first_forward``).
    """
    return [[Op.of(d, op) for op in row] for d, row in enumerate(device_flows(table, full_forward=classic))]


__all__ = [
    "LayerWork",
    "Op",
    "Workload",
    "device_ops",
    "uniform_workload",
    "workload_from_costs",
]
