"""What the issue mode (``cpu_clock.py``) does with each aten operation, and the shapes of its
outputs before it runs.

``rule_of(func)`` sorts an overload, once, from its schema and tags: a view or metadata change (runs
at once), a direct call that makes no tensor, a host sync, or compute (queued as a kernel).
``fresh_specs`` gives a compute operation's fresh outputs from its meta kernel, cached per signature;
``MetaUnavailable`` when the outputs depend on the data or no meta kernel exists.
"""

from __future__ import annotations

import threading

import torch

from roundpipe.backend.grouped_mm import GROUPED_MM, meta_stand_ins

aten = torch.ops.aten

# ---------------------------------------------------------------------------------- op rules
VIEW, DIRECT, SYNC, COMPUTE = "view", "direct", "sync", "compute"
# Operations that read device data for the host whatever their schema says.
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten._linalg_check_errors.default,  # reads the solver's info on the host (torch.linalg.*)
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


RULES: dict = {}


def rule_of(func) -> OpRule:
    r = RULES.get(func)
    if r is None:
        r = RULES[func] = OpRule(func)
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
    real_dtype = None
    if func is GROUPED_MM:
        margs, mkwargs, real_dtype = meta_stand_ins(margs, mkwargs)
    try:
        out = func(*margs, **mkwargs)
        if real_dtype is not None:
            out = out.to(real_dtype)
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
