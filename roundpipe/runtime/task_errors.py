"""What a failure inside a worker's closure becomes for the caller: the one place this is decided.

Every closure a worker issues (an upload, a compute, a download) runs on a stream; an exception in
it is carried to the caller's thread by the executor. ``failing_as_task`` wraps a closure's body so
that the error says where it happened (task, stage, layer, microbatch, step, device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from roundpipe.backend import Device
from roundpipe.backend.base import as_device_error
from roundpipe.errors import DeviceOutOfMemory, RoundpipeError, StageError, add_note


def task_error(e: BaseException, device: Device, message: str, **where) -> BaseException:
    """The error ``e`` becomes: the allocator running out (CUDA's or the cpu backend's model) is
    ``DeviceOutOfMemory`` naming the device and the task; a roundpipe error stays as it is;
    anything else is a ``StageError`` with ``message`` and ``where`` it happened (task, stage,
    layer, microbatch, step), caused by ``e``."""
    e = as_device_error(e, device, str(where.get("task", "?")))
    if isinstance(e, DeviceOutOfMemory):
        if getattr(e, "task", None) is None:
            e.task, e.layer = where.get("task"), where.get("layer")
            e.microbatch, e.step = where.get("microbatch"), where.get("step")
        return e
    if isinstance(e, RoundpipeError):
        return e
    err = StageError(message, device=device.name, **where)
    err.__cause__ = e
    return err


@contextlib.contextmanager
def failing_as_task(
    device: Device,
    message: Callable[[BaseException], str],
    where: dict,
    oom_note: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Raise what ``task_error`` makes of an exception in the body: ``message(e)`` and ``where``
    (read when the error happens, so the body may update it, e.g. the layer it is running).
    ``oom_note``: a note added to a ``DeviceOutOfMemory`` that no inner handler placed yet."""
    try:
        yield
    except BaseException as e:
        placed = getattr(e, "task", None) is not None  # an inner handler said where already
        err = task_error(e, device, message(e), **where)
        if oom_note is not None and isinstance(err, DeviceOutOfMemory) and not placed:
            add_note(err, oom_note())
        if err is e:
            raise
        raise err from e
