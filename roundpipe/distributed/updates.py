"""What a data-parallel rank's optimizer needs from the others: which step groups it steps, and
the agreements a deferred update makes before stepping (every rank must skip or step alike, and
clip by the same norm).

Unsharded, the gradients are identical on every rank after the all-reduce, so each rank's own
figures are already global. Sharded, each rank holds the summed gradients of its own groups only:
the norm is the sum of every rank's part, the finiteness the agreement of all, and after stepping,
each owner broadcasts its new weights.
"""

from __future__ import annotations

from roundpipe.distributed.group import DataParallel
from roundpipe.distributed.reducer import Bucket, broadcast_masters
from roundpipe.optim import MasterStore


class RankUpdates:
    """``held``: the step groups this rank steps (its own when sharded, all otherwise)."""

    def __init__(self, dp: DataParallel, store: MasterStore, buckets: list[Bucket]):
        self.dp, self.store, self.buckets = dp, store, buckets
        self.held = {g for b in buckets if b.owner == dp.rank for g in b.groups}

    def all_finite(self, finite: bool) -> bool:
        """Whether every rank's held gradients are finite."""
        if not self.dp.sharded:
            return finite
        return self.dp.sum([0.0 if finite else 1.0], "agreeing on finite gradients")[0] == 0

    def norm_sq(self, held_norm_sq: float) -> float:
        """The squared norm of the whole gradient from this rank's part."""
        if not self.dp.sharded:
            return held_norm_sq
        return self.dp.sum([held_norm_sq], "summing the gradient norm")[0]

    def publish(self) -> None:
        """After a deferred update: every owner's new weights to every rank (sharded only)."""
        if self.dp.sharded:
            pending = [broadcast_masters(self.dp, self.store, b, group=self.dp.main) for b in self.buckets]
            for finish in pending:
                finish()
