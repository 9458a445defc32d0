"""Schedule tables and the policies that build them (pure Python, no torch).

``build_table`` is the entry point: it looks a policy up by name, checks its options and returns a
validated table. ``dependencies`` is the one rule for "which task waits for which", shared by the
runtime, the simulator and the validator.
"""

from __future__ import annotations

import inspect

from roundpipe.errors import ScheduleError
from roundpipe.schedule.check import dry_run
from roundpipe.schedule.deps import TaskKey, TaskKind, dependencies, required_tasks
from roundpipe.schedule.policies import POLICIES, PROVISIONAL_POLICY, PolicySpec
from roundpipe.schedule.table import Partition, ScheduleTable, Task


def policy_options(policy: str) -> dict[str, object]:
    """The options ``policy`` accepts, with their defaults."""
    params = list(inspect.signature(_lookup(policy).build).parameters.values())[4:]
    return {p.name: p.default for p in params}


def _lookup(policy: str):
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}") from None


def build_table(
    policy: str,
    forward: Partition,
    backward: Partition,
    num_devices: int,
    num_microbatches: int,
    **options,
) -> ScheduleTable:
    """Build and validate the table of ``policy`` (a key of ``POLICIES``).

    Raises:
        ScheduleError: unknown policy, an option the policy does not take, arguments the policy
            cannot schedule, or (a bug) a table that does not validate.
    """
    fn = _lookup(policy)
    accepted = policy_options(policy)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) if accepted else "no options"
        raise ScheduleError(f"policy {policy!r} has no option {', '.join(unknown)}; it takes {takes}")
    return fn(forward, backward, num_devices, num_microbatches, **options).validate()


__all__ = [
    "POLICIES",
    "PROVISIONAL_POLICY",
    "PolicySpec",
    "Partition",
    "ScheduleTable",
    "Task",
    "TaskKey",
    "TaskKind",
    "build_table",
    "dependencies",
    "dry_run",
    "policy_options",
    "required_tasks",
]
