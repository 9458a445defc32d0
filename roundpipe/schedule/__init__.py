"""Schedule tables and the policies that build them (pure Python, no torch)."""

from roundpipe.schedule.table import Partition, ScheduleTable, Task

__all__ = ["Partition", "ScheduleTable", "Task"]
