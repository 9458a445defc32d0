"""CUDA's clock on the cpu backend: a closure runs when it is issued, its kernels run later.

On CUDA, ``Stream.submit(fn)`` calls ``fn`` at once on the issuing thread: everything ``fn`` does on
the host (allocate, drop the last reference to a tensor, take or give back a pinned buffer, book the
ledger) happens *then*, while the GPU may be far behind; only its kernels wait in the stream. The cpu
backend keeps the same clock. A stream's :class:`IssueMode` (a ``TorchDispatchMode``) is entered on
the issuing thread around each closure and sees every aten operation it makes:

- **views and metadata** (``view``, ``transpose``, ``size``, an in-place view such as
  ``unsqueeze_``) run at once: they touch no data;
- **compute** (every other operation on device tensors, and factories): the outputs' shapes, strides
  and dtypes come from the operation's meta kernel (cached per signature), their memory from the
  device's caching-allocator model (``cpu_allocator.py``) on this stream, at issue time; the
  operation itself is queued on the stream as a *kernel* that reads and writes through views of
  the allocator's segments, so the program may drop a tensor at once (freeing its block, as CUDA
  frees at issue) while the kernel still uses the bytes. Operations with an ``out=`` variant write
  straight into the allocated outputs;
- **host syncs**: reading device data on the host (``.item()``, ``bool(t)``, ``.all()`` used as a
  condition, ``.tolist()``, ``.numpy()``, an operation whose output shape depends on the data such as
  ``nonzero``) waits for the stream to reach the point of issue, then runs; each one is counted with
  the operation and the call site (``HostSyncs``), because on a GPU it stalls the issuing thread
  until the stream drains;
- **host work**: an operation on host tensors only (none of its tensors is device memory) runs at
  once, as the CPU runs it on CUDA;
- **random numbers**: a kernel that draws them draws from the device generator of the
  ``Device.seeded`` block it was issued in (that block's own generator, consumed in stream order),
  and host work that draws (a random operation on host tensors, run at issue as on CUDA) from the
  block's host generator, at once; so a recomputation replays the forward's draws without any lock
  held while the layer is issued. Outside a seeded block both draw from (and advance) torch's
  default generator, as CUDA's kernels advance the device's.

Device memory is what the allocator has handed out; host memory is everything else (what a closure
makes inside :func:`host_allocation`, and every tensor made outside closures).

The parts: ``cpu_op_rules.py`` (what each aten operation is, its outputs from the meta kernel),
``cpu_kernels.py`` (the queued kernels) and ``cpu_host_syncs.py`` (the count of host syncs).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.backend.cpu_host_syncs import call_site
from roundpipe.backend.cpu_kernels import Kernel, KernelRef, KernelRefList, drawing_from
from roundpipe.backend.cpu_op_rules import (
    DIRECT,
    RULES,
    SYNC,
    VIEW,
    MetaUnavailable,
    OpRule,
    fresh_specs,
    rule_of,
    storage_bytes,
)
from roundpipe.backend.grouped_mm import GROUPED_MM, reads_offsets

_local = threading.local()


@contextmanager
def host_allocation():
    """Tensors made inside are host memory (a download's destination), not device memory."""
    _local.host = getattr(_local, "host", 0) + 1
    try:
        yield
    finally:
        _local.host -= 1


@contextmanager
def task_generator(device: torch.Generator, host: torch.Generator):
    """Random kernels issued inside draw from ``device`` (in stream order), random host work from
    ``host`` (at issue): ``Device.seeded`` on the cpu backend."""
    previous = getattr(_local, "generator", None), getattr(_local, "host_generator", None)
    _local.generator, _local.host_generator = device, host
    try:
        yield
    finally:
        _local.generator, _local.host_generator = previous


# ---------------------------------------------------------------------------------- the mode
class _ReadGuard(TorchFunctionMode):
    """Catches host reads that never reach the dispatcher (``tolist``, ``numpy``, printing) on device
    tensors: they sync first, as on CUDA."""

    _READS = frozenset(
        {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__repr__, torch.Tensor.__format__}
    )

    def __init__(self, issue: IssueMode):
        super().__init__()
        self.issue = issue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._READS and args and isinstance(args[0], torch.Tensor):
            issue = self.issue
            if issue.backend.block_of(args[0]) is not None:
                issue.host_sync(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class IssueMode(TorchDispatchMode):
    """Entered on the issuing thread around each closure submitted to one cpu stream.

    ``run(fn, task)`` runs the closure, then checks what it left on the device against the memory
    ledger (docs/design.md §5): a device tensor it made and left alive must be reserved, one whose
    reservation it released must be dead.
    """

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.device = stream.device
        self.backend = stream.device.backend
        self.allocator = stream.device.allocator
        self.sanitizer = self.backend.sanitizer
        self.task = "?"
        self.ops = 0  # aten operations issued through this mode (each one a Python call here)
        self._made: list = []
        self._guard = _ReadGuard(self)

    def run(self, fn, task: str) -> None:
        self.task, self._made = task, []
        with self.sanitizer.collecting_releases() as released, self:
            fn()
        made, self._made = self._made, []
        self.sanitizer.check_leftovers(made, released, self.task, self.stream)

    # ------------------------------------------------------------------ syncs
    def host_sync(self, what: str) -> None:
        """Wait on the host until the stream has run everything issued so far (a counted sync)."""
        self.backend.host_syncs.add(what, call_site())
        self.stream.wait_until_issued()

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: skip torch's per-call dynamo guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        self.ops += 1
        rule = RULES.get(func) or rule_of(func)
        kind = rule.kind
        if kind is VIEW or kind is DIRECT or getattr(_local, "host", 0):
            return func(*args, **kwargs)
        registry = self.backend.blocks
        checking = self.sanitizer.checking
        pool = self.backend.host_buffers
        pinned = getattr(pool, "records", None) if checking else None
        copies = []  # the pool's host buffers the kernel will read or write (a pending copy)
        # One pass over the tensor arguments: their blocks (device memory) or themselves (host),
        # what the kernel will see of each, and the sanitizer's checks.
        on_device = host_data = False
        touched = []  # (block, written) for the sanitizer
        nargs = len(args)
        kargs = list(args)
        kkwargs = dict(kwargs) if kwargs else kwargs
        for i, name, written in rule.args:
            if i < nargs:
                v = args[i]
            elif name in kwargs:
                v = kwargs[name]
            else:
                continue
            if isinstance(v, torch.Tensor):
                block = registry.get(v.untyped_storage().data_ptr())
                if block is not None:
                    on_device = True
                    kv = KernelRef.of(block, v)
                    if checking:
                        touched.append((block, written))
                else:
                    # Host memory (or no memory): the kernel keeps the bytes, never the program's
                    # tensor, whose autograd graph would stay alive until the kernel has run.
                    kv = v.detach()
                    if v.numel():
                        host_data = True
                        if pinned is not None:
                            record = pinned.get(v.untyped_storage().data_ptr())
                            if record is not None:
                                copies.append(record)
            elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor | None):
                kl = []
                for x in v:
                    if isinstance(x, torch.Tensor):
                        block = registry.get(x.untyped_storage().data_ptr())
                        if block is not None:
                            on_device = True
                            kl.append(KernelRef.of(block, x))
                            if checking:
                                touched.append((block, written))
                            continue
                        if x.numel():
                            host_data = True
                        x = x.detach()
                    kl.append(x)
                kv = KernelRefList(kl)
            else:
                continue
            if i < nargs:
                kargs[i] = kv
            else:
                kkwargs[name] = kv
        if not on_device and host_data:  # host work: the CPU runs it now, as on CUDA
            if rule.random:
                return drawing_from(getattr(_local, "host_generator", None), func, *args, **kwargs)
            return func(*args, **kwargs)
        if kind is SYNC:
            self.host_sync(str(func))
            self.backend.needs_values(str(func))
            return func(*args, **kwargs)
        if func is GROUPED_MM and reads_offsets(args, kwargs, self.backend.grouped_mm_fast_path):
            self.host_sync(f"{func} (torch's fallback reads the group offsets on the host)")
        if touched:
            self.sanitizer.check_accesses(touched, self.stream, self.task)
        if copies:
            stream = self.stream
            for record in copies:
                record.accesses.append((stream, stream.clock[stream]))
        try:
            specs = fresh_specs(func, rule, args, kwargs)
        except MetaUnavailable as e:
            return self._eagerly(func, args, kwargs, e)
        return self._queue(func, rule, args, kwargs, kargs, kkwargs, specs)

    def _allocate(self, spec):
        """A device tensor for one fresh output spec, and the kernel's reference to it."""
        shape, stride, dtype, nbytes = spec
        if nbytes == 0:  # nothing to allocate; the kernel writes its own (empty) tensor, not the program's
            return (
                torch.empty_strided(shape, stride, dtype=dtype),
                torch.empty_strided(shape, stride, dtype=dtype),
            )
        allocator = self.allocator
        block = allocator.malloc(nbytes, self.stream, self.task, shape, dtype)
        block.generation = self.sanitizer.generation
        self._made.append((block, block.serial))
        return allocator.tensor(block, shape, stride, dtype), KernelRef(
            block.segment, block.offset // dtype.itemsize, shape, stride, dtype
        )

    def _queue(self, func, rule: OpRule, args, kwargs, kargs, kkwargs, specs):
        users, kerns = [], []
        for spec in specs:
            if spec is None:
                users.append(None)
                kerns.append(None)
            elif type(spec) is list:
                pairs = [self._allocate(s) if s is not None else (None, None) for s in spec]
                users.append([u for u, _ in pairs])
                kerns.append(KernelRefList([k for _, k in pairs]))
            else:
                u, k = self._allocate(spec)
                users.append(u)
                kerns.append(k)
        if not rule.no_data:
            generator = getattr(_local, "generator", None) if rule.random else None
            self.stream.enqueue(Kernel(func, rule, kargs, kkwargs, kerns, rule.random, generator))
        returns = rule.returns
        if len(returns) == 1:
            kind, j, _ = returns[0]
            if kind == "fresh":
                return users[j]
            return args[j] if j < len(args) else kwargs[_arg_name(func, j)]
        out = []
        for kind, j, _ in returns:
            if kind == "fresh":
                out.append(users[j])
            else:
                out.append(args[j] if j < len(args) else kwargs[_arg_name(func, j)])
        return tuple(out) if out else None

    def _eagerly(self, func, args, kwargs, why: MetaUnavailable):
        """Run an operation whose outputs the meta kernel cannot give: wait for the stream (a host
        sync when the outputs depend on the data, as on CUDA; else a stall of this backend only),
        run it on the issuing thread, and move its outputs into device memory."""
        self.backend.needs_values(f"{func} ({why})")
        if why.data_dependent:
            self.host_sync(f"{func} (output shape depends on the data)")
        else:
            self.backend.host_syncs.stall(str(func))
            self.stream.wait_until_issued()
        if rule_of(func).random:
            out = drawing_from(getattr(_local, "generator", None), func, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        return _map_tensors(out, self._adopt)

    def _adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A system-allocated result as device memory (a block of this stream holding its bytes)."""
        if self.backend.block_of(t) is not None or t.numel() == 0:
            return t
        shape, stride = tuple(t.shape), tuple(t.stride())
        user, ref = self._allocate((shape, stride, t.dtype, storage_bytes(shape, stride, t.dtype)))
        ref.tensor().copy_(t)
        return user


def _arg_name(func, j: int) -> str:
    return func._schema.arguments[j].name


def _map_tensors(v, fn):
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tensors(x, fn) for x in v)
    return v
