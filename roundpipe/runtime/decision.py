"""What the runtime decided for a batch shape, and the printable report of it.

A ``Decision`` (made by ``planning.Planner``) is the policy, both partitions and the microbatch
count of a batch shape, each with a one-line reason; ``RuntimePlan`` is what ``pipe.plan`` shows of
it: the stages with their estimated time and bytes, the reasons and the automatic choice's
fastest candidates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from roundpipe.runtime.store import ParameterStore
from roundpipe.schedule import Partition, TaskKind


@dataclass(frozen=True)
class Decision:
    """What a batch shape runs and why: ``why`` has one line per part (``policy``, ``partition``,
    ``num_microbatches``). ``choice`` holds the predictions behind an automatic choice."""

    policy: str
    forward: Partition
    backward: Partition
    num_microbatches: int | None  # None: "auto" before any batch was seen (only in reports)
    why: dict[str, str] = field(default_factory=dict)
    choice: object = None  # roundpipe.sim.choice.Choice


def for_short_batch(decision: Decision, batch: int, num_devices: int) -> Decision:
    """``decision`` for an evaluation batch of ``batch`` samples: with fewer samples than its
    microbatch count, the most microbatches the policy takes, at most one per sample (a held-out
    set's last, short batch). A training batch keeps its count (``split_batch`` refuses it)."""
    from roundpipe.schedule.policies import POLICIES

    m, spec = decision.num_microbatches, POLICIES.get(decision.policy)
    if m is None or m <= batch or spec is None:
        return decision
    fits = [k for k in range(batch, 0, -1) if spec.accepts_microbatches(k, num_devices)]
    if not fits:
        return decision
    why = f"{fits[0]}: an evaluation batch of {batch} samples, fewer than the {m} a training batch runs"
    return replace(decision, num_microbatches=fits[0], why={**decision.why, "num_microbatches": why})


@dataclass(frozen=True)
class RuntimePlan:
    """What the runtime will run: the policy, the stages of both partitions with their estimated
    cost, the microbatch count, and why each was chosen.

    ``est_s`` is per microbatch from measured layer times (None before ``profile``); ``weight_bytes``
    in the run dtype; ``peak_bytes`` a worker's bound for that stage: its weights, the next stage's
    (prefetched), and its fp32 weight-gradient accumulator. ``why`` has one line each for
    ``policy``, ``partition`` and ``num_microbatches``; ``predictions`` the fastest five candidates of an
    automatic choice (policy, count, stages, predicted step seconds), followed by the chosen one when
    it is not among them (the tie rule and the repeatability rule can pick a slower candidate).
    """

    policy: str
    devices: tuple[str, ...]
    rows: tuple[dict, ...]
    num_microbatches: int | None = None
    why: dict = field(default_factory=dict)
    predictions: tuple[dict, ...] = ()

    @classmethod
    def build(
        cls,
        decision: Decision,
        names: list[str],
        times: dict[str, tuple[float, float]] | None,
        store: ParameterStore,
        devices: tuple[str, ...],
        predictions: tuple[dict, ...],
    ) -> RuntimePlan:
        """``decision``'s report: ``names`` and measured ``times`` of the layers (None before
        ``profile``), the ``store`` for their bytes, the ``devices`` and the shown ``predictions``."""
        wbytes = store.layer_bytes
        rows = []
        for kind, part in ((TaskKind.F, decision.forward), (TaskKind.B, decision.backward)):
            stage_w = [sum(wbytes[i] for i in part.layers(s)) for s in range(part.num_stages)]
            for s in range(part.num_stages):
                layers = part.layers(s)
                est = None
                if times is not None:
                    est = sum(
                        times[names[i]][0]
                        + (times[names[i]][1] + times[names[i]][0] if kind == TaskKind.B else 0)
                        for i in layers
                    )
                grads = (
                    0
                    if kind == TaskKind.F
                    else sum(4 * e.tensor.numel() for e in store.entries if e.trainable and e.owner in layers)
                )
                nxt = stage_w[s + 1] if s + 1 < part.num_stages else 0
                rows.append(
                    {
                        "kind": kind,
                        "stage": s,
                        "layers": f"{names[layers.start]}..{names[layers.stop - 1]}"
                        if len(layers) > 1
                        else names[layers.start],
                        "num_layers": len(layers),
                        "est_s": est,
                        "weight_bytes": stage_w[s],
                        "peak_bytes": stage_w[s] + nxt + grads,
                    }
                )
        return cls(
            decision.policy,
            devices,
            tuple(rows),
            decision.num_microbatches,
            dict(decision.why),
            predictions,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "policy": self.policy,
                "devices": list(self.devices),
                "num_microbatches": self.num_microbatches,
                "why": self.why,
                "predictions": list(self.predictions),
                "stages": list(self.rows),
            },
            indent=2,
        )

    def table(self) -> str:
        m = "auto" if self.num_microbatches is None else self.num_microbatches
        lines = [
            f"plan: policy {self.policy} on {', '.join(self.devices)}, {m} microbatch{'' if m == 1 else 'es'}",
            *(f"  {part}: {line}" for part, line in self.why.items()),
            f"{'stage':>6}  {'layers':<24} {'est. ms':>9} {'weights MiB':>12} {'peak MiB':>9}",
        ]
        for r in self.rows:
            est = "-" if r["est_s"] is None else f"{r['est_s'] * 1e3:.2f}"
            lines.append(
                f"{r['kind']}{r['stage']:>5}  {r['layers']:<24} {est:>9} {r['weight_bytes'] / 2**20:>12.2f} {r['peak_bytes'] / 2**20:>9.2f}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
