"""The RoundPipe policy: stages dealt round-robin to stateless workers, one round at a time.

A step's microbatches are cut into *rounds* of ``round_size`` microbatches (the last may be
shorter; ``None``: one round of all of them). A round deals its forward stages, then its backward
stages from last to first, to devices in turn; each deal runs its stage for every microbatch of
the round. The last forward stage and the last backward stage (both end with the head + loss) go
to the same device, interleaved per microbatch as ``F.j B.j``, so the head runs forward and
backward back to back without recompute. The next round continues the deal on the next device: no
drain and no restart at device 0, so its first forward stage runs while the previous round's
backward stages are still running on other devices. ``start_device`` rotates the deal so that
consecutive steps start on different workers; ``next_start_device`` says where the next step's
deal continues.

Bubble: a device idles only while the stage dealt to it waits for the previous deal's first
microbatch. A device's next deal comes ``N`` deals later (``N`` devices) and needs the first
microbatch of the deal just before it, ready about ``N`` task times after the device's current
deal started; a round of ``round_size >= N`` microbatches keeps the device busy at least that
long, so with deals of about equal cost per microbatch the pipeline stays full for any number
of stages and across rounds (uneven deals: see the price below); the fill and drain at the ends
of a step remain (see docs/design.md §3, optimizer modes). That is why a round
smaller than the device count is refused (unless it holds every microbatch).

Memory: a device holds one stage's weights (plus the prefetched next one) and one microbatch's
activations at a time; saved stage inputs live on the CPU. A round's saved inputs are consumed by
its own backward stages. With more forward stages than devices and at least as many backward
stages, every device has a forward and a backward deal in every round, so round ``r + 1`` starts
only after round ``r``'s head, by when round ``r - 1`` is done: strict in-order execution holds the
saved inputs of at most two rounds, not of the whole step, whatever the stage times. With fewer
stages a device that runs only forward (or head) deals can run ahead and the bound is lost. The
price: weights stream from the CPU once per deal, so a step uploads every stage once per round, a
stage's weight gradients go down once per round (fewer microbatches summed on the device), and a
deal slower than the next one paces it once per round rather than once per step (rounds of ``2N``
cost nothing on balanced stages). Tables are not ``weight_bound``.

Constraints: none beyond partitions of the same model, >= 1 device and microbatch, and
``round_size >= num_devices`` when there is more than one round; forward and backward partitions
may differ (backward stages are usually smaller because of the recompute). Rounds follow each
other and each is dealt in dependency order, so every device's row is a subsequence of one
topological order of the tasks: every table is deadlock-free under strict in-order execution.
"""

from __future__ import annotations

from roundpipe.errors import ScheduleError
from roundpipe.schedule.policies._common import check_counts
from roundpipe.schedule.table import Partition, ScheduleTable, Task

NAME = "roundpipe"


def roundpipe(
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    start_device: int = 0,
    round_size: int | None = None,
) -> ScheduleTable:
    """RoundPipe table: per round, deal F stages, the fused head, then B stages from last to first.

    Raises:
        ScheduleError: bad counts, partitions of different models, a negative ``start_device``, or
            a ``round_size`` that is not a positive integer or, with more than one round, is below
            ``num_devices``.
    """
    check_counts(NAME, forward, backward, num_devices, num_microbatches)
    if isinstance(start_device, bool) or not isinstance(start_device, int) or start_device < 0:
        raise ScheduleError(f"{NAME}: start_device must be an integer >= 0, got {start_device!r}")
    size = _round_length(round_size, num_devices, num_microbatches)
    rows: list[list[Task]] = [[] for _ in range(num_devices)]
    deal = start_device
    for first in range(0, num_microbatches, size):
        microbatches = range(first, min(first + size, num_microbatches))
        deal = _deal_round(rows, forward.num_stages, backward.num_stages, microbatches, deal)
    table = ScheduleTable(
        tuple(tuple(r) for r in rows),
        forward,
        backward,
        num_microbatches,
        policy=NAME,
        options={"start_device": start_device, "round_size": round_size, "weight_bound": False},
    )
    return table.validate()


def _round_length(round_size: int | None, num_devices: int, num_microbatches: int) -> int:
    """Microbatches per round (the last round may hold fewer)."""
    if round_size is None:
        return num_microbatches
    if isinstance(round_size, bool) or not isinstance(round_size, int) or round_size < 1:
        raise ScheduleError(
            f"{NAME}: round_size must be a positive integer or None (one round), got {round_size!r}"
        )
    if round_size < num_devices and round_size < num_microbatches:
        raise ScheduleError(
            f"{NAME}: round_size={round_size} is below the {num_devices} devices: each deal would wait "
            f"for the previous one's microbatches and leave devices idle; use round_size >= "
            f"{num_devices} (e.g. {num_devices}), or None for one round of all {num_microbatches}"
        )
    return min(round_size, num_microbatches)


def _deal_round(rows: list[list[Task]], f_stages: int, b_stages: int, microbatches: range, deal: int) -> int:
    """Append one round's deals to ``rows`` starting with deal number ``deal``; return the next one."""
    n = len(rows)
    last_f, last_b = f_stages - 1, b_stages - 1
    for s in range(last_f):
        d = deal % n
        rows[d].extend(Task("F", s, j, d) for j in microbatches)
        deal += 1
    d = deal % n
    for j in microbatches:
        rows[d].append(Task("F", last_f, j, d))
        rows[d].append(Task("B", last_b, j, d))
    deal += 1
    for s in range(last_b - 1, -1, -1):
        d = deal % n
        rows[d].extend(Task("B", s, j, d) for j in microbatches)
        deal += 1
    return deal


def num_rounds(table: ScheduleTable) -> int:
    """How many rounds a roundpipe table deals (1 without ``round_size``)."""
    size = table.options.get("round_size") or table.num_microbatches
    return -(-table.num_microbatches // min(size, table.num_microbatches))


def next_start_device(table: ScheduleTable) -> int:
    """The ``start_device`` of the step after ``table``: the device after the one its last deal (the
    first backward stage of the last round) went to, so the deal continues across steps."""
    deals_per_round = table.forward.num_stages + table.backward.num_stages - 1
    start = int(table.options.get("start_device", 0))
    return (start + num_rounds(table) * deals_per_round) % table.num_devices
