"""The batch's router statistics, gathered from every device for the load-balancing loss.

Each op that runs a router layer's forward for a microbatch first (an F, or a backward that runs
a forward no F ran) computes that pair's ``[C, S, N]`` (``models/router_loss.py``) and downloads it;
it *puts* the pair here when it has issued the download, with the event that fires when the copy is
done (as the exchange's hand-offs). A backward over router layers needs the batch's totals: it
waits until every pair but the ones it computes itself has been put, synchronizes their copies and
sums them on the host. The schedule guarantees this wait ends (``runs_forwards_first``); an abort
ends it with ``AbortedWait``.

After the step the host adds every pair for the loss the call returns (``coef * aux``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from roundpipe.backend import Event
from roundpipe.models.base import ModelAdapter
from roundpipe.models.router_loss import RouterLoss
from roundpipe.runtime.exchange import AbortedWait, Exchange, Slot
from roundpipe.runtime.plan import TaskFlow

Pair = tuple[int, int]  # (layer index, microbatch)


def router_layers(adapter: ModelAdapter, layers: Iterable[int]) -> list[int]:
    """The layers of ``layers`` that hold routers."""
    return [i for i in layers if getattr(adapter.layers[i], "routers", ())]


def router_pairs(adapter: ModelAdapter, flow: TaskFlow) -> list[Pair]:
    """The (router layer, microbatch) pairs whose statistics the op ``flow`` computes: the forwards
    it runs first, in the order it runs them."""
    first = list(flow.layers_fwd) + (list(flow.layers_bwd) if flow.first_forward else [])
    return [(i, flow.task.microbatch) for i in router_layers(adapter, first)]


class RouterTotals:
    """``expected``: every (router layer, microbatch) of the step; ``seed``: the gradient of the
    step's objective with respect to ``coef * aux`` (the loss scale times the batch's share of the
    step's label tokens)."""

    def __init__(self, loss: RouterLoss, expected: set[Pair], seed: float, exchange: Exchange, release):
        self.loss, self.expected, self.seed = loss, frozenset(expected), seed
        self._exchange, self._release = exchange, release
        self._put: dict[Pair, tuple[Slot, int, Event | None]] = {}  # pair -> (slot, row, event)
        self._cond = threading.Condition()

    @classmethod
    def of_step(
        cls, adapter, microbatches: int, seed: float, exchange: Exchange, release
    ) -> RouterTotals | None:
        """The totals of a step over ``microbatches``, or None when ``adapter`` adds no router loss."""
        if adapter.router_loss is None:
            return None
        routers = [layer.index for layer in adapter.layers if getattr(layer, "routers", ())]
        expected = {(i, j) for i in routers for j in range(microbatches)}
        return cls(adapter.router_loss, expected, seed, exchange, release)

    def put(self, pairs: list[Pair], slot: Slot, event: Event | None) -> None:
        """Worker thread: ``slot.value`` (host ``[len(pairs), width]``) will hold ``pairs``' stats once
        ``event`` fires."""
        with self._cond:
            for row, pair in enumerate(pairs):
                self._put[pair] = (slot, row, event)
            self._cond.notify_all()
        self._exchange.notify()  # a ready-order worker may wait for these

    def ready(self, own: set[Pair]) -> bool:
        """Whether every pair but ``own`` has been put."""
        with self._cond:
            return all(p in self._put for p in self.expected - own)

    def totals(self, own: set[Pair], is_aborted) -> torch.Tensor:
        """Block until every pair but ``own`` is put, wait for their copies, and return their sum
        (host fp32 ``[width]``). Raises AbortedWait when the pipeline aborts meanwhile."""
        need = self.expected - own
        with self._cond:
            while not all(p in self._put for p in need):
                if is_aborted():
                    raise AbortedWait("abandoned waiting for the router statistics of the batch")
                self._cond.wait(0.05)
            entries = [self._put[p] for p in sorted(need)]
        total = torch.zeros(self.loss.width, dtype=torch.float32)
        for slot, row, event in entries:
            if event is not None:
                event.synchronize()
            total += slot.value[row]
        return total

    def value(self) -> float:
        """Host, after the step: the batch's ``coef * aux``; gives the download buffers back."""
        total = self.totals(set(), lambda: False)
        for slot in {id(s): s for s, _, _ in self._put.values()}.values():
            if slot.value is not None:
                self._release(slot.value)
                slot.value = None
        return self.loss.value(total)
