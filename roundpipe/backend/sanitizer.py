"""The cpu backend's model of CUDA: live device memory and a stream sanitizer (docs/design.md §5).

Every closure a cpu stream runs executes under a ``TorchDispatchMode`` (:class:`StreamMode`) that
sees each aten operation with its inputs and outputs, as PyTorch's CUDA stream sanitizer does
(``torch.cuda._sanitizer``). From that the :class:`Sanitizer` keeps a :class:`StorageRecord` per
device storage: who made it (device, stream, the closure's name), its size, the streams it was
handed over to (``Device.hand_over``; ``record_stream`` on CUDA) and, with checking on, its last
write and the reads since, each stamped with the stream's logical clock. Events carry vector
clocks, so whether one stream's access is ordered after another's is a comparison.

What it enforces (each violation is a ``StreamProtocolError`` naming the tensor, streams and task):

- **Live memory** (always): a device's bytes in use are the sizes of its storages that are alive
  (a finalizer on each storage takes it off), so ``DeviceOutOfMemory`` and ``peak`` follow what
  really exists. At the end of a closure every device storage it made that is still alive must be
  reserved in the device's ``MemoryLedger``, and every storage whose reservation it released must
  be dead: a released tensor still alive is kept by something (a cached module shell, a slot) or
  was released before its last use. After a step a device must hold nothing (``check_empty``).
- **Hand-over** (checking on): a device tensor used on a stream other than the one that made it
  must have been handed over to that stream first; on CUDA the caching allocator could otherwise
  give its block to a new tensor while that stream still reads it. And it is never used by
  another device's stream.
- **Ordering** (checking on): a cross-stream read must be ordered after the last write by an event,
  and a write after every earlier read and write.

Host tensors (made inside :func:`host_allocation`, or before any closure) are not tracked.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from functools import cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.errors import DeviceOutOfMemory, StreamProtocolError

_local = threading.local()


@contextmanager
def host_allocation():
    """Tensors made inside are host memory (a download's destination), not device memory."""
    _local.host = getattr(_local, "host", 0) + 1
    try:
        yield
    finally:
        _local.host -= 1


def _in_host_allocation() -> bool:
    return getattr(_local, "host", 0) > 0


class StorageRecord:
    """One device storage: where it came from, who may use it, and its last accesses."""

    __slots__ = ("ptr", "nbytes", "device", "stream", "what", "tag", "shape", "dtype", "handed")
    __slots__ += ("write", "reads", "alive", "reserved", "ref", "generation")

    def __init__(self, ptr: int, nbytes: int, stream, what: str, t: torch.Tensor, clock: int):
        self.ptr, self.nbytes, self.stream, self.what = ptr, nbytes, stream, what
        self.tag = what  # what the ledger books it as, once reserved (else: the closure that made it)
        self.device = stream.device
        self.shape, self.dtype = tuple(t.shape), t.dtype
        self.handed: set = set()
        self.write = (stream, clock)
        self.reads: dict = {}
        self.alive = True
        self.reserved = False
        self.generation = 0

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        made = "" if self.tag == self.what else f" (made by {self.what!r})"
        return f"tensor {self.tag!r} {list(self.shape)} {dtype} of {self.device.name}{made}"


def stream_name(stream) -> str:
    return f"{stream.device.name}/{stream.name}"


class LiveMemory:
    """Bytes of the device storages alive on one virtual device, against a capacity."""

    def __init__(self, device: str, capacity: int | None, measured: bool = True):
        self.device = device
        self.capacity = capacity
        self.measured = measured  # False: nothing watches the storages (no sanitizer, no capacity)
        self.in_use = 0
        self.peak = 0
        self.records: set[StorageRecord] = set()

    def add(self, r: StorageRecord) -> None:
        self.records.add(r)
        self.in_use += r.nbytes
        if self.capacity is not None and self.in_use > self.capacity:
            held = self.in_use - r.nbytes
            raise DeviceOutOfMemory(self.device, r.describe(), r.nbytes, held, self.capacity)
        self.peak = max(self.peak, self.in_use)

    def remove(self, r: StorageRecord) -> None:
        self.records.discard(r)
        self.in_use -= r.nbytes

    def reset_peak(self) -> None:
        self.peak = self.in_use


class Sanitizer:
    """The records of every virtual device of one backend (one lock: streams run on threads)."""

    def __init__(self, checking: bool):
        self.checking = checking
        self.records: dict[int, StorageRecord] = {}
        self.lock = threading.RLock()
        self.generation = 0  # bumped when a failed step is abandoned

    # -------------------------------------------------------------- storages
    def lookup(self, t: torch.Tensor) -> StorageRecord | None:
        if t.device.type != "cpu":
            return None
        r = self.records.get(t.untyped_storage().data_ptr())
        return r if r is not None and r.alive else None

    def register(self, storage, t: torch.Tensor, stream, what: str) -> StorageRecord | None:
        """Record ``storage`` (of ``t``, just made by ``what`` on ``stream``) as device memory."""
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        if nbytes == 0 or ptr == 0:
            return None
        with self.lock:
            old = self.records.get(ptr)
            if old is not None and old.alive:
                return None  # a view of a storage it already knows
            r = StorageRecord(ptr, nbytes, stream, what, t, stream.clock.get(stream, 0))
            r.generation = self.generation
            self.records[ptr] = r
            # A weak reference whose callback runs when the storage dies (cheaper than finalize).
            r.ref = weakref.ref(storage, lambda _, r=r: self._freed(r))
            stream.device.memory.add(r)
        return r

    def _freed(self, r: StorageRecord) -> None:
        with self.lock:
            r.alive = False
            if self.records.get(r.ptr) is r:
                del self.records[r.ptr]
            r.device.memory.remove(r)

    def hand_over(self, t: torch.Tensor, stream) -> None:
        with self.lock:
            r = self.lookup(t)
            if r is not None:
                r.handed.add(stream)

    # -------------------------------------------------------------- the ledger's view
    def reserved(self, tensors, reserve: bool, what: str) -> list[StorageRecord]:
        """Mark the storages of ``tensors`` reserved as ``what`` (or released); their records."""
        out = []
        with self.lock:
            for t in tensors:
                r = self.lookup(t)
                if r is not None:
                    r.reserved = reserve
                    r.tag = what
                    out.append(r)
        released = getattr(_local, "released", None)
        if not reserve and released is not None:
            released.extend(out)
        return out

    def held(self, device) -> list[StorageRecord]:
        """What ``device`` still holds of the steps since the last abandoned one, largest first."""
        with self.lock:
            mine = [r for r in device.memory.records if r.generation == self.generation]
            return sorted(mine, key=lambda r: -r.nbytes)

    def abandon(self) -> None:
        """After a failed step: what it left alive (held by the caller's exception, say) still
        counts as live memory but no longer as a leak of the steps that follow."""
        with self.lock:
            self.generation += 1

    # -------------------------------------------------------------- accesses
    def check(self, r: StorageRecord, is_write: bool, stream, task: str) -> None:
        """Check (and record) an access to ``r``'s storage by ``task`` on ``stream`` (lock held)."""
        where = f"by {task!r} on {stream_name(stream)}"
        if r.device is not stream.device:
            raise StreamProtocolError(
                f"{r.describe()} is used {where}, another device: move it with a copy "
                "(to_host on its own device, then to_device), never share device tensors"
            )
        if r.stream is not stream and stream not in r.handed:
            raise StreamProtocolError(
                f"{r.describe()} was made on {stream_name(r.stream)} and is used {where} "
                f"without being handed over to {stream.name}: call device.hand_over(tensor, "
                f"streams[{stream.name!r}]) (record_stream on CUDA) once it exists, or the caching "
                "allocator may reuse its memory while this stream still reads it"
            )
        clock = stream.clock
        ws, wt = r.write
        if ws is not stream and clock.get(ws, 0) < wt:
            kind = "written" if is_write else "read"
            raise StreamProtocolError(
                f"{r.describe()} is {kind} {where} without waiting for its last write on "
                f"{stream_name(ws)}: make {stream.name} wait on an event recorded after that write"
            )
        if is_write:
            for rs, rt in r.reads.items():
                if rs is not stream and clock.get(rs, 0) < rt:
                    raise StreamProtocolError(
                        f"{r.describe()} is overwritten {where} while a read of it on "
                        f"{stream_name(rs)} is not ordered before: wait on an event recorded after that read"
                    )
            r.write = (stream, clock.get(stream, 0))
            r.reads = {}
        else:
            r.reads[stream] = clock.get(stream, 0)


class _OpInfo:
    __slots__ = ("args", "view", "fresh")

    def __init__(self, args, view, fresh):
        self.args, self.view, self.fresh = args, view, fresh


@cache
def _op_info(func) -> _OpInfo:
    """Per aten overload: its tensor arguments as ``(position, name, is_write)``; whether it is a
    pure view (no data is touched: nothing to check); whether it may return new storage (a return
    without alias information: in-place ops and views return what they were given)."""
    schema = func._schema
    args = tuple(
        (i, a.name, a.alias_info is not None and a.alias_info.is_write)
        for i, a in enumerate(schema.arguments)
    )
    writes = any(w for _, _, w in args)
    aliased = all(r.alias_info is not None for r in schema.returns)
    return _OpInfo(args, bool(schema.returns) and aliased and not writes, not aliased)


class StreamMode(TorchDispatchMode):
    """Entered by a cpu stream's thread around each closure it runs (see the module docstring)."""

    def __init__(self, stream, sanitizer: Sanitizer):
        super().__init__()
        self.stream = stream
        self.san = sanitizer
        self.task = "?"
        self._made: list[StorageRecord] = []

    def run(self, fn, task: str) -> None:
        """Run one closure under the mode, then check what it left alive (raises on a violation)."""
        stream = self.stream
        stream.clock[stream] = stream.clock.get(stream, 0) + 1
        self.task, self._made = task, []
        _local.released = released = []
        try:
            with self:
                fn()
        finally:
            _local.released = None
        self._check_leftovers(self._made, released)
        self._made = []

    def _check_leftovers(self, made: list[StorageRecord], released: list[StorageRecord]) -> None:
        where = f"{self.task!r} on {stream_name(self.stream)}"
        for r in released:
            if r.alive:
                raise StreamProtocolError(
                    f"{r.describe()} was released from the memory ledger by {where} but is still "
                    "alive: something still references it (a cached module shell? a slot?), or it "
                    "was released before its last use; release it in stream order after that use"
                )
        for r in made:
            if r.alive and not r.reserved:
                raise StreamProtocolError(
                    f"{r.describe()} made by {where} outlives it but is not reserved in the memory "
                    "ledger: reserve what a closure leaves on the device, or let it die"
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Hot path: every aten op of every closure comes through here, so it avoids generators and
        # asks each tensor argument for its storage once.
        if kwargs is None:
            kwargs = {}
        info = _op_info(func)
        if info.view:
            return func(*args, **kwargs)
        san = self.san
        ptrs: list[tuple[int, bool]] = []  # (storage pointer, written) of every tensor argument
        nargs = len(args)
        for i, name, is_write in info.args:
            v = args[i] if i < nargs else kwargs.get(name)
            if isinstance(v, torch.Tensor):
                ptrs.append((v.untyped_storage().data_ptr(), is_write))
            elif isinstance(v, (list, tuple)):
                for x in v:
                    if isinstance(x, torch.Tensor):
                        ptrs.append((x.untyped_storage().data_ptr(), is_write))
        if san.checking:
            records = san.records
            hits = [(records[p], w) for p, w in ptrs if p in records]
            if hits:
                with san.lock:
                    for r, is_write in hits:
                        if r.alive:
                            san.check(r, is_write, self.stream, self.task)
        out = func(*args, **kwargs)
        if info.fresh and not _in_host_allocation():
            inputs = {p for p, _ in ptrs}
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in inputs and storage.device.type == "cpu":
                        r = san.register(storage, t, self.stream, self.task)
                        if r is not None:
                            self._made.append(r)
        return out
