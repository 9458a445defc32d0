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
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.errors import ConfigError

POLICIES = ("gpipe", "1f1b", "interleaved", "zb", "chimera", "hanayo", "roundpipe")


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


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def default_stages(policy: str, devices: int) -> int:
    """The stage count a policy runs with by default: ``D`` (``2D`` for interleaved and hanayo)."""
    return 2 * devices if policy in ("interleaved", "hanayo") else devices


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
        _positive("devices", devices),
        _positive("stages", stages),
        _positive("microbatches", microbatches),
    )
    s_b = _positive("stages_backward", stages_backward) if stages_backward is not None else s_f
    c = [f] * (s_f - 1) + [f + b] + [b] * (s_b - 1)
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
    if policy not in POLICIES:
        raise ConfigError(f"no closed form for policy {policy!r}; known: {', '.join(POLICIES)}")
    n_dev, m = _positive("devices", devices), _positive("microbatches", microbatches)
    s = _positive("stages", stages if stages is not None else default_stages(policy, n_dev))
    if f < 0 or b < 0:
        raise ConfigError(f"stage times must be >= 0, got f={f}, b={b}")
    step = f + b
    if policy in ("gpipe", "1f1b", "zb", "chimera") and s != n_dev:
        raise ConfigError(f"{policy} runs one stage per device: stages must equal devices ({n_dev}), got {s}")
    if policy == "gpipe":
        t, peak = (m + n_dev - 1) * step, m
    elif policy == "1f1b":
        t, peak = (m + n_dev - 1) * step, min(n_dev, m)
    elif policy == "zb":
        t, peak = m * step + (n_dev - 1) * f + max(0, n_dev - m) * b / 2, min(n_dev, m)
    elif policy == "chimera":
        if n_dev % 2 or m % 2 or m < 2 * n_dev or f > b:
            raise ConfigError(
                f"the chimera closed form holds for even devices, an even number of microbatches "
                f"M >= 2D and b >= f; got D={n_dev}, M={m}, f={f}, b={b}. Simulate the table for "
                f"other shapes (roundpipe simulate)"
            )
        t, peak = m * step + (n_dev - 2) * max(f, b), n_dev + 1
    elif policy == "hanayo":
        if s != 2 * n_dev or m < 2 * n_dev or b != 2 * f:
            raise ConfigError(
                f"the hanayo closed form holds for one wave (S = 2D = {2 * n_dev} stages), M >= 2D "
                f"microbatches and b = 2f, the grid its table is built on; got S={s}, M={m}, f={f}, "
                f"b={b}. Simulate the table for other shapes (roundpipe simulate)"
            )
        t, peak = (2 * m + n_dev - 1) * step, 4 * n_dev
    elif policy == "interleaved":
        if s % n_dev:
            raise ConfigError(f"{policy} needs a multiple of {n_dev} stages for {n_dev} devices, got {s}")
        v = s // n_dev
        if m % n_dev:
            raise ConfigError(f"interleaved needs microbatches divisible by devices, got {m} and {n_dev}")
        t = (v * m + n_dev - 1) * step
        peak = min(v * m, 2 * (n_dev - 1) + (v - 1) * n_dev + 1)
    else:
        t, peak = roundpipe_makespan(n_dev, s, m, f, b), 1
    return ClosedForm(policy, n_dev, s, m, float(t), m * s * step / n_dev, peak)


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
