"""What the simulator replays: per-layer times and bytes, and per-task operations of a table.

A :class:`Workload` is the model cut into layers (the runtime's layer list) for one microbatch
shape: for each layer its forward and backward seconds and the bytes that move or sit somewhere.
Build one from the analytic cost model (:func:`workload_from_costs`, optionally with measured
per-layer times keyed by layer name, exactly like ``partition.layer_times(..., times=...)``) or
synthetically (:func:`uniform_workload`, what the closed-form checks use).

:func:`device_ops` turns a schedule table into per-device operations following the runtime's data
flow (``roundpipe/runtime/plan.py``: which hand-offs a task consumes and produces, which F and B
run fused, which layers each runs forward and backward). Keys are ``("act", boundary, mb)`` (the
input of layer ``boundary``) and ``("grad", boundary, mb)`` (the gradient w.r.t. it).
:func:`plan_work` is the same plan with what every microbatch of a stage shares factored out into
one :class:`StageWork` per kind and stage; the simulator builds from it, so its setup does the
per-stage work once instead of once per task.

Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import LayerCost, layer_times, model_totals
from roundpipe.presets import GPU, Server
from roundpipe.schedule.deps import TaskKey
from roundpipe.schedule.table import ScheduleTable, Task

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

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def workload_from_costs(
    costs: Sequence[LayerCost],
    hw: GPU | Server,
    *,
    times: Mapping[str, tuple[float, float]] | None = None,
    efficiency: float | None = None,
    name: str = "model",
) -> Workload:
    """Per-layer times from ``layer_times`` (analytic, or ``times[name] = (forward_s, backward_s)``
    measured for one microbatch, backward without recompute) and bytes from the cost model."""
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
                trainable_params=c.optimizer_bytes // 12,
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
    )


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


def _layers_of(fwd_layers: range, bwd_layers: range) -> range:
    """Every layer run forward or backward: the weights an operation needs on its device."""
    spans = [r for r in (fwd_layers, bwd_layers) if len(r)]
    if not spans:
        return range(0)
    return range(min(r.start for r in spans), max(r.stop for r in spans))


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
        return _layers_of(self.fwd_layers, self.bwd_layers)


@dataclass(frozen=True)
class StageWork:
    """What a task of one kind and stage (or the fused head pair) runs and moves: an :class:`Op`
    without its device, microbatch and label, the same for every microbatch. Hand-offs are
    ``(name, boundary)``; the op of microbatch ``j`` moves ``(name, boundary, j)``."""

    kind: str
    fwd_layers: range = range(0)
    bwd_layers: range = range(0)
    recompute: bool = True
    consumes: tuple[tuple[str, int], ...] = ()
    produces: tuple[tuple[str, int], ...] = ()
    weight_grads: bool = False
    first_forward: bool = False
    split: bool = False

    @property
    def layers(self) -> range:
        return _layers_of(self.fwd_layers, self.bwd_layers)

    def op(self, device: int, label: str, tasks: tuple[TaskKey, ...], microbatch: int) -> Op:
        j = microbatch
        return Op(
            device, label, self.kind, tasks, self.fwd_layers, self.bwd_layers, self.recompute,
            [(name, b, j) for name, b in self.consumes], [(name, b, j) for name, b in self.produces],
            self.weight_grads, self.first_forward, self.split,
        )  # fmt: skip


def device_ops(table: ScheduleTable, *, classic: bool = False) -> list[list[Op]]:
    """Per device, the operations the runtime issues for ``table``, in order (see module docstring).

    ``classic=True`` is the textbook pipeline instead (the closed forms' setting): every forward
    task runs all its stage's layers, so a backward re-runs only layers marked ``recompute``. The
    runtime's last forward stage, unless fused, runs nothing at all (nobody needs its output) and
    its backward runs the head's forward too (``first_forward``).

    Mirrors ``roundpipe/runtime/plan.py``: ``F(last_f, j)`` directly followed by the last backward
    stage's ``B``/``I`` of the same microbatch is one fused op (forward ``[a, c)``, forward+backward
    ``[c, n)`` without recompute); a forward stage leaves its output boundary and every backward
    stage start inside it on the host and runs only as far as the last of them; a backward stage
    ``[c, d)`` consumes ``act[c]`` and ``grad[d]`` and produces ``grad[c]``. With the backward
    split, ``I`` does that and ``W`` (weight gradients) needs nothing but its ``I``.
    """
    return [
        [
            work.op(d, "+".join(map(str, tasks)), tuple(t.key for t in tasks), tasks[0].microbatch)
            for work, tasks in row
        ]
        for d, row in enumerate(plan_work(table, classic=classic))
    ]


def plan_work(
    table: ScheduleTable, *, classic: bool = False
) -> list[list[tuple[StageWork, tuple[Task, ...]]]]:
    """What :func:`device_ops` describes, with the per-stage part shared: per device, in order, each
    operation as ``(work, tasks)``, its :class:`StageWork` (one object per kind and stage) and its
    one or two tasks of the table. For callers that would otherwise redo per-stage work for every
    microbatch (the simulator)."""
    fwd, bwd = table.forward, table.backward
    last_f, last_b = fwd.num_stages - 1, bwd.num_stages - 1
    fusable = fwd.bounds[last_f] <= bwd.bounds[last_b]
    works: dict[tuple[str, int], StageWork] = {}  # (kind, stage) -> its work; ("FB", 0 or 1) fused

    def work(kind: str, stage: int) -> StageWork:
        w = works.get((kind, stage))
        if w is None:
            w = works[(kind, stage)] = _stage_work(table, kind, stage, classic)
        return w

    out = []
    for row in table.devices:
        ops = []
        i = 0
        while i < len(row):
            t, nxt = row[i], row[i + 1] if i + 1 < len(row) else None
            if (
                fusable
                and t.kind == "F"
                and t.stage == last_f
                and nxt is not None
                and nxt.kind in ("B", "I")
                and nxt.stage == last_b
                and nxt.microbatch == t.microbatch
            ):
                ops.append((work("FB", int(nxt.kind == "I")), (t, nxt)))
                i += 2
            else:
                ops.append((work(t.kind, t.stage), (t,)))
                i += 1
        out.append(ops)
    return out


def _stage_work(table: ScheduleTable, kind: str, stage: int, classic: bool) -> StageWork:
    """The work of a task of ``kind`` at ``stage`` (``"FB"``: the fused head, ``stage`` 1 when its
    backward is split), following the runtime's data flow (see :func:`device_ops`)."""
    fwd, bwd = table.forward, table.backward
    n = fwd.num_layers
    last_b = bwd.num_stages - 1
    starts = list(bwd.bounds[1:-1])  # backward-stage starts inside the model, ascending

    def starts_inside(lo: int, hi: int) -> list[int]:
        return starts[bisect_right(starts, lo) : bisect_left(starts, hi)]

    if kind == "FB":
        a, c = fwd.bounds[fwd.num_stages - 1], bwd.bounds[last_b]
        produces = [("act", b) for b in starts_inside(a, c)] + ([("grad", c)] if c > 0 else [])
        return StageWork(
            "FB", range(a, c), range(c, n), recompute=False, consumes=(("act", a),) if a > 0 else (),
            produces=tuple(produces), weight_grads=not stage, split=bool(stage),
        )  # fmt: skip
    if kind == "F":
        a, e = fwd.bounds[stage], fwd.bounds[stage + 1]
        outs = starts_inside(a, e) + ([e] if e < n else [])
        run_to = e if classic else (outs[-1] if outs else a)
        consumes = (("act", a),) if a > 0 else ()
        return StageWork("F", range(a, run_to), consumes=consumes, produces=tuple(("act", b) for b in outs))
    c, e = bwd.bounds[stage], bwd.bounds[stage + 1]
    if kind in ("B", "I"):
        consumes = ([("act", c)] if c > 0 else []) + ([("grad", e)] if stage < last_b else [])
        return StageWork(
            kind, bwd_layers=range(c, e), consumes=tuple(consumes), produces=(("grad", c),) if c > 0 else (),
            weight_grads=kind == "B", first_forward=stage == last_b and not classic,
        )  # fmt: skip
    # W: weight gradients of a stage whose I ran before, on this device
    return StageWork("W", bwd_layers=range(c, e), weight_grads=True)


__all__ = [
    "LayerWork",
    "Op",
    "StageWork",
    "Workload",
    "device_ops",
    "plan_work",
    "uniform_workload",
    "workload_from_costs",
]
