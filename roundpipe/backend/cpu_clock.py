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
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_local = threading.local()
GENERATOR_LOCK = threading.Lock()  # the default CPU generator, swapped while a seeded draw runs


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


def drawing_from(generator: torch.Generator | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with torch's default generator standing in for ``generator`` (which
    it then advances); ``None``: the default generator itself. The default generator is
    process-wide, so the swap holds ``GENERATOR_LOCK``."""
    with GENERATOR_LOCK:
        if generator is None:
            return fn(*args, **kwargs)
        default = torch.default_generator
        saved = default.get_state()
        default.set_state(generator.get_state())
        try:
            return fn(*args, **kwargs)
        finally:
            generator.set_state(default.get_state())
            default.set_state(saved)


# ---------------------------------------------------------------------------------- host syncs
_ROUNDPIPE_BACKEND = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def call_site() -> str:
    """``file:line (function)`` of the nearest caller outside torch and this backend."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH) or name.startswith(_ROUNDPIPE_BACKEND) or name.startswith("<")):
            return f"{_short(name)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/roundpipe/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) - (0 if marker == "/site-packages/" else len("roundpipe/")) :]
    return path


@dataclass
class HostSyncs:
    """Host syncs since the last ``reset``: how many, and ``(what, call site)`` counts."""

    count: int = 0
    sites: Counter = field(default_factory=Counter)
    stalls: Counter = field(default_factory=Counter)  # backend artifacts: ops without a meta kernel
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, what: str, site: str) -> None:
        with self._lock:
            self.count += 1
            self.sites[(what, site)] += 1

    def stall(self, what: str) -> None:
        with self._lock:
            self.stalls[what] += 1

    def reset(self) -> None:
        with self._lock:
            self.count = 0
            self.sites = Counter()
            self.stalls = Counter()

    def report(self) -> dict:
        with self._lock:
            return {
                "count": self.count,
                "sites": [
                    {"what": what, "where": site, "count": n} for (what, site), n in self.sites.most_common()
                ],
                "eager_ops": dict(self.stalls),
            }


# ---------------------------------------------------------------------------------- op rules
VIEW, DIRECT, SYNC, COMPUTE = "view", "direct", "sync", "compute"
# Operations that read device data for the host whatever their schema says.
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
# Schemas that say "fresh" for what is a view, or that queue device work despite returning nothing.
_AS_VIEW = {aten._unsafe_view.default, aten.lift_fresh.default}
_QUEUED = {aten._assert_async.default, aten._assert_async.msg}
_NO_DATA = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
}
_NO_DATA |= {aten.new_empty_strided.default}
# In-place changes of a tensor's metadata (the program sees them at once; no data is touched).
_METADATA = {aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default}
_METADATA |= {aten.set_.source_Storage, aten.resize_.default, aten.resize_as_.default}


class OpRule:
    """What the issue mode does with one aten overload (built once per overload)."""

    __slots__ = ("kind", "args", "returns", "out", "out_names", "random", "no_data", "meta_missing")

    def __init__(self, func):
        schema = func._schema
        tags = func.tags
        every = [
            (i, a.name, a.alias_info is not None and a.alias_info.is_write, str(a.type))
            for i, a in enumerate(schema.arguments)
        ]
        writes = any(w for _, _, w, _ in every)
        # The arguments that can hold tensors (the only ones the issue mode looks at).
        self.args = tuple((i, n, w) for i, n, w, t in every if "Tensor" in t)
        tensor_returns = [r for r in schema.returns if "Tensor" in str(r.type)]
        aliased = bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)
        self.random = torch.Tag.nondeterministic_seeded in tags
        self.no_data = func in _NO_DATA
        self.meta_missing = False
        self.returns: list[tuple] = []
        self.out, self.out_names = None, ()
        if func in _SYNC_OPS or torch.Tag.data_dependent_output in tags:
            self.kind = SYNC
        elif (
            func in _AS_VIEW
            or (aliased and not writes)
            or torch.Tag.inplace_view in tags
            or func in _METADATA
        ):
            self.kind = VIEW
        elif not tensor_returns and not writes and func not in _QUEUED:
            self.kind = DIRECT
        else:
            self.kind = COMPUTE
            self._returns(schema)
            self._out_variant(func)

    def _returns(self, schema) -> None:
        fresh = 0
        for r in schema.returns:
            if r.alias_info is not None:
                sets = r.alias_info.before_set
                j = next(
                    i
                    for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.before_set == sets
                )
                self.returns.append(("alias", j, schema.arguments[j].name))
            else:
                self.returns.append(("fresh", fresh, str(r.type)))
                fresh += 1

    def _out_variant(self, func) -> None:
        """The ``out=`` overload of a functional op whose returns are all fresh plain tensors."""
        if any(kind != "fresh" or t not in ("Tensor", "List[Tensor]") for kind, _, t in self.returns):
            return
        want = [(a.name, str(a.type)) for a in func._schema.arguments]
        packet = func.overloadpacket
        for name in packet.overloads():
            ov = getattr(packet, name)
            args = ov._schema.arguments
            outs = [a.name for a in args if a.is_out]
            if len(outs) != len(self.returns):
                continue
            if [(a.name, str(a.type)) for a in args if not a.is_out] == want:
                self.out, self.out_names = ov, tuple(outs)
                return


_RULES: dict = {}


def rule_of(func) -> OpRule:
    r = _RULES.get(func)
    if r is None:
        r = _RULES[func] = OpRule(func)
    return r


