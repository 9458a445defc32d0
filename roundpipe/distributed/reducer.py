"""Summing the fp32 CPU gradients across data-parallel ranks, bucket by bucket, as each becomes final.

A *bucket* is a run of step groups (a group: the parameters whose gradient one layer's backward
makes final, see ``optim/adamw.py``) in canonical order, the highest layer first, cut at about
``RunConfig.dp_bucket_bytes`` and, when the optimizer is sharded, where the owning rank changes. The order is the
same on every rank whatever its schedule did, because gloo matches collectives by the order they
are issued in: the host thread marks groups final as their last gradient lands (``final``), and a
bucket is issued only when it and every bucket before it are complete.

Each bucket travels as one collective per large gradient, in place, and one flat fp32 tensor of
its small ones followed by one flag per entry of the bucket and one more element. An entry's flag
is 1 when this rank's backward produced a gradient for it (``has_grad``): the sum tells the
receiver whether any rank's did, so a parameter no rank's rows reach is skipped by AdamW as one
process on the whole batch skips it (``optim/adamw.py``), and one that some rank's rows reach is
stepped by every rank. The last element is 1 when this rank already knew of a non-finite value
when it issued the bucket. The sum tells every receiver whether any rank did,
so no rank steps a layer that another rank has found poisoned (as one process steps nothing once
it knows). Unsharded, it is an all-reduce and every rank steps every group; sharded, a reduce to
the bucket's owner, which steps it and broadcasts the new fp32 masters to the others.

The waits, the copies back and (when stepping eagerly) the steps run on one reduction thread,
while the host thread keeps adding the lower layers' gradients and gloo's threads move the bytes.
A sharded owner's broadcast is started after its step and waited for only at the end of the
backward, so the next buckets' steps do not queue behind it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from roundpipe.backend.threads import own_intra_op_threads
from roundpipe.distributed.group import DataParallel
from roundpipe.optim import MasterStore, grad_of, master_of

_DONE = object()
# A gradient (or master) of at least this many bytes is summed (or sent) in place, by its own
# collective; smaller ones are packed into one tensor per bucket. No bucket-sized copy of the large
# ones exists, however many buckets are in flight.
IN_PLACE_BYTES = 1 << 20


@dataclass(frozen=True)
class Bucket:
    groups: tuple[int, ...]  # step groups (owner layers), highest first
    keys: tuple[int, ...]  # their trainable entries, in order
    owner: int  # the rank that steps them (this rank when unsharded)
    numel: int


def plan_buckets(
    dp: DataParallel, store: MasterStore, groups: dict[int, list[int]], bucket_bytes: int
) -> list[Bucket]:
    """The buckets of ``groups`` (owner layer -> entry keys), in canonical order."""
    order = sorted(groups, reverse=True)
    numel = {g: sum(grad_of(store.entries[k]).numel() for k in groups[g]) for g in order}
    owners = dp.owners(order, {g: 4 * numel[g] for g in order})
    buckets: list[Bucket] = []
    run: list[int] = []

    def close():
        if run:
            keys = tuple(k for g in run for k in groups[g])
            buckets.append(Bucket(tuple(run), keys, owners[run[0]], sum(numel[g] for g in run)))
            run.clear()

    for g in order:
        if run and (owners[g] != owners[run[0]] or 4 * sum(numel[x] for x in run) >= bucket_bytes):
            close()
        run.append(g)
    close()
    return buckets


class GradientReduction:
    """One forward_backward's reduction.

    Args:
        dp: the group.
        store: whose ``grad`` buffers are summed (and whose masters a sharded owner broadcasts).
        buckets: ``plan_buckets``'s.
        known_nonfinite: whether this rank knows of a non-finite value yet (host thread).
        step_groups: ``step(groups)``: step these groups now (eager updates; reduction thread);
            None: the updates are deferred to ``step()``, which calls ``publish`` when sharded.
        recorder: puts each bucket's collective, from issue to arrival, on the timeline's host lane
            (kind ``reduce``), with the layer names ``names``.
    """

    def __init__(
        self,
        dp: DataParallel,
        store: MasterStore,
        buckets: list[Bucket],
        known_nonfinite: Callable[[], bool],
        step_groups: Callable[[tuple[int, ...]], None] | None,
        names: list[str],
        recorder=None,
    ):
        self.dp, self.store, self.buckets = dp, store, buckets
        self._recorder, self._names = recorder, names
        self._known_nonfinite, self._step_groups = known_nonfinite, step_groups
        self._bucket_of = {g: i for i, b in enumerate(buckets) for g in b.groups}
        self._left = [len(b.groups) for b in buckets]
        self._next = 0  # the first bucket not issued yet
        self.flagged = False  # a rank knew of a non-finite value when it issued a bucket this rank received
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._broadcasts: list[Callable[[], None]] = []  # sharded: owners' weights in flight
        self._thread = threading.Thread(target=self._loop, name="roundpipe-reduce", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ host thread
    def final(self, group: int) -> None:
        """Host thread: ``group``'s gradient is final on this rank; issue what became complete."""
        self._left[self._bucket_of[group]] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._issue(self.buckets[self._next])
            self._next += 1

    def _issue(self, b: Bucket) -> None:
        """Issue bucket ``b``'s collectives: one in place per large gradient (no copy of it exists),
        one for the small ones packed together with the entries' gradient flags and the
        non-finite flag."""
        entries = self.store.entries
        large, small = _in_place(self.store, b)
        flags = torch.tensor(
            [1.0 if entries[k].has_grad else 0.0 for k in b.keys] + [1.0 if self._known_nonfinite() else 0.0]
        )
        packed = torch.cat([grad_of(entries[k]).reshape(-1) for k in small] + [flags])
        what = f"summing the gradients of {self._label(b)}"

        def issue(t: torch.Tensor):
            if self.dp.sharded:
                return dist.reduce(t, dst=b.owner, group=self.dp.grads, async_op=True)
            return dist.all_reduce(t, group=self.dp.grads, async_op=True)

        works = [self.dp.collective(what, partial(issue, grad_of(entries[k]))) for k in large]
        works.append(self.dp.collective(what, lambda: issue(packed)))
        self._queue.put((b, small, packed, works, what, time.perf_counter()))

    # ------------------------------------------------------------------ reduction thread
    def _loop(self) -> None:
        own_intra_op_threads(1)
        while True:
            item = self._queue.get()
            if item is _DONE:
                self._finish_broadcasts()
                return
            if self.error is not None:
                continue
            b, small, packed, works, what, issued = item
            try:
                try:
                    for work in works:
                        work.wait()
                except BaseException as e:
                    raise self.dp.failed(what, e) from e
                if self._recorder is not None:
                    self._recorder.add_host_span(
                        f"reduce:{self._label(b)}", "reduce", issued, time.perf_counter()
                    )
                self._received(b, small, packed)
            except BaseException as e:  # carried to the caller by wait()
                self.error = e

    def _finish_broadcasts(self) -> None:
        broadcasts, self._broadcasts = self._broadcasts, []
        for finish in broadcasts:
            try:
                if self.error is None:
                    finish()
            except BaseException as e:
                self.error = e

    def _received(self, b: Bucket, small: list[int], packed: torch.Tensor) -> None:
        entries = self.store.entries
        mine = b.owner == self.dp.rank
        with torch.no_grad():
            if mine:  # the large gradients hold their sums already
                self.flagged |= bool(packed[-1] > 0)
                offset = 0
                for k in small:
                    g = grad_of(entries[k])
                    g.copy_(packed[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                for k, got in zip(b.keys, packed[offset:-1].tolist()):
                    entries[k].has_grad = got > 0  # some rank's backward produced a gradient
            else:  # sharded, another rank's: its owner steps it; this rank's share is spent
                for k in b.keys:
                    grad_of(entries[k]).zero_()
                    entries[k].has_grad = False
        if self._step_groups is None:
            return
        if mine and not self.flagged and not self._known_nonfinite():
            self._step_groups(b.groups)
        if self.dp.sharded:  # in flight while the next buckets are waited for and stepped
            self._broadcasts.append(broadcast_masters(self.dp, self.store, b))

    # ------------------------------------------------------------------ caller's thread
    def wait(self) -> None:
        """Wait until every issued bucket has been received (and stepped); re-raise the first error.
        Every bucket must have been issued (the backward completed)."""
        self._queue.put(_DONE)
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self._next != len(self.buckets):
            raise RuntimeError(
                f"the backward left {len(self.buckets) - self._next} gradient buckets unissued (groups "
                f"{[b.groups for b in self.buckets[self._next :]]}): a step group never became final"
            )

    def _label(self, b: Bucket) -> str:
        names = self._names
        return names[b.groups[0]] if len(b.groups) == 1 else f"{names[b.groups[-1]]}..{names[b.groups[0]]}"

    def abandon(self) -> None:
        """After a failed step: let the thread end (its waits fail once the group is torn down)."""
        self._queue.put(_DONE)


def broadcast_masters(dp: DataParallel, store: MasterStore, b: Bucket, group=None) -> Callable[[], None]:
    """Start sending the owner's fp32 masters of bucket ``b`` to every rank (large ones in place,
    small ones packed); the returned call waits for it and, on a receiver, refreshes its compute
    copies. Nothing reads a receiver's masters of ``b`` meanwhile: its backward is done, and
    the next step's uploads wait for this step to end."""
    entries = store.entries
    owner = b.owner == dp.rank
    large, small = _in_place(store, b)
    with torch.no_grad():
        if owner:
            packed = torch.cat([master_of(entries[k]).data.reshape(-1) for k in small] + [torch.zeros(1)])
        else:
            packed = torch.empty(1 + sum(master_of(entries[k]).numel() for k in small), dtype=torch.float32)
    what = f"sending the new weights of step groups {b.groups}"
    pg = group or dp.weights
    works = [
        dp.collective(
            what, partial(dist.broadcast, master_of(entries[k]).data, src=b.owner, group=pg, async_op=True)
        )
        for k in large
    ]
    works.append(dp.collective(what, lambda: dist.broadcast(packed, src=b.owner, group=pg, async_op=True)))

    def finish() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as e:
            raise dp.failed(what, e) from e
        if owner:
            return
        with torch.no_grad():
            offset = 0
            for k in small:
                m = master_of(entries[k]).data
                m.copy_(packed[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
            store.refresh_compute(b.keys)

    return finish


def _in_place(store: MasterStore, b: Bucket) -> tuple[list[int], list[int]]:
    """Bucket ``b``'s entries summed or sent in place (fp32, at least ``IN_PLACE_BYTES``), and the
    small ones packed together."""
    large = [k for k in b.keys if 4 * grad_of(store.entries[k]).numel() >= IN_PLACE_BYTES]
    in_place = set(large)
    return large, [k for k in b.keys if k not in in_place]
