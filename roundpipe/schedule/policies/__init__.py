"""Dispatch policies: pure functions ``(forward, backward, devices, microbatches, ...) -> ScheduleTable``."""

from roundpipe.schedule.policies.roundpipe import roundpipe

POLICIES = {"roundpipe": roundpipe}

__all__ = ["POLICIES", "roundpipe"]