# ---------------------------------------------------------------------------------- signatures
def _sig(values) -> tuple:
    """A hashable signature of an argument tuple: each tensor as (shape, stride, dtype)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append((v.shape, v.stride(), v.dtype))
        elif isinstance(v, (list, tuple)):
            out.append(_sig(v))
        else:
            out.append(v)
    return tuple(out)


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    if isinstance(v, torch.device):
        return torch.device("meta")
    return v


def _spec(t):
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        shape, stride = tuple(t.shape), tuple(t.stride())
        return (shape, stride, t.dtype, storage_bytes(shape, stride, t.dtype))
    return [_spec(x) for x in t]


class MetaUnavailable(Exception):
    """The operation's outputs cannot be known without its data (or no meta kernel exists)."""

    def __init__(self, data_dependent: bool, why: str):
        super().__init__(why)
        self.data_dependent = data_dependent


_META_CACHE: dict = {}
_META_LOCK = threading.Lock()


def fresh_specs(func, rule: OpRule, args, kwargs) -> list:
    """``(shape, stride, dtype, bytes)`` (or a list of them, or None) of each fresh output, from the
    meta kernel, cached per signature."""
    try:
        key = (func, _sig(args), (tuple(kwargs), _sig(kwargs.values())) if kwargs else ())
        hit = _META_CACHE.get(key)
    except TypeError:  # an unhashable argument: no cache
        key, hit = None, None
    if hit is not None:
        return hit
    if rule.meta_missing:
        raise MetaUnavailable(False, f"{func} has no meta kernel")
    margs = _to_meta(args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "pin_memory" in mkwargs:
        mkwargs["pin_memory"] = None
    try:
        out = func(*margs, **mkwargs)
    except Exception as e:
        text = str(e)
        dependent = torch.Tag.dynamic_output_shape in func.tags or "data-dependent" in text
        if not dependent and ("no fake impl or Meta" in text or "meta" in text.lower()):
            rule.meta_missing = True
        raise MetaUnavailable(
            dependent, f"{func}: {text.splitlines()[0] if text else type(e).__name__}"
        ) from e
    outs = (out,) if len(rule.returns) == 1 else tuple(out)
    specs = [_spec(o) for (kind, _, _), o in zip(rule.returns, outs) if kind == "fresh"]
    if key is not None:
        with _META_LOCK:
            _META_CACHE[key] = specs
    return specs


def storage_bytes(shape, stride, dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``stride`` spans (0 when it is empty)."""
    span = 1
    for size, step in zip(shape, stride):
        if size == 0:
            return 0
        span += (size - 1) * step
    return span * dtype.itemsize


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
        rule = _RULES.get(func) or rule_of(func)
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
                    kv = _Ref.of(block, v)
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
                            kl.append(_Ref.of(block, x))
                            if checking:
                                touched.append((block, written))
                            continue
                        if x.numel():
                            host_data = True
                        x = x.detach()
                    kl.append(x)
                kv = _RefList(kl)
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
            return func(*args, **kwargs)
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
        return allocator.tensor(block, shape, stride, dtype), _Ref(
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
                kerns.append(_RefList([k for _, k in pairs]))
            else:
                u, k = self._allocate(spec)
                users.append(u)
                kerns.append(k)
        if not rule.no_data:
            generator = getattr(_local, "generator", None) if rule.random else None
            self.stream.enqueue(_Kernel(func, rule, kargs, kkwargs, kerns, rule.random, generator))
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


class _Ref:
    """A device tensor as a queued kernel sees it: its bytes in a segment (made into a tensor on the
    stream's thread, so the program's own tensor can die, and free its block, at issue time)."""

    __slots__ = ("segment", "offset", "shape", "stride", "dtype")

    def __init__(self, segment, offset: int, shape, stride, dtype: torch.dtype):
        self.segment, self.offset, self.shape, self.stride, self.dtype = segment, offset, shape, stride, dtype

    @staticmethod
    def of(block, t: torch.Tensor) -> _Ref:
        dtype = t.dtype
        return _Ref(
            block.segment, block.offset // dtype.itemsize + t.storage_offset(), t.shape, t.stride(), dtype
        )

    def tensor(self) -> torch.Tensor:
        return self.segment.typed(self.dtype).as_strided(self.shape, self.stride, self.offset)


class _RefList(list):
    """A list argument holding kernel references."""


def _resolve(v):
    t = type(v)
    if t is _Ref:
        return v.tensor()
    if t is _RefList:
        return [x.tensor() if type(x) is _Ref else x for x in v]
    return v


class _Kernel:
    """One queued operation: runs on the stream's thread, on the kernel views of its tensors."""

    __slots__ = ("func", "rule", "args", "kwargs", "outs", "random", "generator")

    def __init__(self, func, rule, args, kwargs, outs, random, generator):
        self.func, self.rule, self.args, self.kwargs = func, rule, args, kwargs
        self.outs, self.random, self.generator = outs, random, generator

    def __call__(self) -> None:
        if self.random:
            drawing_from(self.generator, self._run)
        else:
            self._run()

    def _run(self) -> None:
        rule = self.rule
        args = [_resolve(a) for a in self.args]
        kwargs = {k: _resolve(v) for k, v in self.kwargs.items()} if self.kwargs else {}
        outs = [_resolve(o) for o in self.outs]
        if rule.out is not None and outs and all(o is not None for o in outs):
            rule.out(*args, **kwargs, **dict(zip(rule.out_names, outs)))
            return
        res = self.func(*args, **kwargs)
        if not outs:
            return
        results = (res,) if len(rule.returns) == 1 else res
        for (kind, j, _), r in zip(rule.returns, results):
            if kind != "fresh" or outs[j] is None:
                continue
            if isinstance(r, torch.Tensor):
                outs[j].copy_(r)
            else:
                for o, x in zip(outs[j], r):
                    if o is not None:
                        o.copy_(x)
