"""What the host thread's jobs move through host memory, per trainable parameter: the rule the
simulator times its host lane by (``engine.py``).

The runtime's host thread (``runtime/hostqueue.py``) runs two kinds of job on the fp32 state of the
trainable parameters, and both are bound by host memory traffic, so each is priced in bytes at
``Server.host_work_bw``:

- **accumulation**, once per weight-gradient download: the first gradient of a step is copied into
  the fp32 accumulator (read the download, write the buffer: no zeroed buffer is read, and none is
  zeroed after the update; ``runtime/store.py`` ``Entry.add_grad``), every further one added to it
  (read both, write one);
- **the update**, once per step group: fp16's loss scaling first reads every gradient once
  (``optim/adamw.py`` ``all_finite``); torch's fused AdamW reads gradient, master and both moments
  and writes master and both moments, and its schema marks the gradients written as well (counted
  here as the virtual server counts it: the kernel leaves them unwritten when it unscales nothing);
  then the refresh of the compute copy the next upload reads (read the master, write the copy in
  the run dtype; none in fp32, where uploads read the master itself).

The virtual server prices the same jobs operation by operation (``backend/virtual.py``
``HostWork``); ``tests/test_virtual_server.py`` holds the two to the same bytes. fp32 moments only
(``OptimizerConfig.state_dtype`` "bf16" or "int8" moves fewer bytes, and the 8-bit coding costs
more work than its bytes: not modelled).

Pure Python (no torch).
"""

from __future__ import annotations

from roundpipe.partition.cost import DTYPE_BYTES

FP32_BYTES = 4
ACCUMULATE_FIRST_BYTES = 2 * FP32_BYTES  # copy the download into the accumulator
ACCUMULATE_MORE_BYTES = 3 * FP32_BYTES  # add the download into it
ADAMW_BYTES = 8 * FP32_BYTES  # fused AdamW: read gradient, master, two moments; write those four
FINITE_CHECK_BYTES = FP32_BYTES  # fp16's loss scaling reads every gradient before the update


def accumulate_bytes(params: int, first: bool) -> int:
    """Bytes the host moves adding one downloaded gradient of ``params`` parameters."""
    return params * (ACCUMULATE_FIRST_BYTES if first else ACCUMULATE_MORE_BYTES)


def update_bytes(params: int, dtype: str) -> int:
    """Bytes the host moves updating ``params`` parameters of a run in ``dtype`` (the finiteness
    check of fp16's loss scaling, fused AdamW, the refresh of the compute copy)."""
    refresh = 0 if dtype == "fp32" else FP32_BYTES + DTYPE_BYTES[dtype]
    check = FINITE_CHECK_BYTES if dtype == "fp16" else 0
    return params * (check + ADAMW_BYTES + refresh)


__all__ = ["accumulate_bytes", "update_bytes"]
