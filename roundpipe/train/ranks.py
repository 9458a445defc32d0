"""Which rank of a ``torchrun`` launch this process is, and the few agreements the trainer needs.

``roundpipe train`` runs unchanged under ``torchrun``: every rank runs the same steps on the same
global batches, and the pipeline (``RunConfig(data_parallel="auto")``) splits each batch across the
ranks and reduces the gradients. What is left to the trainer is keeping the ranks in agreement
outside the steps: rank 0 alone writes the run directory, so the others wait for it (the synthetic
data files, the checkpoint to resume from), a refusal on one rank (host RAM on its node, a damaged
checkpoint) must stop them all with the same error, and a signal that reached one rank must stop
every rank after the same step.

``Ranks.from_environment`` reads the variables torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``). ``join`` initialises the
default torch.distributed process group on gloo when nothing has (the pipeline then joins it), and
makes a group of its own for the trainer's object collectives, so that they never interleave with
the pipeline's gradient traffic. Every collective waits at most ``dp_timeout_s``; a lost or late
peer is a ``DataParallelError``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from roundpipe.errors import ConfigError, DataParallelError, RoundpipeError

_ENV_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"the environment variable {name}={text!r} is not an integer; launch with torchrun, which sets "
            f"{', '.join(_ENV_INTS[:4])}, or unset it"
        ) from None


@dataclass
class Ranks:
    """This process's place in a data-parallel launch (``world_size`` 1: a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the ranks so far
    timeout_s: float = 300.0
    _group: Any = field(default=None, repr=False)

    @classmethod
    def from_environment(cls, data_parallel: str, timeout_s: float) -> Ranks:
        """The launch as the environment describes it. ``data_parallel="off"`` under a launcher of
        several ranks is refused: every rank would train alone and write the same run directory.

        Raises:
            ConfigError: a variable that is not an integer, a rank outside ``[0, WORLD_SIZE)``, or
                ``data_parallel: off`` with ``WORLD_SIZE`` > 1.
        """
        world = _env_int("WORLD_SIZE", 1)
        if world <= 1:
            return cls(timeout_s=timeout_s)
        if data_parallel == "off":
            raise ConfigError(
                f"run.data_parallel is off but this process is one of WORLD_SIZE={world} ranks (torchrun): "
                "each would train alone and write the same run directory. Set run.data_parallel: auto, "
                "or launch one process without torchrun"
            )
        rank = _env_int("RANK", 0)
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world}); launch with torchrun")
        local_world = _env_int("LOCAL_WORLD_SIZE", 1)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=_env_int("LOCAL_RANK", 0),
            local_world_size=max(1, local_world),
            restart=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
            timeout_s=timeout_s,
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, metrics, plots, exports and the checkpoint's manifest."""
        return self.rank == 0

    def join(self) -> None:
        """Initialise the default process group (gloo, on the launcher's store) unless the caller
        has, and make the trainer's own group. A no-op for a single process.

        Raises:
            ConfigError: ``MASTER_ADDR`` or ``MASTER_PORT`` unset.
            DataParallelError: the other ranks did not join within ``timeout_s``, or the process
                group the caller made disagrees with the environment.
        """
        if not self.distributed or self._group is not None:
            return
        import torch.distributed as dist

        from roundpipe.distributed.group import init_default_group

        timeout = timedelta(seconds=self.timeout_s)
        try:
            if not dist.is_initialized():
                init_default_group(self.rank, self.world_size, self.timeout_s)
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise DataParallelError(
                    f"the process group has rank {dist.get_rank()} of {dist.get_world_size()} but the "
                    f"environment says RANK={self.rank} of WORLD_SIZE={self.world_size}",
                    rank=self.rank,
                )
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        except (DataParallelError, ConfigError):
            raise
        except (RuntimeError, ValueError) as e:
            raise self._lost("joining the process group", e) from e

    # ------------------------------------------------------------------ object collectives
    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``, by rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as e:
            raise self._lost("exchanging state", e) from e
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self._group)
        except RuntimeError as e:
            raise self._lost(f"waiting for rank {src}", e) from e
        return box[0]

    def barrier(self) -> None:
        self.all_gather_object(None)

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        return any(self.all_gather_object(bool(flag)))

    # ------------------------------------------------------------------ agreements
    def on_main(self, fn, *args, **kwargs):
        """Run ``fn`` on rank 0 and hand its result to every rank; when it raises, every rank raises
        (rank 0 its own exception, the others the same roundpipe error class naming rank 0)."""
        outcome = None
        if self.is_main:
            try:
                outcome = ("ok", fn(*args, **kwargs))
            except Exception as err:
                if not self.distributed:
                    raise
                with contextlib.suppress(DataParallelError):  # a lost peer: this error is the one to show
                    self.broadcast_object(("error", _describe(err)))
                raise
        outcome = self.broadcast_object(outcome)
        if outcome[0] == "error":
            raise _rebuild(outcome[1], 0)
        return outcome[1]

    def everywhere(self, fn, *args, **kwargs):
        """Run ``fn`` on every rank; when it raises on any, every rank raises (the first failed rank's
        error class and message). Returns this rank's result."""
        try:
            mine = ("ok", fn(*args, **kwargs))
            err = None
        except Exception as e:
            if not self.distributed:
                raise
            mine, err = ("error", _describe(e)), e
        outcomes = self.all_gather_object(mine if mine[0] == "error" else ("ok", None))
        if err is not None:
            raise err
        for rank, outcome in enumerate(outcomes):
            if outcome[0] == "error":
                raise _rebuild(outcome[1], rank)
        return mine[1]

    def _lost(self, what: str, err: Exception) -> DataParallelError:
        return DataParallelError(
            f"rank {self.rank}: {what}: another rank was lost or did not answer within "
            f"run.dp_timeout_s={self.timeout_s:g} s ({str(err).splitlines()[0] if str(err) else type(err).__name__})",
            rank=self.rank,
        )


def _describe(err: Exception) -> dict:
    """What the other ranks are told of an error (its class name and message: picklable)."""
    return {"type": type(err).__name__, "message": str(err)}


def _rebuild(described: dict, rank: int) -> Exception:
    """The error another rank raised, as the same roundpipe error class where it takes a plain
    message (so every rank exits with the same code), else a ``DataParallelError``."""
    import roundpipe.errors as errors

    message = f"rank {rank}: {described['message']}"
    cls = getattr(errors, described["type"], None)
    if isinstance(cls, type) and issubclass(cls, RoundpipeError):
        try:
            return cls(message)
        except TypeError:  # a class whose constructor wants more than a message
            pass
    return DataParallelError(f"rank {rank} failed: {described['type']}: {described['message']}", rank=rank)
