"""``simulate(table, workload, hardware)``: one training step on modelled hardware -> :class:`SimResult`.

The event engine is ``engine.py``; this module decides what to simulate (how many steps, which
devices keep their weights resident), runs it and turns the counters into the reported figures.
Pure Python.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import replace

from roundpipe.errors import ConfigError
from roundpipe.partition.memory import device_reserve_bytes, task_bytes
from roundpipe.presets import GIB, Server
from roundpipe.schedule import build_table, policy_options
from roundpipe.schedule.flow import StageWork, device_flows
from roundpipe.schedule.rotation import next_start_device, rotation
from roundpipe.schedule.table import ScheduleTable
from roundpipe.sim.engine import _Sim
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.workload import Workload


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def resident_bytes(table: ScheduleTable, work: Workload) -> list[int]:
    """Per device, what keeping every one of its layers resident costs at the worst task: all its
    weights plus the largest working set, gradients and activations of one of its tasks."""
    ly = work.layers
    out = []
    for row in device_flows(table):
        layers: set[int] = set()
        worst = 0
        stages = {id(op.work): op.work for op in row}  # every microbatch of a stage needs the same
        for stage in stages.values():
            layers.update(stage.layers)
            worst = max(worst, _task_bytes(stage, ly))
        out.append(sum(ly[i].param_bytes for i in layers) + worst)
    return out


def _task_bytes(stage: StageWork, ly) -> int:
    """Working set (the memory rule's, ``partition.memory.task_bytes``), weight gradients and
    hand-offs of one task of ``stage`` on its device."""
    work, _ = task_bytes(ly, stage.fwd_layers, stage.bwd_layers)
    grads = sum(ly[i].grad_bytes for i in stage.bwd_layers) if stage.weight_grads else 0
    io = sum(ly[b].act_in_bytes for _, b in stage.consumes + stage.produces if b < len(ly))
    return work + grads + io


def _iteration_tables(table: ScheduleTable, n: int) -> list[ScheduleTable]:
    """The tables of ``n`` consecutive steps: a policy that rotates continues its deal where the
    last step ended (``rotation.next_start_device``); any other table runs as it is every step."""
    if n == 1 or rotation(table) == 0:
        return [table] * n
    accepted = policy_options(table.policy)
    options = {k: v for k, v in table.options.items() if k in accepted}
    tables = [table]
    while len(tables) < n:
        options["start_device"] = next_start_device(tables[-1])
        part = (table.forward, table.backward)
        tables.append(build_table(table.policy, *part, table.num_devices, table.num_microbatches, **options))
    return tables


@contextmanager
def _cycle_collector_paused():
    """Pause CPython's cycle collector while a simulation builds and runs.

    A simulation allocates a long-lived object or two per task (its state and dependents) and drops
    them all when it returns; none of it is cyclic garbage. With the collector on, that growth
    triggers repeated full-heap scans that find nothing and cost ~15% of a 12,800-task simulation.
    Reference counting still frees everything as usual; the collector resumes (if it was on) however
    the simulation ends, and picks up any cycle made meanwhile at its next run. Free what is not
    needed before leaving the block, or that first run scans it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(
    table: ScheduleTable,
    workload: Workload,
    hardware: Server,
    options: SimOptions | None = None,
    *,
    notes: tuple[str, ...] = (),
) -> SimResult:
    """Simulate ``table`` (validated) with ``workload`` on ``hardware`` (``num_devices`` of its GPUs).

    Raises :class:`ConfigError` when the table and workload disagree (layer counts) or the table has
    more devices than the server.
    """
    opts = options or SimOptions()
    if table.forward.num_layers != workload.num_layers:
        raise ConfigError(
            f"the table cuts {table.forward.num_layers} layers but the workload has {workload.num_layers}"
        )
    if table.num_devices > hardware.num_gpus:
        raise ConfigError(
            f"the table has {table.num_devices} devices but the server {hardware.name} has {hardware.num_gpus} GPUs"
        )
    n_iter = opts.iterations or (3 if opts.optimizer == "async" else 1)
    capacity = hardware.memory_bytes - device_reserve_bytes(hardware)
    said = list(notes)
    if opts.stream_weights is None:
        if table.weight_bound:
            need = resident_bytes(table, workload)
            stream = [n > capacity for n in need]
            if any(stream):
                said.append(
                    "weights streamed instead of resident on device(s) "
                    + ", ".join(str(d) for d, s in enumerate(stream) if s)
                    + f": all their layers need up to {_gib(max(need))} of {_gib(capacity)}"
                )
        else:
            stream = [True] * table.num_devices
    else:
        stream = [bool(opts.stream_weights)] * table.num_devices
    with _cycle_collector_paused():
        sim = _Sim(_iteration_tables(table, n_iter), workload, hardware, opts, stream)
        sim.run()
        sim.free_operations()

    ends = sim.iter_end
    n_dev, m = table.num_devices, table.num_microbatches
    busy = [b / n_iter for b in sim.busy]
    iteration_s = ends[0] if n_iter == 1 else (ends[-1] - ends[0]) / (n_iter - 1)
    # Overlapping steps: a step's last task can end on a device that keeps up while another runs
    # behind (a rotating deal loads devices unevenly from step to step), so the spacing of the
    # steps' ends can undercut the work. No period is shorter than the busiest device's share.
    iteration_s = max(iteration_s, max(busy, default=0.0))
    total_busy = sum(busy)
    bubble_total = 1.0 - total_busy / (n_dev * iteration_s) if iteration_s > 0 else 0.0
    bubble_ideal = n_dev * iteration_s / total_busy - 1.0 if total_busy > 0 else 0.0
    microbatches = math.fsum(workload.scales(m))  # in units of the workload's microbatch
    tokens = microbatches * workload.tokens_per_microbatch
    flops = microbatches * sum(lw.flops for lw in workload.layers)
    peak_flops = hardware.gpu.peak_flops(workload.dtype)
    reserve = device_reserve_bytes(hardware)
    peak_gpu = tuple(p + reserve for p in sim.mem_peak)
    reasons = []
    worst = max(range(n_dev), key=peak_gpu.__getitem__)
    if peak_gpu[worst] > hardware.memory_bytes:
        label, (w, a, k, g) = sim.mem_peak_at[worst]
        reasons.append(
            f"device {worst} needs {_gib(peak_gpu[worst])} of {_gib(hardware.memory_bytes)} at {label or 'start'} "
            f"(weights {_gib(w)}, activations {_gib(a)}, working set {_gib(k)}, gradients {_gib(g)}, "
            f"workspace {_gib(reserve)})"
        )
    if hardware.host_memory_bytes is not None and sim.host_peak > hardware.host_memory_bytes:
        reasons.append(
            f"host memory: needs {_gib(sim.host_peak)} (model state {_gib(workload.host_state_bytes)} + hand-offs "
            f"and saved inputs) of {_gib(hardware.host_memory_bytes)}"
        )
    meta = {
        "source": "sim",
        "policy": table.policy,
        "num_devices": n_dev,
        "num_microbatches": m,
        "iterations": n_iter,
        "iteration_ends": list(ends),
        "iteration_s": iteration_s,
        "optimizer": opts.optimizer,
        "model": workload.name,
        "hardware": hardware.name,
    }
    return SimResult(
        policy=table.policy,
        num_devices=n_dev,
        num_microbatches=m,
        iteration_s=iteration_s,
        tokens_per_s=tokens / iteration_s if iteration_s > 0 else 0.0,
        mfu=flops / (iteration_s * n_dev * peak_flops) if iteration_s > 0 and peak_flops > 0 else 0.0,
        bubble_total=bubble_total,
        bubble_ideal=bubble_ideal,
        peak_gpu_bytes=peak_gpu,
        peak_host_bytes=sim.host_peak,
        peak_activations=tuple(sim.stash_peak),
        compute_busy_s=tuple(busy),
        h2d_bytes=sim.moved["h2d"] // n_iter,
        d2h_bytes=sim.moved["d2h"] // n_iter,
        optimizer_busy_s=sim.opt_busy / n_iter,
        weights_streamed=tuple(stream),
        fits=not reasons,
        reason="; ".join(reasons),
        optimizer=opts.optimizer,
        notes=tuple(said),
        reordered=sim.ready.moved if sim.ready is not None else 0,
        accumulate_busy_s=sim.acc_busy / n_iter,
        raw_spans=sim.spans,
        timeline_meta=meta,
    )


def without_costs(options: SimOptions | None = None) -> SimOptions:
    """``options`` with free copies and optimizer and textbook forward tasks: the closed forms' setting."""
    return replace(options or SimOptions(), transfers=False, optimizer_time=False, classic_flow=True)


__all__ = ["SimOptions", "SimResult", "resident_bytes", "simulate", "without_costs"]
