"""Each policy's closed form on uniform stages: ``(devices, stages, microbatches, f, b) -> (step
time, peak activations)``, registered as :attr:`PolicySpec.closed_form`.

The formulas, their sources and their domains are tabled in ``roundpipe.schedule.formulas``, which
checks the counts and the stage count (the registry's :meth:`PolicySpec.accepts_stages`) before it
calls one of these. A shape outside a formula's domain raises :class:`ConfigError` naming the
domain. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from roundpipe.errors import ConfigError

ClosedFormFn = Callable[[int, int, int, float, float], tuple[float, int]]
"""``(devices, stages, microbatches, f, b) -> (step time, peak activations)``."""


def positive(name: str, value) -> int:
    """``value`` if it is a positive int, else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def gpipe_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    return (microbatches + devices - 1) * (f + b), microbatches


def one_f_one_b_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    return (microbatches + devices - 1) * (f + b), min(devices, microbatches)


def zb_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    m = microbatches
    return m * (f + b) + (devices - 1) * f + max(0, devices - m) * b / 2, min(devices, m)


def chimera_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    n_dev, m = devices, microbatches
    if n_dev % 2 or m % 2 or m < 2 * n_dev or f > b:
        raise ConfigError(
            f"the chimera closed form holds for even devices, an even number of microbatches "
            f"M >= 2D and b >= f; got D={n_dev}, M={m}, f={f}, b={b}. Simulate the table for "
            f"other shapes (roundpipe simulate)"
        )
    return m * (f + b) + (n_dev - 2) * max(f, b), n_dev + 1


def hanayo_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    n_dev, s, m = devices, stages, microbatches
    if s != 2 * n_dev or m < 2 * n_dev or b != 2 * f:
        raise ConfigError(
            f"the hanayo closed form holds for one wave (S = 2D = {2 * n_dev} stages), M >= 2D "
            f"microbatches and b = 2f, the grid its table is built on; got S={s}, M={m}, f={f}, "
            f"b={b}. Simulate the table for other shapes (roundpipe simulate)"
        )
    return (2 * m + n_dev - 1) * (f + b), 4 * n_dev


def interleaved_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    n_dev, m = devices, microbatches
    v = stages // n_dev
    if m % n_dev:
        raise ConfigError(f"interleaved needs microbatches divisible by devices, got {m} and {n_dev}")
    return (v * m + n_dev - 1) * (f + b), min(v * m, 2 * (n_dev - 1) + (v - 1) * n_dev + 1)


def roundpipe_makespan(
    devices: int,
    stages: int,
    microbatches: int,
    f: float = 1.0,
    b: float = 2.0,
    stages_backward: int | None = None,
) -> float:
    """Step time of the ``roundpipe`` table (``start_device=0``) on uniform stages.

    The table deals ``K = S_f + S_b - 1`` *deals* in turn to devices ``k mod D``: ``S_f - 1``
    forward stages (``c_k = f``), the fused head (``f + b``), ``S_b - 1`` backward stages (``b``);
    each deal runs all ``M`` microbatches. Deal ``k``'s microbatch ``j`` waits for deal ``k - 1``'s
    microbatch ``j`` and for its device's previous deal ``k - D`` to finish. The step time is the
    longest of two kinds of paths through that grid:

    - the chain: ``sum(c) + (M - 1) max(c)`` (one microbatch all the way through, the slowest deal
      pacing the rest);
    - a device ``d``'s deals back to back: ``sum(c_k, k < d) + M * sum(c_k, k = d mod D) +
      sum(c_k, k > last deal of d)`` (fill to its first deal, all its work, drain after its last).

    ``T = max(chain, max over devices)``. With ``S = vD`` and ``M >= D`` this is
    ``(v M + D - 1)(f + b)``, interleaved 1F1B's step without its ``D | M`` constraint; when ``D``
    does not divide ``S`` some device gets one deal more and is the bottleneck. (Checked exactly
    against the table for ``D <= 8``, ``S, M < 20`` and several ``f : b``.)
    """
    n_dev, s_f, m = (
        positive("devices", devices),
        positive("stages", stages),
        positive("microbatches", microbatches),
    )
    s_b = positive("stages_backward", stages_backward) if stages_backward is not None else s_f
    return deal_makespan([f] * (s_f - 1) + [f + b] + [b] * (s_b - 1), n_dev, m)


def deal_makespan(deal_times: list[float], devices: int, microbatches: int) -> float:
    """``max(chain, max over devices)`` of :func:`roundpipe_makespan` for deals costing
    ``deal_times`` each (per microbatch), dealt in turn to ``devices`` devices.

    Exact for the ``roundpipe`` table on uniform stages (``roundpipe_makespan``'s deal costs). The
    grain objective (``partition.grain.objective``) is ``devices`` times this with every deal at the
    slowest one's time, when ``devices`` divides the deal count and ``microbatches >= devices``.
    """
    c, n_dev, m = deal_times, devices, microbatches
    k_total = len(c)
    best = sum(c) + (m - 1) * max(c)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    for d in range(min(n_dev, k_total)):
        deals = range(d, k_total, n_dev)
        last = deals[-1]
        best = max(best, prefix[d] + m * sum(c[k] for k in deals) + prefix[k_total] - prefix[last + 1])
    return best


def roundpipe_form(devices: int, stages: int, microbatches: int, f: float, b: float) -> tuple[float, int]:
    """A device keeps nothing between tasks under RoundPipe: peak 1 (the fused head's input)."""
    return roundpipe_makespan(devices, stages, microbatches, f, b), 1
