"""How the ranks of one checkpoint save work together: a part run on rank 0 alone or on every
rank, each rank learning what the others got, or that one of them failed.

``CheckpointManager.save`` runs its three parts through these (rank 0 opens the write directory,
every rank writes its files, rank 0 seals the manifest), so a rank that fails fails the save on
every rank instead of leaving the others waiting in a collective. ``group`` is the ranks of a
data-parallel run (``rank``, ``world_size``, ``broadcast_object``, ``all_gather_object``), or
``ALONE`` for a save by one process, which exchanges nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


class _Alone:
    """The ranks of a save by one process (no exchange needed)."""

    rank = 0
    world_size = 1


ALONE = _Alone()


@dataclass(frozen=True)
class Failed:
    """What a rank hands the others when its part of a save raised."""

    text: str

    @classmethod
    def of(cls, err: BaseException) -> Failed:
        """What to hand the others for ``err``."""
        return cls(f"raised {type(err).__name__}: {err}")


def on_rank_0(group, work, main: bool, public=lambda result: None):
    """Rank 0 runs ``work``; rank 0 gets its result and every other rank ``public(result)``, or a
    ``Failed`` where it raised; rank 0 itself re-raises its exception once the others know."""
    if group is ALONE:
        return work()
    result = error = None
    if main:
        try:
            result = work()
            shared = public(result)
        except Exception as e:
            error, shared = e, Failed.of(e)
    shared = group.broadcast_object(shared if main else None)
    if error is not None:
        raise error
    return result if main else shared


def on_every_rank(group, work) -> list:
    """Every rank runs ``work``; each gets the list of every rank's result (a ``Failed`` where one
    raised); the rank that raised re-raises its own exception once the others know."""
    if group is ALONE:
        return [work()]
    error = None
    try:
        mine = work()
    except Exception as e:
        error, mine = e, Failed.of(e)
    parts = group.all_gather_object(mine)
    if error is not None:
        raise error
    return parts
