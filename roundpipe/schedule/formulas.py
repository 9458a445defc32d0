"""Closed forms: step time, bubble fraction and peak activations of every policy on uniform stages.

Setting: ``D`` devices, ``M`` microbatches, ``S`` stages (the same forward and backward partition);
every forward task takes ``f`` and every backward task ``b`` seconds (``b`` is what the task costs,
recompute included), the last stage's forward and backward run fused in ``f + b``, and copies,
the optimizer and memory limits cost nothing. The simulator (``roundpipe.sim``) reproduces these
numbers exactly in that setting (``tests/test_sim.py``); with real costs it measures what they
leave out. ``work = M * S * (f + b) / D`` is one device's compute; ``T`` is the step time.

Bubble, two conventions (both reported everywhere):

- ``idle / total = 1 - work / T`` (the share of device time spent idle; GPipe's convention),
- ``idle / ideal = T / work - 1`` (idle time over the ideal, bubble-free step; Megatron-LM's).

Step time per policy (sources in the policies' docstrings):

=============  =========================================================  ==========================
policy         ``T``                                                      peak activations per device
=============  =========================================================  ==========================
gpipe          ``(M + D - 1)(f + b)``                                     ``M``
1f1b           ``(M + D - 1)(f + b)``                                     ``min(D, M)``
interleaved    ``(v M + D - 1)(f + b)``, ``v = S / D``, ``D | M``          ``min(v M, 2(D - 1) + (v - 1) D + 1)``
zb (ZB-H1)     ``M(f + b) + (D - 1) f + max(0, D - M) b / 2``              ``min(D, M)`` (held until W)
chimera        ``M (f + b) + (D - 2) max(f, b)``; ``M >= 2D`` even        ``D + 1``
hanayo         ``(2M + D - 1)(f + b)``; ``S = 2D``, ``M >= 2D``              ``4D``
roundpipe      see :func:`roundpipe_makespan`                             ``1``
=============  =========================================================  ==========================

- 1F1B/GPipe, interleaved: Narayanan et al. 2021 (PipeDream-Flush, Megatron-LM); the interleaved
  peak is device 0's warm-up count plus one, capped at all its ``v M`` tasks.
- ZB-H1 (Qi et al. 2024) with ``I = W = b / 2``: bubble ``(D - 1)(f + I - W) = (D - 1) f``; with
  fewer microbatches than devices each missing one leaves ``W`` more idle. Exact for ``b <= 2 f``
  (the paper's regime ``F ~ I ~ W``); ``I > F`` adds idle time the formula does not count.
- Chimera (Li & Hoefler 2021): the paper's ``D - 2`` bubbles per device (ratio
  ``(D - 2) / (2N + D - 2)`` with equal passes), each as long as the longer pass; the table holds at
  most ``D + 1`` stage inputs per device. Exact once ``M >= 2D`` (``M`` even) for any ``b >= f``;
  below that the table fills in ways no single formula follows, and with ``f > b`` it runs longer.
- Hanayo (Liu et al. 2023), one wave: interleaved's step with ``v = 2`` chunks, optimal for the
  zig-zag placement; the table holds up to ``2D`` microbatches per device, two stage inputs each.
  Exact for ``M >= 2D`` on the grid the tables are built on (``b = 2f``); with other ratios, more
  waves or fewer microbatches the simulator measures the table (``roundpipe.schedule.policies.hanayo``
  gives the figures and the optimum for few microbatches).
- Peak activations count stage inputs a device holds between a forward and the backward of the
  same stage *on that device* (the running task's input included), in units of one microbatch's
  stage input: the stash a classic pipeline keeps on its GPU. Under RoundPipe a stage's forward
  and backward run on different devices, so a device keeps nothing between tasks: 1 (the fused
  head's input while it runs). The runtime keeps every policy's stash in host memory; the
  simulator reports those bytes as host memory.

Outside the domains above (odd ``M`` for chimera, fewer microbatches, more hanayo waves) the
closed form raises :class:`ConfigError` naming the domain rather than return a figure the table does
not reach; ``roundpipe.sim`` simulates any shape. Pure Python.

Each row of the table is one policy's registry fact (``PolicySpec.closed_form``, written in
``schedule/policies/closed_forms.py``); this module checks the counts, takes the default and the
accepted stage counts from the same registry entry, and derives work and bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.errors import ConfigError
from roundpipe.schedule.policies import POLICIES as REGISTRY
from roundpipe.schedule.policies import PolicySpec
from roundpipe.schedule.policies.closed_forms import ClosedFormFn, positive, roundpipe_makespan

POLICIES = tuple(name for name, spec in REGISTRY.items() if spec.closed_form is not None)
"""The policies with a closed form (the registry's ``closed_form``), in registry order."""


@dataclass(frozen=True)
class ClosedForm:
    """The closed-form figures of one (policy, devices, stages, microbatches, f, b)."""

    policy: str
    devices: int
    stages: int
    microbatches: int
    makespan: float  # seconds (or units) of one step
    work: float  # one device's compute: M * S * (f + b) / D
    peak_activations: int  # stage inputs, per device (most loaded device)

    @property
    def idle_over_total(self) -> float:
        return 1.0 - self.work / self.makespan if self.makespan > 0 else 0.0

    @property
    def idle_over_ideal(self) -> float:
        return self.makespan / self.work - 1.0 if self.work > 0 else 0.0


def default_stages(policy: str, devices: int) -> int:
    """The stage count a policy's closed form uses by default: the registry's default stages, ``D``
    for a policy whose partitioner picks the count (``roundpipe``: one deal per device)."""
    stages = _spec(policy)[0].default_stages(devices)
    return devices if stages is None else stages


def _spec(policy: str) -> tuple[PolicySpec, ClosedFormFn]:
    """The registered policy and its closed form; ConfigError when it has none."""
    spec = REGISTRY.get(policy) if isinstance(policy, str) else None
    if spec is None or spec.closed_form is None:
        raise ConfigError(f"no closed form for policy {policy!r}; known: {', '.join(POLICIES)}")
    return spec, spec.closed_form


def _check_stages(spec: PolicySpec, devices: int, stages: int) -> None:
    """ConfigError unless ``spec`` runs ``stages`` stages on ``devices`` devices (its registry rule)."""
    if spec.accepts_stages(stages, devices):
        return
    if spec.stages_per_device is None:  # any count from 1 (``positive`` has refused the others)
        raise ConfigError(f"{spec.name} needs at least 1 stage, got {stages}")
    unit = spec.stages_per_device * devices
    if spec.exact_stages:
        per = "one stage" if spec.stages_per_device == 1 else f"{spec.stages_per_device} stages"
        what = "devices" if spec.stages_per_device == 1 else f"{spec.stages_per_device} x devices"
        raise ConfigError(
            f"{spec.name} runs {per} per device: stages must equal {what} ({unit}), got {stages}"
        )
    raise ConfigError(f"{spec.name} needs a multiple of {unit} stages for {devices} devices, got {stages}")


def closed_form(
    policy: str,
    devices: int,
    microbatches: int,
    stages: int | None = None,
    *,
    f: float = 1.0,
    b: float = 2.0,
) -> ClosedForm:
    """Step time, work and peak activations of ``policy`` (see the module table).

    ``stages`` defaults to :func:`default_stages`. Raises :class:`ConfigError` for an unknown
    policy, non-positive counts, or a shape the policy cannot run (1F1B with ``S != D``,
    interleaved with ``D`` not dividing ``S`` or ``M``, chimera with odd ``D`` or ``M``, ...).
    """
    spec, form = _spec(policy)
    n_dev, m = positive("devices", devices), positive("microbatches", microbatches)
    s = positive("stages", stages if stages is not None else default_stages(policy, n_dev))
    if f < 0 or b < 0:
        raise ConfigError(f"stage times must be >= 0, got f={f}, b={b}")
    _check_stages(spec, n_dev, s)
    t, peak = form(n_dev, s, m, f, b)
    return ClosedForm(policy, n_dev, s, m, float(t), m * s * (f + b) / n_dev, peak)


def bubble_fraction(
    policy: str,
    devices: int,
    microbatches: int,
    stages: int | None = None,
    *,
    f: float = 1.0,
    b: float = 2.0,
    convention: str = "total",
) -> float:
    """Bubble of ``policy``: ``convention="total"`` gives idle/total, ``"ideal"`` idle/ideal."""
    cf = closed_form(policy, devices, microbatches, stages, f=f, b=b)
    if convention == "total":
        return cf.idle_over_total
    if convention == "ideal":
        return cf.idle_over_ideal
    raise ConfigError(f"convention must be 'total' or 'ideal', got {convention!r}")


def peak_activations(policy: str, devices: int, microbatches: int, stages: int | None = None) -> int:
    """Most stage inputs one device holds between a forward and its backward (module table)."""
    return closed_form(policy, devices, microbatches, stages).peak_activations


__all__ = [
    "POLICIES",
    "ClosedForm",
    "bubble_fraction",
    "closed_form",
    "default_stages",
    "peak_activations",
    "roundpipe_makespan",
]
