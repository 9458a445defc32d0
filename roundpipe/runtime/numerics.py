"""Finding a NaN or Inf before the optimizer applies it (``RunConfig.nan_policy``).

Every task checks, on its device and without waiting for it, each layer output it computes for the
first time (the loss is the head's output) and each weight gradient it adds into the stage's
accumulator: one reduction per tensor, its largest magnitude (``vector_norm`` of order infinity:
NaN propagates into it, an Inf is it, a finite tensor's is finite; no temporary the size of the
tensor, so the check adds nothing to a device's peak), and once per task ``isfinite`` of those
values stacked, one small flag tensor that goes down with the task's other downloads
(``TaskChecks``). Each check is operations a worker issues, per tensor and microbatch: the
reduction alone is one, where ``isfinite`` per tensor would be four more. The host thread reads the flags in issue order
(``StepRun``): a non-finite output is known before any layer's gradient is final, so before any
update; a non-finite gradient before its own layer's. ``first_nonfinite`` picks where the value
first appeared, in the order values flow: the lowest layer among outputs, else the highest among
gradients; the lowest microbatch there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from roundpipe.errors import NonFiniteError


@dataclass(frozen=True)
class NonFinite:
    """One non-finite value: a layer's ``output`` or a weight ``gradient`` (``param`` names it)."""

    what: str
    layer_index: int
    layer: str
    microbatch: int
    device: str
    param: str | None = None

    def describe(self) -> str:
        value = f"the gradient of {self.param}" if self.what == "gradient" else f"the output of {self.layer}"
        return f"{value} (layer {self.layer}) in microbatch {self.microbatch} on {self.device}"


@dataclass
class TaskChecks:
    """What one task checked (compute stream), then its flags on the host (after the download).

    ``meta[j]`` describes ``flags[j]``: ``(what, layer index, parameter name or None)``.
    """

    microbatch: int
    device: str
    meta: list[tuple[str, int, str | None]] = field(default_factory=list)
    flags: list[torch.Tensor] = field(default_factory=list)

    def output(self, layer: int, y) -> None:
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            self.meta.append(("output", layer, None))
            self.flags.append(_magnitude(y))

    def gradient(self, layer: int, param: str, g: torch.Tensor) -> None:
        if g.numel():
            self.meta.append(("gradient", layer, param))
            self.flags.append(_magnitude(g))

    def packed(self) -> torch.Tensor | None:
        """The flags as one bool tensor (compute stream), or None when nothing was checked."""
        if not self.flags:
            return None
        packed = torch.isfinite(torch.stack(self.flags))  # the magnitudes' dtypes promote
        self.flags.clear()
        return packed

    def found(self, host_flags: torch.Tensor, names: list[str]) -> list[NonFinite]:
        """Host thread: the checked values that were not finite. A virtual run's flags have no
        values (meta): modelled as every value finite (docs/virtual.md)."""
        if host_flags.is_meta:
            return []
        bad = (~host_flags).nonzero().flatten().tolist()
        return [
            NonFinite(what, i, names[i], self.microbatch, self.device, param)
            for what, i, param in (self.meta[j] for j in bad)
        ]


def host_float(t: torch.Tensor) -> float:
    """A host scalar's value; NaN for a virtual run's (meta: no value, docs/virtual.md)."""
    return float("nan") if t.is_meta else float(t)


def _magnitude(t: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor on ``t``'s device, finite exactly when every element of ``t`` is."""
    return torch.linalg.vector_norm(t, float("inf"))


def first_nonfinite(found: list[NonFinite]) -> NonFinite | None:
    """Where the first non-finite value appeared (see the module docstring)."""
    outputs = [f for f in found if f.what == "output"]
    if outputs:
        return min(outputs, key=lambda f: (f.layer_index, f.microbatch))
    if found:
        return min(found, key=lambda f: (-f.layer_index, f.microbatch))
    return None


def nonfinite_error(found: NonFinite, step: int, total: int) -> NonFiniteError:
    """The error ``nan_policy="stop"`` raises; ``total``: how many non-finite values the step had."""
    more = f" ({total - 1} more non-finite value(s) after it)" if total > 1 else ""
    hint = (
        "lower the learning rate, clip gradients (max_grad_norm), check the data of that "
        "microbatch, or set nan_policy='skip' to drop such steps and go on"
    )
    return NonFiniteError(
        f"step {step}: {found.describe()} is not finite{more}; nothing of it was applied to the "
        f"layer it appeared in; {hint}",
        what=found.what,
        layer=found.layer,
        microbatch=found.microbatch,
        device=found.device,
        step=step,
    )
