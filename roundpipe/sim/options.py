"""``SimOptions``: how the event simulator (``engine.py``) runs a step, and which of its costs it counts.

Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.errors import ConfigError
from roundpipe.sim.variability import check_variability

# The size of the chunks weight uploads and weight-gradient downloads are cut into, so that an urgent
# copy can pass between them: the runtime's default (``RunConfig.copy_chunk_bytes``) and the
# simulator's. 16 MiB moves in ~0.67 ms at PCIe 4's ~25 GB/s (64 MiB took ~2.6 ms), far past the
# size where a pinned copy reaches the link's rate; each chunk is a closure the worker issues, so
# 8 MiB cost the host twice the issues for the same bytes (Qwen3-1.7B on eight virtual RTX 4090s:
# 20.9 -> 19.9 ms of host CPU a task, docs/virtual.md).
DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class SimOptions:
    """How to simulate. The defaults model the hardware fully; the switches turn costs off.

    ``transfers=False`` makes every copy free and ``optimizer_time=False`` every optimizer step:
    with both off and uniform layers the result equals ``schedule.formulas`` exactly.
    ``iterations`` defaults to 1 (sync) or 3 (async).
    """

    optimizer: str = "sync"
    transfers: bool = True
    optimizer_time: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    iterations: int | None = None
    record_timeline: bool = True
    classic_flow: bool = False  # textbook forward tasks (closed forms' setting), see flow.stage_work
    # Sum weight gradients on the device while the next task on the device backpropagates the same
    # layers and download them once (what the runtime does); False: download after every task.
    accumulate_grads: bool = True
    stream_weights: bool | None = None  # None: stream unless the table is weight-bound and fits
    # "strict": each device runs its operations in table order; "ready": the first in table order
    # whose inputs are ready (RunConfig.order; see ready.py).
    order: str = "strict"
    # Work that varies (variability.py): each operation's time times a log-normal factor of mean 1
    # and this sigma, drawn from ``jitter_seed``; ``slowdown[d]``: device d's time factor (2.0: half
    # speed; devices past the tuple run at 1.0).
    jitter: float = 0.0
    jitter_seed: int = 0
    slowdown: tuple[float, ...] = ()

    def __post_init__(self):
        if self.optimizer not in ("sync", "async"):
            raise ConfigError(f"optimizer must be 'sync' or 'async', got {self.optimizer!r}")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.iterations is not None and self.iterations < 1:
            raise ConfigError(f"iterations must be >= 1, got {self.iterations}")
        if self.order not in ("strict", "ready"):
            raise ConfigError(f"order must be 'strict' or 'ready', got {self.order!r}")
        check_variability(self.jitter, self.slowdown)
        object.__setattr__(self, "slowdown", tuple(self.slowdown))  # a list from a caller: hashable


__all__ = ["DEFAULT_CHUNK_BYTES", "SimOptions"]
