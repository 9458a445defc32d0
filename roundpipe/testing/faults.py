"""Fault injection: make a chosen point of a run fail on purpose, to test what the run does then.

Off unless enabled, and then free: every point in the code is ``faults.point(where, ...)``, whose
first line returns when no plan is active (one module-global read).

Enable it in-process with ``with faults.injected(Fault("forward", layer="layers.1", step=2)):``,
or for a whole process (the soak runs ``roundpipe train`` in a subprocess) with the environment
variable ``ROUNDPIPE_FAULTS``: a JSON list of faults, e.g. ``[{"where": "data", "step": 7,
"kind": "kill"}]``, read by :func:`from_environment` (``roundpipe train`` calls it).

Points (``where``) and the context each passes (a fault matches when every filter it sets equals
the context's value):

- ``forward``: a layer's forward on a worker's compute stream (``step``, ``layer``,
  ``microbatch``, ``device``); ``backward``: a backward stage's autograd call (the same, ``layer``
  is the stage's first layer);
- ``upload`` / ``download``: a hand-off's copy to / from a device (``step``, ``device``);
  ``grads``: a backward stage's fp32 gradient accumulator going down (``step``, ``device``,
  ``layer`` the stage's first layer), before it is copied: a ``stall`` there is a slow download;
- ``optimizer``: the host stepping one layer's parameters (``layer``);
- ``data``: the trainer taking a step's batches (``step``); ``checkpoint``: writing a checkpoint
  (``step``);
- ``compute``: a task's compute (or its microbatch's context build) has just run on a device's
  compute stream (``device``; cpu backend only: its stream thread times the closure and calls
  :func:`after_compute`).

``step`` is the pipeline's ``forward_backward`` count for the device points (the trainer's step
when every step is one call) and the trainer's step for ``data`` and ``checkpoint``.

Kinds: ``error`` raises :class:`InjectedFault` (a plain ``RuntimeError``: the code around the point
treats it as it treats any failure there); ``oom`` raises ``DeviceOutOfMemory`` for the point's
device; ``sticky`` raises :class:`StickyFault`, a device error that leaves the backend unusable (a
CUDA error such as an illegal memory access: every later call fails, ``reset`` too); ``stall`` sleeps ``seconds`` (the watchdog's to catch); ``kill`` sends SIGKILL to the
process; ``nan`` (``forward`` and ``backward`` only) makes ``point`` return True, and the caller
poisons its tensor with NaN: the layer's output, or the gradient flowing into the backward stage.
``slow`` (only at ``compute``) makes the device a slower one: after each closure it sleeps
``factor - 1`` times what the closure took, so every task there takes ``factor`` times its time, the
stream's later work waiting behind it as it would behind a slow GPU.
Under ``torchrun`` every rank reads the same ``ROUNDPIPE_FAULTS``: ``rank`` makes a fault fire on
that rank only (``RANK``), and ``restart`` only in that attempt (``TORCHELASTIC_RESTART_COUNT``, 0
before the first restart), so that a kill fires once and the restarted ranks run on.
A fault fires ``times`` times (default once; a ``slow`` fault on every match) and counts how often
it fired (``fired``); a ``slow`` one also sums the seconds it measured (``measured_s``) and slept
(``slept_s``), which is how tests see it work without timing anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from roundpipe.errors import ConfigError, DeviceOutOfMemory

POINTS = ("forward", "backward", "upload", "download", "grads", "optimizer", "data", "checkpoint", "compute")
KINDS = ("error", "oom", "stall", "kill", "nan", "slow", "sticky")
FILTERS = ("step", "layer", "microbatch", "device")
ENV = "ROUNDPIPE_FAULTS"


class InjectedFault(RuntimeError):
    """The failure a fault of kind ``error`` raises."""


class StickyFault(InjectedFault):
    """The failure a fault of kind ``sticky`` raises: like a CUDA error that leaves the device unusable
    (an illegal memory access, a device-side assert), every later use of the backend fails, its
    ``reset`` included (the cpu backend models it: ``CpuBackend.reset`` raises)."""

    sticky = True


@dataclass
class Fault:
    where: str
    kind: str = "error"
    step: int | None = None
    layer: str | None = None
    microbatch: int | None = None
    device: str | None = None
    seconds: float = 3600.0  # how long a stall sleeps
    times: int = 1
    factor: float = 2.0  # a slow fault: each matching closure takes this many times its time
    rank: int | None = None  # only on this rank of a torchrun launch (RANK; 0 without one)
    restart: int | None = None  # only in this attempt of a torchrun launch (TORCHELASTIC_RESTART_COUNT)
    fired: int = field(default=0, compare=False)
    measured_s: float = field(default=0.0, compare=False)  # slow: seconds the closures took
    slept_s: float = field(default=0.0, compare=False)  # slow: seconds added after them

    def __post_init__(self):
        if self.where not in POINTS:
            raise ConfigError(f"fault point {self.where!r} is not one of {', '.join(POINTS)}")
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind in ("oom", "sticky") and self.where in ("optimizer", "data", "checkpoint"):
            raise ConfigError(f"an {self.kind} fault needs a device point, not {self.where!r}")
        if self.kind == "nan" and self.where not in ("forward", "backward"):
            raise ConfigError(f"a nan fault needs a tensor point (forward or backward), not {self.where!r}")
        self._check_slow()
        for name in ("rank", "restart"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"a fault's {name} is a non-negative int or null, got {value!r}")

    def _check_slow(self) -> None:
        if (self.kind == "slow") != (self.where == "compute"):
            raise ConfigError(
                f"a {self.kind} fault at {self.where!r}: kind 'slow' goes with where='compute' and "
                "only there (the other kinds act at a point of the run; a slow device is a timing)"
            )
        if self.where == "compute" and (self.step, self.layer, self.microbatch) != (None, None, None):
            raise ConfigError(
                "a compute fault matches by device only (the stream that times the closure knows "
                f"no step, layer or microbatch); drop step={self.step}, layer={self.layer}, "
                f"microbatch={self.microbatch}"
            )
        if self.kind == "slow" and not (
            isinstance(self.factor, (int, float)) and 1.0 <= self.factor < float("inf")
        ):
            raise ConfigError(
                f"a slow fault's factor is how many times its normal time a task takes: a finite "
                f"number >= 1, got {self.factor!r}"
            )

    def matches(self, where: str, context: dict) -> bool:
        if where != self.where or (self.kind != "slow" and self.fired >= self.times):
            return False
        for value, variable in ((self.rank, "RANK"), (self.restart, "TORCHELASTIC_RESTART_COUNT")):
            if value is not None and value != _env_int(variable):
                return False
        return all(getattr(self, f) is None or getattr(self, f) == context.get(f) for f in FILTERS)


def _env_int(name: str) -> int:
    """An integer the launcher set (0 when unset or not a number: a single process)."""
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


_PLAN: list[Fault] | None = None
_LOCK = threading.Lock()
_stalls = threading.local()  # where a stall sleeps: the issuing closure's stream on the cpu backend


@contextlib.contextmanager
def stalls_on(sleep):
    """A ``stall`` fault at a point reached inside the block stalls through ``sleep(seconds)``: the cpu
    backend passes its stream's, so a stalled download is a slow stream, as a slow copy on a GPU
    is, not a slow thread that issues it."""
    previous = getattr(_stalls, "sleep", None)
    _stalls.sleep = sleep
    try:
        yield
    finally:
        _stalls.sleep = previous


def point(where: str, **context) -> bool:
    """A place where a run can be made to fail (see the module docstring). Free when disabled.
    True when a ``nan`` fault fired: the caller is to poison its tensor."""
    if _PLAN is None:
        return False
    with _LOCK:
        fault = next((f for f in _PLAN if f.matches(where, context)), None)
        if fault is None:
            return False
        fault.fired += 1
    if fault.kind == "nan":
        return True
    described = ", ".join(f"{k}={v}" for k, v in context.items() if v is not None)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stall":
        (getattr(_stalls, "sleep", None) or time.sleep)(fault.seconds)
        return False
    if fault.kind == "oom":
        raise DeviceOutOfMemory(
            context.get("device") or "?", f"an injected fault at {where} ({described})", 0, 0, 0
        )
    if fault.kind == "sticky":
        raise StickyFault(f"injected sticky device error at {where} ({described})")
    raise InjectedFault(f"injected fault at {where} ({described})")


def after_compute(device: str, started: float) -> None:
    """The ``compute`` point: a closure begun at ``started`` (``time.perf_counter()``) has just run
    on ``device``'s compute stream, on that stream's thread. A matching ``slow`` fault sleeps
    ``factor - 1`` times what it took. Free when disabled, as :func:`point` is."""
    if _PLAN is None:
        return
    took = time.perf_counter() - started
    with _LOCK:
        fault = next((f for f in _PLAN if f.matches("compute", {"device": device})), None)
        if fault is None:
            return
        extra = (fault.factor - 1.0) * took
        fault.fired += 1
        fault.measured_s += took
        fault.slept_s += extra
    time.sleep(extra)


@contextlib.contextmanager
def injected(*plan: Fault):
    """Enable ``plan`` inside the block (the faults keep their ``fired`` counts afterwards)."""
    global _PLAN
    previous = _PLAN
    _PLAN = list(plan)
    try:
        yield _PLAN
    finally:
        _PLAN = previous


def from_environment() -> list[Fault] | None:
    """Enable the faults ``ROUNDPIPE_FAULTS`` lists (JSON), for the rest of the process; None when
    it is unset. Raises ConfigError naming what is wrong with it."""
    global _PLAN
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        items = json.loads(text)
        plan = [Fault(**item) for item in items]
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"{ENV} must be a JSON list of faults such as "
            f'[{{"where": "forward", "step": 3, "kind": "error"}}]; got {text!r} ({e})'
        ) from e
    _PLAN = plan
    return plan
