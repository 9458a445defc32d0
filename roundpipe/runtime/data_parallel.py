"""A data-parallel rank's ``forward_backward``, ``evaluate`` and ``step``: the pipeline's own, on
this rank's rows of the global batch, with the counts made global and the gradients reduced.

What makes N ranks train exactly as one process on the whole batch:

- every rank passes the same global batch and takes its rows (``DataParallel.rows``);
- the backward seed divides by the *global* label-token count (one all-reduce before the step), so
  the summed gradients are those of the token-mean loss of the whole batch;
- each step group's gradient is summed across ranks as soon as it is final on this rank
  (``reducer.GradientReduction``), overlapped with the rest of the backward;
- after the step, the ranks gather their loss sums and whether each found a non-finite value, so
  every rank reports the same loss and stops or skips alike.

A MoE router's load-balancing loss is each rank's own, on its rows (as under DDP, where each
rank's auxiliary loss is its batch's); its gradients are summed like the others, each weighted by
the rank's share of the tokens, and the reported loss adds their token-weighted mean.

A rank on which any of this fails marks the group broken and closes its connections, so the peers'
collectives fail at once instead of waiting ``dp_timeout_s``; no further step runs on a broken group.

The Pipeline calls its own ``_forward_backward`` / ``_evaluate`` with this rank's rows and a
``step(reduce)`` of this object; nothing here reaches back into the Pipeline. The collectives
themselves live in ``roundpipe.distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from roundpipe.config import RunConfig
from roundpipe.distributed import DataParallel
from roundpipe.distributed.reducer import GradientReduction, plan_buckets
from roundpipe.distributed.updates import RankUpdates
from roundpipe.runtime.numerics import NonFinite
from roundpipe.runtime.optimizer_steps import OptimizerSteps
from roundpipe.runtime.report import Recorder
from roundpipe.runtime.store import ParameterStore


class DataParallelSteps:
    """The data-parallel side of a ``Pipeline``: its group ``dp``, and the store, optimizer steps
    and recorder of the pipeline it serves. Gives ``updates`` the groups this rank steps."""

    def __init__(
        self,
        dp: DataParallel,
        store: ParameterStore,
        updates: OptimizerSteps,
        recorder: Recorder,
        config: RunConfig,
    ):
        self.dp, self.store, self.updates, self.recorder, self.config = dp, store, updates, recorder, config
        self.buckets = plan_buckets(self.dp, store, updates.groups(), config.dp_bucket_bytes)
        self.rank_updates = updates.ranks = RankUpdates(self.dp, store, self.buckets)
        self._reduction: GradientReduction | None = None
        c = config
        self.dp.agree(
            {
                "dtype": c.dtype,
                "nan_policy": c.nan_policy,
                "optimizer_sharding": c.optimizer_sharding,
                "seed": c.seed,
                "parameters": [(e.name, tuple(e.tensor.shape), e.trainable) for e in store.entries],
                "gradient buckets": [(b.groups, b.numel) for b in self.buckets],
            }
        )

    def describe(self) -> str:
        """One line for ``pipe.plan``: the rank, the reduction, and what this rank's optimizer holds."""
        dp = self.dp
        held = self.rank_updates.held
        mine = sum(4 * b.numel for b in self.buckets if b.owner == dp.rank)
        total = sum(4 * b.numel for b in self.buckets)
        line = (
            f"rank {dp.rank} of {dp.world_size} (this rank's rows of every global batch), gradients summed in "
            f"{len(self.buckets)} bucket(s) of <= {_mib(self.config.dp_bucket_bytes)} MiB"
        )
        if dp.sharded:
            line += (
                f"; optimizer sharded: this rank steps {len(held)} of {len(self.updates.groups())} layer "
                f"groups, {_mib(mine)} of {_mib(total)} MiB of fp32 parameters, so AdamW state of "
                f"{_mib(2 * mine)} MiB instead of {_mib(2 * total)} MiB"
            )
        return line

    @contextlib.contextmanager
    def failing(self, what: str):
        """Run a step's part; on any error break the group (see the module docstring) and re-raise."""
        self.dp.check()
        try:
            yield
        except BaseException as e:
            if self._reduction is not None:
                self._reduction.abandon()
                self._reduction = None
            self.dp.fail(f"{what} raised {type(e).__name__} on rank {self.dp.rank}")
            raise

    def step(self, reduce: bool) -> RankStep:
        """One call's collectives: ``reduce`` for a ``forward_backward`` that ends an optimizer
        step (not ``accumulate=True``), False for an evaluation."""
        return RankStep(self, reduce)

    def rows_of(self, input_ids, labels, attention_mask, position_ids) -> tuple[Any, Any, Any, Any]:
        """This rank's rows of a global batch's tensors (``forward_backward``'s four); a malformed
        batch stays whole for the pipeline's own checks to name."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            return input_ids, labels, attention_mask, position_ids
        rows = self.dp.rows(input_ids.shape[0])
        return (
            _take(input_ids, rows),
            _take(labels, rows),
            _take(attention_mask, rows),
            _take(position_ids, rows),
        )


class RankStep:
    """One call's collectives (see ``DataParallelSteps``); ``reduce``: sum the gradients (the last
    call of an optimizer step; ``accumulate=True`` calls keep theirs local)."""

    def __init__(self, owner: DataParallelSteps, reduce: bool):
        self.owner, self.dp, self.reduce = owner, owner.dp, reduce

    def global_tokens(self, mine: int) -> int:
        return int(self.dp.sum([float(mine)], "counting the label tokens of the global batch")[0])

    def sums(self, values: list[float], what: str) -> list[float]:
        return self.dp.sum(values, what)

    def attach(self, step) -> None:
        """Before the step runs: hand its final gradients to a new reduction."""
        if not self.reduce:
            return
        updates = self.owner.updates

        def step_groups(groups):
            for g in groups:
                updates.step_group(g)

        reduction = GradientReduction(
            self.dp,
            self.owner.store,
            self.owner.buckets,
            known_nonfinite=lambda: bool(step.nonfinite),
            step_groups=step_groups if step.eager else None,
            recorder=self.owner.recorder,
            names=updates.names,
        )
        self.owner._reduction = step.reduction = reduction
        for g, left in step.group_left.items():
            if left == 0:  # no gradient reaches it this call: final already
                reduction.final(g)

    def finish(self) -> None:
        """After the step's work: every bucket received (and stepped when eager)."""
        if self.owner._reduction is not None:
            self.owner._reduction.wait()
            self.owner._reduction = None

    def agree(
        self, loss_sum: float, found: NonFinite | None, router_sum: float
    ) -> tuple[float, NonFinite | None, float]:
        """The global loss sum, the first non-finite value any rank found (the lowest rank's), and
        the sum of ``router_sum`` (each rank's router loss times its tokens)."""
        every = self.dp.gather([loss_sum, 0.0 if found is None else 1.0, router_sum], "gathering the losses")
        total, router = sum(v[0] for v in every), sum(v[2] for v in every)
        if not any(v[1] for v in every):
            return total, None, router
        finds = self.dp.all_gather_object(found)
        rank, first = next((r, f) for r, f in enumerate(finds) if f is not None)
        return total, dataclasses.replace(first, device=f"{first.device} of rank {rank}"), router


def _take(t, rows: slice):
    return t[rows] if torch.is_tensor(t) and t.dim() >= 1 else t


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"
