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
- ``optimizer``: the host stepping one layer's parameters (``layer``);
- ``data``: the trainer taking a step's batches (``step``); ``checkpoint``: writing a checkpoint
  (``step``).

``step`` is the pipeline's ``forward_backward`` count for the device points (the trainer's step
when every step is one call) and the trainer's step for ``data`` and ``checkpoint``.

Kinds: ``error`` raises :class:`InjectedFault` (a plain ``RuntimeError``: the code around the point
treats it as it treats any failure there); ``oom`` raises ``DeviceOutOfMemory`` for the point's
device; ``stall`` sleeps ``seconds`` (the watchdog's to catch); ``kill`` sends SIGKILL to the
process. A fault fires ``times`` times (default once) and counts how often it fired (``fired``).
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

POINTS = ("forward", "backward", "upload", "download", "optimizer", "data", "checkpoint")
KINDS = ("error", "oom", "stall", "kill")
FILTERS = ("step", "layer", "microbatch", "device")
ENV = "ROUNDPIPE_FAULTS"


class InjectedFault(RuntimeError):
    """The failure a fault of kind ``error`` raises."""


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
    fired: int = field(default=0, compare=False)

    def __post_init__(self):
        if self.where not in POINTS:
            raise ConfigError(f"fault point {self.where!r} is not one of {', '.join(POINTS)}")
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "oom" and self.where in ("optimizer", "data", "checkpoint"):
            raise ConfigError(f"an oom fault needs a device point, not {self.where!r}")

    def matches(self, where: str, context: dict) -> bool:
        if where != self.where or self.fired >= self.times:
            return False
        return all(getattr(self, f) is None or getattr(self, f) == context.get(f) for f in FILTERS)


_PLAN: list[Fault] | None = None
_LOCK = threading.Lock()


def point(where: str, **context) -> None:
    """A place where a run can be made to fail (see the module docstring). Free when disabled."""
    if _PLAN is None:
        return
    with _LOCK:
        fault = next((f for f in _PLAN if f.matches(where, context)), None)
        if fault is None:
            return
        fault.fired += 1
    described = ", ".join(f"{k}={v}" for k, v in context.items() if v is not None)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stall":
        time.sleep(fault.seconds)
        return
    if fault.kind == "oom":
        raise DeviceOutOfMemory(
            context.get("device") or "?", f"an injected fault at {where} ({described})", 0, 0, 0
        )
    raise InjectedFault(f"injected fault at {where} ({described})")


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
