"""Every exception roundpipe raises on purpose.

Each message says what went wrong *and what to change*. Catch `RoundpipeError` to catch them all.
"""

from __future__ import annotations


class RoundpipeError(Exception):
    """Base class of all roundpipe errors."""


class ConfigError(RoundpipeError, ValueError):
    """A RunConfig / optimizer setting is invalid (unknown dtype or policy, bad numbers, ...)."""


class DeviceSpecError(ConfigError):
    """A device spec such as ``"cuda:0,1"`` is malformed or names devices this machine lacks."""


class UnsupportedModel(RoundpipeError, TypeError):
    """The model is not a decoder-only causal LM of a supported family."""


class InputError(RoundpipeError, ValueError):
    """A batch given to ``forward_backward`` is malformed (shapes, dtypes, labels, microbatches)."""


class PipelineStateError(RoundpipeError, RuntimeError):
    """An API call came in an order the pipeline cannot honour (e.g. ``step`` before any backward)."""


class ScheduleError(RoundpipeError, ValueError):
    """A schedule table is malformed or cannot run (missing task, unmet dependency, deadlock)."""


class PlanError(RoundpipeError, ValueError):
    """No partition / plan satisfies the constraints (memory budget, device count, ...)."""


class DeviceOutOfMemory(RoundpipeError, MemoryError):
    """A device (real or virtual) cannot hold what it was asked to hold.

    Attributes:
        device: the device name, e.g. ``"cpu:1"`` or ``"cuda:0"``.
        what: what was being placed (``"weights of layers.3"``, ``"activation F2.1"``, ...).
        nbytes: bytes requested; in_use: bytes already held; capacity: the device's capacity.
    """

    # Where it happened, when a worker knows (a task's compute or download): else None.
    task: str | None = None
    layer: str | None = None
    microbatch: int | None = None
    step: int | None = None

    def __init__(self, device: str, what: str, nbytes: int, in_use: int, capacity: int):
        self.device, self.what, self.nbytes, self.in_use, self.capacity = (
            device,
            what,
            nbytes,
            in_use,
            capacity,
        )
        super().__init__(
            f"{device} is out of memory placing {what}: needs {nbytes:,} bytes, holds {in_use:,} of "
            f"{capacity:,}. Use a device with more memory, more microbatches or shorter sequences, "
            f"or split the model into smaller layers."
        )


class StageError(RoundpipeError, RuntimeError):
    """A task failed on a worker. Carries where it failed (``step`` is the pipeline's
    ``forward_backward`` count); the original exception is ``__cause__``."""

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        layer: str | None = None,
        microbatch: int | None = None,
        device: str | None = None,
        task: str | None = None,
        step: int | None = None,
    ):
        self.stage, self.layer, self.microbatch, self.device, self.task, self.step = (
            stage,
            layer,
            microbatch,
            device,
            task,
            step,
        )
        where = ", ".join(
            f"{k}={v}"
            for k, v in (
                ("step", step),
                ("task", task),
                ("stage", stage),
                ("layer", layer),
                ("microbatch", microbatch),
                ("device", device),
            )
            if v is not None
        )
        super().__init__(f"{message} [{where}]" if where else message)


class OptimizerError(StageError):
    """The CPU optimizer failed while stepping a layer."""


class NonFiniteError(StageError, FloatingPointError):
    """A NaN or Inf appeared in a step (``nan_policy="stop"``), found before the optimizer applied
    it. ``what`` is ``"output"`` (a layer's forward output, the loss included) or ``"gradient"``
    (a weight gradient); ``layer``, ``microbatch``, ``device`` and ``step`` say where it first
    appeared: the lowest layer for an output, the highest for a gradient (the order the values
    flow in)."""

    def __init__(self, message: str, *, what: str, **where):
        self.what = what
        super().__init__(message, **where)


class DataParallelError(RoundpipeError, RuntimeError):
    """Data parallelism across processes failed: a peer rank raised, was lost or timed out, or the
    ranks disagree on how they run (``rank`` is this process's)."""

    def __init__(self, message: str, *, rank: int | None = None):
        self.rank = rank
        super().__init__(message)


class WatchdogTimeout(RoundpipeError, TimeoutError):
    """No worker made progress for the configured time; the message shows what each one waits for."""


class StreamProtocolError(RoundpipeError, RuntimeError):
    """The runtime broke a rule of CUDA's execution or memory model (docs/design.md §5).

    Raised by the cpu backend's checks: a device tensor used on a stream it was not handed over to
    (``record_stream``), a cross-stream access not ordered by an event, a device tensor alive that
    the memory ledger does not account for or has already released, or a device that still holds
    tensors after a step. The message names the tensor (tag and shape), the streams and the task.
    These are bugs in roundpipe (or in code that extends it), never in the user's input.
    """


class VirtualDataError(RoundpipeError, RuntimeError):
    """A virtual run (``devices="virtual:..."``, shapes without data) reached an operation that needs
    a tensor's values and that the virtual server does not model; the message names it."""


class RecipeError(ConfigError):
    """A training recipe (YAML or ``--set``) is invalid: an unknown key, a wrong type, a missing
    required field. The message names the key, the file and the line, and the nearest valid key."""


class DataError(InputError):
    """Training data cannot be read or used: a missing file, an empty file, a sample without the
    fields its format needs, undecodable bytes, or no sample left after filtering."""


class CheckpointError(RoundpipeError, RuntimeError):
    """A checkpoint cannot be written or loaded: a file missing, truncated or edited (its size or
    checksum disagrees with the manifest), or state that does not belong to this run."""


class HostMemoryError(RoundpipeError, MemoryError):
    """The run needs more host RAM than this machine has; the message gives the figures and levers."""


class DeviceMemoryError(RoundpipeError, MemoryError):
    """A plan needs more memory on a device than the device has free, found before the plan runs
    (``roundpipe/runtime/memory_guard.py``); the message gives the figures and the levers.

    Attributes:
        device: the device name, e.g. ``"cuda:1"``; planned: the plan's peak bytes on it (the
        planner's estimate); free: the bytes free on it when the plan was about to run.
    """

    def __init__(self, message: str, *, device: str, planned: int, free: int):
        self.device, self.planned, self.free = device, planned, free
        super().__init__(message)


def add_note(err: BaseException, note: str) -> None:
    """Add ``note`` to ``err`` as Python 3.11+ does (``err.add_note``, printed under the traceback);
    on Python 3.10, whose exceptions have no notes, the note joins the message."""
    add = getattr(err, "add_note", None)
    if callable(add):
        add(note)
    else:
        fold_note(err, note)


def fold_note(err: BaseException, note: str) -> None:
    """Python 3.10's way of :func:`add_note`: the note on a line of its own after the message."""
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}", *err.args[1:])
    else:
        err.args = (*err.args, note)


class Aborted(RuntimeError):
    """A wait inside the runtime was cut short because the pipeline is shutting down after another
    failure (that failure is what the caller gets)."""
