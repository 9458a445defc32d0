"""Membership of a data-parallel group: which rank this process is, which rows of a global batch
are its own, which rank owns each layer's optimizer state, and the small collectives a step needs.

The group is torch.distributed's, on gloo (the gradients it sums live in host memory). ``join``
reads the launcher's environment (``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOCAL_RANK``) and initialises the default process group unless the caller has.
Three gloo subgroups over every rank keep the collectives of different threads apart, each issued
by one thread in the same order on every rank: ``main`` (the caller's thread: token counts, losses,
the deferred update's agreements and broadcasts), ``grads`` (the host thread: gradient buckets as
they become final) and ``weights`` (the reduction thread: the sharded owners' new weights).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from roundpipe.errors import ConfigError, DataParallelError, InputError

T = TypeVar("T")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int:
    """``WORLD_SIZE`` of the launcher's environment (1 when unset)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; launch with torchrun, or unset it"
        ) from None


def join(config) -> DataParallel | None:
    """The data-parallel group this process belongs to under ``config.data_parallel``, or None
    (``"off"``, or a world of one).

    Raises:
        ConfigError: the launcher's variables are incomplete, or the config asks for something
            data parallelism cannot do (``optimizer_mode="async"``).
    """
    if config.data_parallel == "off":
        return None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = launched_world_size()
        if world <= 1:
            return None
        missing = [v for v in _LAUNCH_VARS if v not in os.environ]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun (or set them "
                "all), or pass data_parallel='off'"
            )
        try:
            init_default_group(int(os.environ["RANK"]), world, config.dp_timeout_s)
        except ValueError as e:
            raise ConfigError(f"RANK={os.environ['RANK']!r}: {e}; launch with torchrun") from e
        except RuntimeError as e:  # the store or a peer did not answer
            raise DataParallelError(
                f"joining the {world} data-parallel ranks at {os.environ['MASTER_ADDR']}:"
                f"{os.environ['MASTER_PORT']} failed ({type(e).__name__}: {e}); start every rank within "
                f"dp_timeout_s={config.dp_timeout_s:g} s of each other, with the same MASTER_ADDR and MASTER_PORT"
            ) from e
    if world <= 1:
        return None
    if config.optimizer_mode == "async":
        raise ConfigError(
            "optimizer_mode='async' cannot run data-parallel yet (the update overlapping the next step "
            "would race the ranks' collectives); use optimizer_mode='sync', or data_parallel='off'"
        )
    return DataParallel(config)


def init_default_group(rank: int, world: int, timeout_s: float) -> None:
    """Initialise torch.distributed's default process group on gloo from the launcher's
    ``MASTER_ADDR`` / ``MASTER_PORT``, its keys under a prefix of this attempt's own.

    torchrun's static rendezvous (``--master-port``) keeps one store across ``--max-restarts``, and
    ``env://`` does not separate the attempts: a restarted rank can read the address a peer
    published before the restart and fail to connect. A prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps each attempt's keys apart.

    Raises:
        ConfigError: ``MASTER_ADDR`` or ``MASTER_PORT`` unset or not a port.
    """
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun (or set RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or turn data parallelism off"
        )
    try:
        port = int(os.environ["MASTER_PORT"])
    except ValueError:
        raise ConfigError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number") from None
    timeout = timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], port, world, is_master=not agent and rank == 0, timeout=timeout,
        multi_tenant=True,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"roundpipe/attempt-{attempt}", store), rank=rank,
        world_size=world, timeout=timeout,
    )  # fmt: skip


