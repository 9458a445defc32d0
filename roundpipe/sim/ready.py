"""``SimOptions(order="ready")``: a device runs the first operation, in table order, that is ready.

The runtime's ``RunConfig(order="ready")`` lets a worker issue the first of its remaining tasks whose
inputs are there, the table being only a hint. The engine models it with a commit point per device:
operations before ``slot[d]`` have their place in the device's order; when the last of them has
started (the moment a strict device would issue the next one's inputs, one operation ahead), the
device commits to the first later operation whose tasks' dependencies have finished and whose
inputs are on the host, and moves it to ``slot[d]``. Nothing ready: it waits, and tries again when
a dependency finishes or an input arrives.

What the move keeps true, so the rest of the engine runs unchanged:

- a device commits only within the step of its next table operation, and a streaming device
  (weights uploaded per group, ``roundpipe``) only within its weight group: the next group's
  weights are the ones being prefetched, and the group's last operation frees them;
- the weight group's last operation (which frees or prefetches weights), the step's last operation
  (which drops a resident device's weights) and, of operations summing the same layers' weight
  gradients, the first to run (it opens the buffer) and the last (it sends it down) are whichever
  run so in the new order;
- a committed operation whose weight group is not yet uploading gets its upload started.

The readiness it models is the ideal one (an input counts once its producer's download is done);
the runtime's worker counts a hand-off once its producer has issued it, a few tasks earlier.
Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from roundpipe.sim.operations import OpState


class Replay(Protocol):
    """What the ready order reads and calls on the simulation it orders (``engine._Sim``)."""

    n_dev: int
    ops: list[list[OpState]]  # per device, its operations, in the order they run (ReadyOrder moves them)
    stream: list[bool]  # per device, whether it streams its weights group by group
    eligible: list[int]  # per device, the weight groups whose uploads may start

    def make_eligible(self, d: int, upto: int) -> None: ...

    def check_inputs(self, st: OpState) -> None: ...


class ReadyOrder:
    """The commit points of every device of one simulation (``sim``)."""

    def __init__(self, sim: Replay):
        self.sim = sim
        self.slot = [0] * sim.n_dev
        self.moved = 0  # operations that ran ahead of one before them in the table
        for ops in sim.ops:
            for st in ops:
                st.lookahead_ok = False  # inputs upload once the operation is committed

    def committed(self, d: int, i: int) -> bool:
        return i < self.slot[d]

    def fill(self, d: int) -> None:
        """Commit device ``d``'s next operation if the one before it has started and one is ready."""
        sim, k = self.sim, self.slot[d]
        ops = sim.ops[d]
        if k >= len(ops) or (k > 0 and ops[k - 1].started < 0):
            return
        j = self._first_ready(d, k)
        if j is None:
            return
        if j != k:
            self._move(ops, j, k)
            self.moved += 1
        st = ops[k]
        self.slot[d] = k + 1
        if st.run is not None:  # ops summing the same weight gradients: first opens, last sends
            others = [o for o in st.run if o is not st]
            st.alloc = not any(o.pos < k for o in others)
            st.flush = all(o.pos < k for o in others)
        if st.keys and st.group >= sim.eligible[d]:
            sim.make_eligible(d, st.group + 1)
        st.lookahead_ok = True
        sim.check_inputs(st)

    def _first_ready(self, d: int, k: int) -> int | None:
        ops = self.sim.ops[d]
        head, streams = ops[k], self.sim.stream[d]
        for j in range(k, len(ops)):
            st = ops[j]
            if st.it != head.it or (streams and st.group != head.group):
                return None
            if st.deps == 0 and st.host_wait == 0:
                return j
        return None

    @staticmethod
    def _move(ops: list[OpState], j: int, k: int) -> None:
        """Move ``ops[j]`` to ``k`` (< j); re-assign the position flags within ``ops[k..j]``."""
        ops.insert(k, ops.pop(j))
        span = ops[k : j + 1]
        for p, st in enumerate(span, start=k):
            st.pos = p
        ending = {st.group for st in span if st.ends_group}
        for st in span:
            st.ends_group = False
        for st in reversed(span):  # a group's last keyed operation in the new order ends it
            if st.keys and st.group in ending:
                st.ends_group = True
                ending.discard(st.group)
        after = ops[j + 1] if j + 1 < len(ops) else None
        for st, nxt in zip(span, [*span[1:], after]):
            st.last_of_iter = nxt is None or nxt.it != st.it


__all__ = ["ReadyOrder"]
