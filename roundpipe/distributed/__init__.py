"""Data parallelism across processes (nodes) on torch.distributed: membership and batch rows
(``group``), the bucketed gradient reduction overlapped with the backward (``reducer``), and what a
rank's optimizer agrees with the others (``updates``). See docs/multinode.md."""

from roundpipe.distributed.group import DataParallel, join, launched_world_size

__all__ = ["DataParallel", "join", "launched_world_size"]
