"""The device-side finiteness checks of ``nan_policy`` (``runtime/numerics.py``): every output and
weight gradient a task makes is checked on the compute stream, so each check is operations a worker
issues per tensor, per microbatch. On the virtual RTX 4090 server the check took 11-12% of the
workers' host time (``aminmax``, ``stack``, and ``isfinite``, itself four operations, then ``all``:
seven per tensor). One reduction per tensor, and the finiteness test once per task on the stacked
results, finds the same values."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.runtime.numerics import TaskChecks

torch.set_num_threads(1)

INF, NAN = float("inf"), float("nan")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _largest(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _found(values: list[torch.Tensor]) -> list[int]:
    """Indices of ``values`` the checks report as not finite (the gradient and output kinds both)."""
    checks = TaskChecks(microbatch=0, device="d")
    names = []
    for i, v in enumerate(values):
        if i % 2:
            checks.gradient(i, f"w{i}", v)
        else:
            checks.output(i, v)
        names.append(f"layer{i}")
    flags = checks.packed()
    assert flags is not None and flags.dtype == torch.bool
    return [f.layer_index for f in checks.found(flags.cpu(), names)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_non_finite_value_is_found_and_no_finite_one(device, dtype):
    big = _largest(dtype)
    cases = {
        "finite": [1.0, -2.0],
        "largest finite": [big, -big],
        "nan": [1.0, NAN],
        "+inf": [INF, 1.0],
        "-inf": [-INF, -1.0],
        "inf and -inf": [INF, -INF],
        "nan beside inf": [NAN, INF],
        "all finite, many of the largest": [big] * 64,
    }
    values, bad = [], []
    for first, *rest in cases.values():
        t = torch.randn(257, 3, dtype=torch.float32).to(dtype)
        t[17, 1] = first
        for j, r in enumerate(rest):
            t[200 + j // 3, j % 3] = r
        values.append(t.to(device))
        if not all(torch.isfinite(torch.tensor([first, *rest]))):
            bad.append(len(values) - 1)
    assert _found(values) == bad


def test_each_checked_tensor_is_one_operation_on_the_device():
    values = [torch.randn(64, 8) for _ in range(12)] + [torch.randn(5).half() for _ in range(4)]
    checks = TaskChecks(microbatch=0, device="d")
    with _Count() as count:
        for i, v in enumerate(values):
            checks.gradient(i, f"w{i}", v)
    assert len(count.ops) == len(values), count.ops
    with _Count() as count:
        checks.packed()
    assert len(count.ops) <= 6, count.ops
