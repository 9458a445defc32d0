"""Simulation side of roundpipe: the event simulator, workloads and the tuner.

- ``sim.simulate(table, workload, server, SimOptions(...)) -> SimResult``: one training step of any
  schedule table, with copy engines, shared PCIe uplinks, host memory and the CPU optimizer.
- ``sim.Scenario`` / ``sim.run_scenario``: the same from a model name, a hardware spec and a policy.
- ``sim.tune``: the search behind ``roundpipe plan``; ``sim.seq_limit`` (``sim.max_seq_len``): the
  longest sequence that fits and the limit that binds.
- ``sim.gantt.save_gantt``: PNG chart of any ``Timeline`` (``roundpipe.schedule.timeline``).

Pure Python: nothing here imports torch. Names are loaded on first use. The hardware and model
presets live in ``roundpipe.presets``, below both ``partition`` and ``sim``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SimOptions": "roundpipe.sim.options",
    "SimResult": "roundpipe.sim.result",
    "simulate": "roundpipe.sim.simulator",
    "without_costs": "roundpipe.sim.simulator",
    "LayerWork": "roundpipe.sim.workload",
    "Workload": "roundpipe.sim.workload",
    "device_ops": "roundpipe.sim.workload",
    "uniform_workload": "roundpipe.sim.workload",
    "workload_from_costs": "roundpipe.sim.workload",
    "Scenario": "roundpipe.sim.scenario",
    "prepare": "roundpipe.sim.scenario",
    "run_scenario": "roundpipe.sim.scenario",
    "TuneResult": "roundpipe.sim.tune",
    "max_seq_len": "roundpipe.sim.seq_limit",
    "tune": "roundpipe.sim.tune",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'roundpipe.sim' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
