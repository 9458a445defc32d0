"""The kernels the issue mode (``cpu_clock.py``) queues on a cpu stream, and how they run there.

A kernel holds ``KernelRef``s, not the program's tensors: the bytes of a device tensor in an
allocator segment, made into a tensor only on the stream's thread, so the program may drop its
tensor (freeing its block) at issue time while the kernel still uses the bytes, as on CUDA.
"""

from __future__ import annotations

import threading

import torch

GENERATOR_LOCK = threading.Lock()  # the default CPU generator, swapped while a seeded draw runs


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


class KernelRef:
    """A device tensor as a queued kernel sees it: its bytes in a segment (made into a tensor on the
    stream's thread, so the program's own tensor can die, and free its block, at issue time)."""

    __slots__ = ("segment", "offset", "shape", "stride", "dtype")

    def __init__(self, segment, offset: int, shape, stride, dtype: torch.dtype):
        self.segment, self.offset, self.shape, self.stride, self.dtype = segment, offset, shape, stride, dtype

    @staticmethod
    def of(block, t: torch.Tensor) -> KernelRef:
        dtype = t.dtype
        return KernelRef(
            block.segment, block.offset // dtype.itemsize + t.storage_offset(), t.shape, t.stride(), dtype
        )

    def tensor(self) -> torch.Tensor:
        return self.segment.typed(self.dtype).as_strided(self.shape, self.stride, self.offset)


class KernelRefList(list):
    """A list argument holding kernel references."""


def _resolve(v):
    t = type(v)
    if t is KernelRef:
        return v.tensor()
    if t is KernelRefList:
        return [x.tensor() if type(x) is KernelRef else x for x in v]
    return v


class Kernel:
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
