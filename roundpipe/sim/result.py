"""``SimResult``: what one simulated step costs and holds, as ``simulator.simulate`` reports it.

Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roundpipe.schedule.timeline import Span, Timeline


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs and holds. Times in seconds, memory in bytes.

    ``bubble_total`` is idle/total compute time over all devices, ``bubble_ideal`` idle/ideal
    (``iteration_s * D / busy - 1``). ``peak_gpu_bytes[d]`` includes the workspace reserve;
    ``peak_activations[d]`` counts stage inputs held between a forward and its backward on ``d``
    (the closed forms' unit). ``fits`` is False when a device or the host exceeds its memory, and
    ``reason`` then says where, by how much and at which task. ``reordered``: with
    ``order="ready"``, how many operations ran ahead of one that precedes them in the table.
    """

    policy: str
    num_devices: int
    num_microbatches: int
    iteration_s: float
    tokens_per_s: float
    mfu: float
    bubble_total: float
    bubble_ideal: float
    peak_gpu_bytes: tuple[int, ...]
    peak_host_bytes: int
    peak_activations: tuple[int, ...]
    compute_busy_s: tuple[float, ...]
    h2d_bytes: int
    d2h_bytes: int
    optimizer_busy_s: float
    weights_streamed: tuple[bool, ...]
    fits: bool
    reason: str = ""
    optimizer: str = "sync"
    notes: tuple[str, ...] = ()
    reordered: int = 0
    accumulate_busy_s: float = 0.0  # the host thread adding downloaded gradients (host_traffic.py)
    raw_spans: list | None = field(default=None, compare=False, repr=False)  # Span fields, built lazily
    timeline_meta: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def timeline(self) -> Timeline | None:
        """The simulated step(s) as a :class:`Timeline` (None when not recorded); built on each access."""
        if self.raw_spans is None:
            return None
        return Timeline([Span(*t) for t in self.raw_spans], dict(self.timeline_meta))

    @property
    def host_busy_s(self) -> float:
        """Seconds per step the host thread is busy: the updates and the gradient additions."""
        return self.optimizer_busy_s + self.accumulate_busy_s

    @property
    def peak_gpu(self) -> int:
        return max(self.peak_gpu_bytes)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "num_devices": self.num_devices,
            "num_microbatches": self.num_microbatches,
            "iteration_s": self.iteration_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_total,
            "bubble_idle_over_ideal": self.bubble_ideal,
            "peak_gpu_bytes": self.peak_gpu,
            "peak_gpu_bytes_per_device": list(self.peak_gpu_bytes),
            "peak_host_bytes": self.peak_host_bytes,
            "peak_activations": list(self.peak_activations),
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "optimizer_busy_s": self.optimizer_busy_s,
            "accumulate_busy_s": self.accumulate_busy_s,
            "optimizer": self.optimizer,
            "weights_streamed": list(self.weights_streamed),
            "fits": self.fits,
            "reason": self.reason,
            "notes": list(self.notes),
            "reordered": self.reordered,
        }


__all__ = ["SimResult"]
