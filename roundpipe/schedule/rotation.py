"""Rotation: where the next step's deal starts, asked of the policy that built the table.

A policy that ``rotates`` (its ``PolicySpec``) deals whole stages round-robin; the next step's deal
starts on the device after the one that got this step's last deal. The spec's
``next_start_device`` knows its deal; :func:`next_start_device` and :func:`rotation` ask it. The
runtime advances its start device by it and the simulator replays several steps with it.

This sits above the policy registry (``policies/``), which sits above the table; ``flow.py``, which
the table imports, cannot ask the registry itself.

Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roundpipe.schedule.policies import POLICIES

if TYPE_CHECKING:
    from roundpipe.schedule.table import ScheduleTable


def next_start_device(table: ScheduleTable) -> int:
    """The ``start_device`` of the step after ``table``'s.

    A policy that ``rotates`` says where its deal goes on (``PolicySpec.next_start_device``: the
    device after the one that got this step's last deal, so one step's tail and the next step's
    head land on different workers); any other table keeps its start.
    """
    spec = POLICIES.get(table.policy)
    if spec is not None and spec.rotates and spec.next_start_device is not None:
        return spec.next_start_device(table)
    return int(table.options.get("start_device", 0))


def rotation(table: ScheduleTable) -> int:
    """How many devices the next step's deal starts after this one's, in ``[0, num_devices)``: the
    number of deals of the step modulo the device count for a policy that rotates, else 0."""
    start = int(table.options.get("start_device", 0))
    return (next_start_device(table) - start) % table.num_devices


__all__ = ["next_start_device", "rotation"]