class DataParallel:
    """This process's place in the group, and the collectives the pipeline calls.

    ``rank``, ``world_size``; ``is_main``: rank 0 (the one that writes logs); ``sharded``: each
    rank steps only the layers it owns (``optimizer_sharding="nodes"``); ``broken``: why the group
    cannot run another step (a step failed on this rank, or a collective did), else None.
    """

    def __init__(self, config):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.sharded = config.optimizer_sharding == "nodes"
        self.timeout_s = float(config.dp_timeout_s)
        self.broken: str | None = None
        timeout = timedelta(seconds=self.timeout_s)
        # Every rank creates them in this order (new_group is itself collective).
        self.main, self.grads, self.weights = (
            dist.new_group(backend="gloo", timeout=timeout) for _ in range(3)
        )
        self._groups: tuple[Any, ...] = (self.grads, self.weights, self.main)

    # ------------------------------------------------------------------ rows and owners
    def rows(self, batch: int) -> slice:
        """This rank's rows of a global batch of ``batch`` samples: contiguous, the sizes of all
        ranks differing by at most one (rank order), as ``torch.tensor_split`` cuts them.

        Raises:
            InputError: fewer samples than ranks (a rank would have nothing to compute on).
        """
        if batch < self.world_size:
            raise InputError(
                f"a global batch of {batch} samples cannot be shared by {self.world_size} data-parallel "
                f"ranks; use a batch of at least {self.world_size} (every rank passes the same global batch)"
            )
        base, extra = divmod(batch, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def owners(self, groups: list[int], nbytes: dict[int, int]) -> dict[int, int]:
        """Which rank steps each step group: every rank when not sharded (value: this rank), else
        contiguous runs of ``groups`` (in the given order) with about equal bytes per rank."""
        if not self.sharded:
            return {g: self.rank for g in groups}
        total = sum(nbytes[g] for g in groups) or 1
        owners, before = {}, 0
        for g in groups:
            middle = before + nbytes[g] / 2
            owners[g] = min(self.world_size - 1, int(middle * self.world_size / total))
            before += nbytes[g]
        return owners

    # ------------------------------------------------------------------ collectives
    def collective(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a collective), turning a failure into ``DataParallelError`` that says what
        was running; the group is then broken."""
        self.check()
        try:
            return fn()
        except BaseException as e:
            raise self.failed(what, e) from e

    def failed(self, what: str, e: BaseException) -> DataParallelError:
        """The error for a collective that raised ``e``, marking the group broken."""
        self.broken = f"{what} failed on rank {self.rank}"
        return DataParallelError(
            f"rank {self.rank} of {self.world_size}: {what} failed ({type(e).__name__}: {e}). Another rank "
            f"failed, was stopped, or did not reach it within dp_timeout_s={self.timeout_s:g} s: see "
            "that rank's own error. Restart every rank (torchrun --max-restarts, with --resume auto)",
            rank=self.rank,
        )

    def check(self) -> None:
        if self.broken is not None:
            raise DataParallelError(
                f"rank {self.rank}: the data-parallel group cannot run another step ({self.broken}); "
                "restart every rank (torchrun --max-restarts, with --resume auto)",
                rank=self.rank,
            )

    def fail(self, reason: str) -> None:
        """A step failed on this rank: no further collective may run, and the peers waiting in
        one are released at once by closing this rank's connections."""
        if self.broken is None:
            self.broken = reason
        self._destroy()

    def close(self) -> None:
        """Release this pipeline's subgroups (the default process group stays: a later pipeline
        of this process joins it again)."""
        if self.broken is None:
            self.broken = "the pipeline was closed"
        self._destroy()

    def _destroy(self) -> None:
        groups, self._groups = self._groups, ()
        for pg in groups:
            # Already gone, or the process is exiting: the peers' collectives time out instead.
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)

    def sum(self, values: list[float], what: str) -> list[float]:
        """Element-wise sums of ``values`` over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        self.collective(what, lambda: dist.all_reduce(t, group=self.main))
        return t.tolist()

    def gather(self, values: list[float], what: str) -> list[list[float]]:
        """``values`` of every rank, in rank order (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.collective(what, lambda: dist.all_gather(out, t, group=self.main))
        return [o.tolist() for o in out]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.collective("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.main))
        return out

    def agree(self, fields: dict[str, Any]) -> None:
        """Check that every rank runs with the same ``fields`` (config, model); raise naming the
        first that differs."""
        digests = {k: hashlib.sha256(repr(v).encode()).hexdigest()[:16] for k, v in fields.items()}
        every = self.all_gather_object(digests)
        for k in fields:
            differ = [r for r, d in enumerate(every) if d.get(k) != digests[k]]
            if differ:
                self.broken = f"the ranks disagree on {k}"
                raise DataParallelError(
                    f"rank {self.rank}: data-parallel ranks {differ} run with a different {k} than this "
                    f"one ({fields[k]!r}); every rank must wrap the same model with the same RunConfig",
                    rank=self.rank,
                )
