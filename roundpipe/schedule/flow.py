"""The data flow of a schedule table: per device, the ops it runs and the hand-offs they move.

The one place these rules are written; the runtime (``runtime/plan.py`` turns the ops into its
workers' task flows) and the simulator (``sim/operations.py`` costs them, ``sim/engine.py`` replays
them) both read them, so the two run the same ops.

- **Fusion.** ``F(last_f, j)`` directly followed in a device row by the last backward stage's
  ``B(last_b, j)`` (or ``I``) of the same microbatch is one *fused* op, provided the last forward
  stage starts at or before the last backward stage (``a <= c``, so the forward covers every layer
  the backward needs): ``[a, c)`` forward without autograd, then the head part ``[c, n)`` forward
  and backward once with autograd, no recompute. Fusing changes no dependency (``deps.py``).
- **Hand-offs.** ``("act", b, j)`` is the input of layer ``b`` for microbatch ``j``, ``("grad", b,
  j)`` the gradient w.r.t. it; boundary 0 is the batch itself and never a hand-off. A forward stage
  ``[a, e)`` consumes ``act[a]`` and produces ``act[e]`` (not at the model's end: the head's
  backward makes the loss) and ``act`` at every backward-stage start inside ``(a, e)``; it runs
  forward only as far as the last of them. A backward stage ``[c, d)`` consumes ``act[c]`` and
  ``grad[d]`` (the last stage needs no gradient) and produces ``grad[c]``. With the backward split,
  ``I`` does what ``B`` does and ``W`` (weight gradients) needs nothing but its ``I``.

(Where a rotating policy's next deal starts is ``rotation.py``: it asks the policy registry, which
this module, below the table, does not import.)

Per-stage facts are shared: :func:`device_flows` makes one :class:`StageWork` per kind and stage
(and one for the fused head) and hands out the same object for every microbatch, so a caller can
key per-stage work on it.

Pure Python, no torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from roundpipe.schedule.table import ScheduleTable, Task

StageHandOff = tuple[str, int]  # ("act" or "grad", boundary): the same for every microbatch
HandOffKey = tuple[str, int, int]  # ("act" or "grad", boundary, microbatch)
FUSED = "FB"  # the kind of an op running a microbatch's last F and last B (or I) back to back


def layers_of(fwd_layers: range, bwd_layers: range) -> range:
    """Every layer run forward or backward: the weights an op needs on its device."""
    spans = [r for r in (fwd_layers, bwd_layers) if len(r)]
    if not spans:
        return range(0)
    return range(min(r.start for r in spans), max(r.stop for r in spans))


@dataclass(frozen=True)
class StageWork:
    """What an op of one kind and stage runs and moves, the same for every microbatch.

    ``kind`` is ``F``, ``B``, ``I``, ``W`` or ``FB`` (the fused head). Hand-offs are ``(name,
    boundary)``; the op of microbatch ``j`` moves ``(name, boundary, j)``.
    """

    kind: str
    fwd_layers: range = range(0)  # run forward without autograd
    bwd_layers: range = range(0)  # run with autograd and backpropagated
    recompute: bool = True  # bwd_layers re-run their forward first (False when fused)
    consumes: tuple[StageHandOff, ...] = ()
    produces: tuple[StageHandOff, ...] = ()
    weight_grads: bool = False  # makes the weight gradients of bwd_layers
    first_forward: bool = False  # B/I whose layers no forward task ran: it runs their forward too
    split: bool = False  # a fused F + I: the weight gradient is left to a W task

    @property
    def layers(self) -> range:
        return layers_of(self.fwd_layers, self.bwd_layers)


class FlowOp(NamedTuple):
    """One op of a device row: its work and its task, or the ``(F, B or I)`` pair a fused op runs.
    Unpacks as ``work, tasks``."""

    work: StageWork
    tasks: tuple[Task, ...]

    @property
    def task(self) -> Task:
        return self.tasks[0]

    @property
    def fused(self) -> bool:
        return len(self.tasks) == 2

    @property
    def microbatch(self) -> int:
        return self.tasks[0].microbatch

    @property
    def label(self) -> str:
        """``F3.1``, or ``F3.1+B5.1`` for a fused op."""
        return "+".join(map(str, self.tasks))

    @property
    def consumes(self) -> list[HandOffKey]:
        j = self.tasks[0].microbatch
        return [(name, b, j) for name, b in self.work.consumes]

    @property
    def produces(self) -> list[HandOffKey]:
        j = self.tasks[0].microbatch
        return [(name, b, j) for name, b in self.work.produces]


# ----------------------------------------------------------------------------- fusion
def _head_fusable(table: ScheduleTable) -> bool:
    """The last forward stage starts at or before the last backward stage."""
    fwd, bwd = table.forward, table.backward
    return fwd.bounds[fwd.num_stages - 1] <= bwd.bounds[bwd.num_stages - 1]


def _fuses(t: Task, nxt: Task | None, last_f: int, last_b: int) -> bool:
    """``t`` is the last forward stage's F and ``nxt`` the last backward stage's B or I of the same
    microbatch (the caller has checked ``_head_fusable``)."""
    return (
        t.kind == "F"
        and t.stage == last_f
        and nxt is not None
        and nxt.kind in ("B", "I")
        and nxt.stage == last_b
        and nxt.microbatch == t.microbatch
    )


def fused_pairs(table: ScheduleTable) -> list[tuple[Task, Task]]:
    """The ``(F, B or I)`` pairs of ``table`` that run as one fused op, device by device."""
    if not _head_fusable(table):
        return []
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    return [
        (t, nxt) for row in table.devices for t, nxt in zip(row, row[1:]) if _fuses(t, nxt, last_f, last_b)
    ]


# ----------------------------------------------------------------------------- ops
def stage_work(
    table: ScheduleTable, kind: str, stage: int, *, full_forward: bool = False, frozen: int = 0
) -> StageWork:
    """The work of an op of ``kind`` at ``stage`` (``"FB"``: the fused head, ``stage`` 1 when its
    backward is split into I and W, else 0).

    ``full_forward=True`` runs every forward task over its whole stage (the runtime's profiling
    run; the closed forms' textbook pipeline) instead of only as far as a hand-off needs; then no
    backward runs a forward that no F ran (``first_forward`` is False).

    ``frozen``: the first ``frozen`` layers train nothing (LoRA leaves the embedding frozen). A
    backward stage inside them has nothing to do (no work, no hand-offs), and no stage hands a
    gradient down into them: the gradient w.r.t. the input of layer ``c`` is made only when a layer
    below ``c`` trains (``c > frozen``).
    """
    fwd, bwd = table.forward, table.backward
    n = fwd.num_layers
    last_b = bwd.num_stages - 1
    # Backward-stage starts inside the model, ascending, of the stages that run (not all frozen).
    starts = [c for c, d in zip(bwd.bounds[1:-1], bwd.bounds[2:]) if d > frozen]

    def starts_inside(lo: int, hi: int) -> list[int]:
        return starts[bisect_right(starts, lo) : bisect_left(starts, hi)]

    if kind == FUSED:
        a, c = fwd.bounds[fwd.num_stages - 1], bwd.bounds[last_b]
        produces = [("act", b) for b in starts_inside(a, c)] + ([("grad", c)] if c > frozen else [])
        return StageWork(
            FUSED, range(a, c), range(c, n), recompute=False, consumes=(("act", a),) if a > 0 else (),
            produces=tuple(produces), weight_grads=not stage, split=bool(stage),
        )  # fmt: skip
    if kind == "F":
        a, e = fwd.bounds[stage], fwd.bounds[stage + 1]
        outs = starts_inside(a, e) + ([e] if e < n else [])
        run_to = e if full_forward else (outs[-1] if outs else a)
        consumes = (("act", a),) if a > 0 else ()
        return StageWork("F", range(a, run_to), consumes=consumes, produces=tuple(("act", b) for b in outs))
    c, d = bwd.bounds[stage], bwd.bounds[stage + 1]
    if d <= frozen and stage < last_b:  # nothing below or in it trains: nothing to compute or move
        return StageWork(kind)
    if kind in ("B", "I"):
        reads = ([("act", c)] if c > 0 else []) + ([("grad", d)] if stage < last_b else [])
        return StageWork(
            kind, bwd_layers=range(c, d), consumes=tuple(reads),
            produces=(("grad", c),) if c > frozen else (), weight_grads=kind == "B",
            first_forward=stage == last_b and not full_forward,
        )  # fmt: skip
    # W: the weight gradients of a stage whose I ran before it
    return StageWork("W", bwd_layers=range(c, d), weight_grads=True)


def device_flows(
    table: ScheduleTable, *, fuse: bool = True, full_forward: bool = False, frozen: int = 0
) -> list[list[FlowOp]]:
    """Per device, in row order, the ops that run ``table`` (see the module docstring).

    ``fuse=False`` runs the head's F and B as separate ops even when the rule would fuse them
    (profiling times them apart); ``full_forward`` and ``frozen`` as in :func:`stage_work`. Ops of
    one kind and stage share one :class:`StageWork` object.
    """
    last_f, last_b = table.forward.num_stages - 1, table.backward.num_stages - 1
    fusing = fuse and _head_fusable(table)
    works: dict[tuple[str, int], StageWork] = {}  # (kind, stage) -> its work; ("FB", 0 or 1) fused

    def work(kind: str, stage: int) -> StageWork:
        w = works.get((kind, stage))
        if w is None:
            w = works[(kind, stage)] = stage_work(
                table, kind, stage, full_forward=full_forward, frozen=frozen
            )
        return w

    make = tuple.__new__  # FlowOp(work, tasks) without the Python-level __new__: one per task
    out = []
    for row in table.devices:
        ops = []
        i = 0
        while i < len(row):
            t, nxt = row[i], row[i + 1] if i + 1 < len(row) else None
            if fusing and nxt is not None and _fuses(t, nxt, last_f, last_b):
                ops.append(make(FlowOp, (work(FUSED, int(nxt.kind == "I")), (t, nxt))))
                i += 2
            else:
                ops.append(make(FlowOp, (work(t.kind, t.stage), (t,))))
                i += 1
        out.append(ops)
    return out


def hand_off_first(key: tuple, forward_bounds) -> bool:
    """Whether a produced hand-off (``(name, boundary, ...)``) goes down in a task's first download:
    a gradient, or the output of a forward stage (``boundary`` in ``forward_bounds``), which the
    next stage's compute waits for; the other activations a task produces are backward stages'
    inputs saved for their recompute, downloaded after, so that the next stage does not wait for
    them (the simulator's two download groups, the runtime's two downloads)."""
    return key[0] == "grad" or key[1] in forward_bounds


def consumer_counts(flows: list[list[FlowOp]]) -> Counter:
    """How many ops consume each hand-off key: when its host copy can be freed."""
    return Counter(k for row in flows for op in row for k in op.consumes)


__all__ = [
    "FlowOp",
    "HandOffKey",
    "StageHandOff",
    "StageWork",
    "consumer_counts",
    "device_flows",
    "fused_pairs",
    "hand_off_first",
    "layers_of",
    "stage_work",
]
