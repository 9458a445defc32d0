"""What the runtime runs: partitions, stage and microbatch counts, and the schedule table.

The ``Planner`` turns a ``RunConfig`` plus what is known about the model (layer weight bytes, and
layer times once ``Pipeline.profile`` has measured them) into a ``FlowPlan``: the policy's schedule
table with the hand-offs each task consumes and produces. Plans are cached per microbatch count and
policy options; measuring new layer times drops the cache. ``RuntimePlan`` is the printable report
of the partitions and per-stage estimates (``pipe.plan``).

All of it runs on the caller's thread, between steps; workers and the host thread never touch it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from roundpipe.config import RunConfig
from roundpipe.errors import ConfigError, DeviceOutOfMemory, PlanError
from roundpipe.runtime.plan import FlowPlan, build_flow_plan
from roundpipe.runtime.store import ParameterStore
from roundpipe.schedule import Partition
from roundpipe.schedule.policies import POLICIES

GRAIN_OPTIONS = ("virtual_stages", "waves")  # policy options that set the stages per device


class Planner:
    """Partitions, counts and the flow-plan cache of one Pipeline.

    Holds the measured layer times (``layer_times``: name -> (forward s, backward s) per microbatch
    of the profiled size; None before ``profile``), the partitions balanced from them, and the
    device the next roundpipe step starts on (rotated after every step).
    """

    def __init__(self, config: RunConfig, names: list[str], store: ParameterStore, backend):
        self.config = config
        self.names = names
        self.store = store
        self.device_names = tuple(d.name for d in backend.devices)
        self.capacity = backend.devices[0].memory.capacity
        self.layer_times: dict[str, tuple[float, float]] | None = None
        self.profiled_tokens = 1.0  # tokens per microbatch when ``layer_times`` was measured
        self._plans: dict[tuple, FlowPlan] = {}
        self._auto: tuple[Partition, Partition] | None = None
        self._start_device = 0
        # What planning needs to know about the policy beyond its table: which stage counts it
        # takes, whether forward and backward are cut apart, whether its start device rotates.
        self._spec = POLICIES[config.policy]

    @property
    def num_devices(self) -> int:
        return len(self.device_names)

    def check_capacity(self) -> None:
        """Raise ``DeviceOutOfMemory`` if a single layer's weights exceed a device (no plan fits)."""
        if self.capacity is None:
            return
        for name, nbytes in zip(self.names, self.store.layer_bytes):
            if nbytes > self.capacity:
                raise DeviceOutOfMemory(
                    self.device_names[0], f"the weights of layer {name!r}", nbytes, 0, self.capacity
                )

    # ----------------------------------------------------------------- the plan of a step
    def flow_plan(self, num_microbatches: int) -> FlowPlan:
        """The (cached) flow plan of the next step: the configured table, else the policy's."""
        options = dict(self.config.policy_options)
        if self._spec.rotates:
            options.setdefault("start_device", self._start_device)
        if self.config.round_size is not None:
            options.setdefault("round_size", self.config.round_size)
        key = (num_microbatches, tuple(sorted(options.items())))
        plan = self._plans.get(key)
        if plan is None:
            table = self.config.schedule
            if table is None:
                forward, backward = self.partitions()
                policy = POLICIES[self.config.policy]
                table = policy(forward, backward, self.num_devices, num_microbatches, **options)
            else:
                self._check_schedule(table)
            plan = self._plans[key] = build_flow_plan(table)
        return plan

    def advance_start_device(self, plan: FlowPlan) -> None:
        """Deal the next call's first stage to the device after the one that ran the last deal
        (the last round's first backward stage), after every ``forward_backward``, accumulating
        calls included: one call's tail and the next call's head land on different workers."""
        rotation = POLICIES[self.config.policy].next_start_device  # where the policy's deal goes on
        if rotation is not None:
            self._start_device = rotation(plan.table)

    def report(self) -> RuntimePlan:
        forward, backward = self.partitions()
        return RuntimePlan.build(self, forward, backward)

    # ----------------------------------------------------------------- measured costs
    def set_measured(self, layer_times: dict[str, tuple[float, float]], microbatch_tokens: float) -> None:
        """Adopt freshly profiled layer times: partitions and plans are recomputed from them."""
        self.layer_times = layer_times
        self.profiled_tokens = microbatch_tokens
        self._auto = None
        self._plans.clear()

    def observe(self, spans, plan: FlowPlan, microbatch_tokens: float) -> None:
        """Fold a training step's compute spans into the measured times (no-op before profiling).
        Partitions and plans already made from the times are kept."""
        if self.layer_times is None:
            return
        from roundpipe.runtime.profiler import update_moving_average

        update_moving_average(
            self.layer_times,
            spans,
            plan.table.forward,
            plan.table.backward,
            self.names,
            microbatch_scale=self.profiled_tokens / microbatch_tokens,
        )

    # ----------------------------------------------------------------- counts and partitions
    def microbatch_count(self, batch: int) -> int:
        """``num_microbatches``, or for ``"auto"``: one per device until profiled, then the
        partitioner's choice for the measured stage times (at most ``batch``)."""
        m = self.config.num_microbatches
        if m != "auto":
            return m
        from roundpipe.partition.partitioner import auto_microbatches

        d = self.num_devices
        if self.layer_times is None:
            return min(batch, d)
        forward, backward = self.partitions()
        times = self.layer_times
        names = self.names
        f = [sum(times[names[i]][0] for i in forward.layers(s)) for s in range(forward.num_stages)]
        b = [
            sum(sum(times[names[i]]) + times[names[i]][0] for i in backward.layers(s))
            for s in range(backward.num_stages)
        ]
        return max(1, min(batch, auto_microbatches(f, b, d)))

    def partitions(self) -> tuple[Partition, Partition]:
        """Forward and backward partitions: configured sizes, ``"auto"`` (balanced measured times)
        or the default."""
        if self.config.partition is None:
            part = self._default_partition()
            return part, part
        if self.config.partition == "auto":
            return self._auto_partitions()
        n = len(self.names)
        sizes = {
            "partition": self.config.partition,
            "backward_partition": self.config.backward_partition or self.config.partition,
        }
        for name, sz in sizes.items():
            if sum(sz) != n:
                raise ConfigError(
                    f"{name}={tuple(sz)} covers {sum(sz)} layers but the model has {n} "
                    f"({', '.join(self.names[:3])}, ..., {self.names[-1]})"
                )
        return Partition.from_sizes(sizes["partition"]), Partition.from_sizes(sizes["backward_partition"])

    def _default_partition(self) -> Partition:
        """One layer per stage for a policy that takes any stage count (roundpipe streams them),
        else as many even stages as the policy places on the devices."""
        n = len(self.names)
        stages = n if self._spec.stages_per_device is None else self._stage_count()
        return Partition.from_sizes([n // stages + (1 if i < n % stages else 0) for i in range(stages)])

    def _stage_count(self) -> int:
        """Stages the policy places on the devices: one per device for a policy that takes any
        count (roundpipe: one round), else its default stages per device, or ``stages_per_device``
        times the grain option it was given (interleaved's ``virtual_stages``: ``v`` per device;
        hanayo's ``waves``: ``2 x waves``)."""
        n, d, opts, spec = len(self.names), self.num_devices, self.config.policy_options, self._spec
        grain = next((opts[o] for o in GRAIN_OPTIONS if opts.get(o)), None)
        if spec.stages_per_device is None:
            stages = d
        elif grain:
            stages = d * spec.stages_per_device * grain
        else:
            stages = spec.default_stages(d)
        if stages > n:
            raise ConfigError(
                f"policy {self.config.policy!r} on {d} devices needs {stages} stages but the model has only {n} "
                "layers; use fewer devices or the 'roundpipe' policy"
            )
        return stages

    def _auto_partitions(self) -> tuple[Partition, Partition]:
        """Balance measured stage times (``layer_times``) within the device capacity.

        Forward stages balance forward times; backward stages balance recompute + backward times
        (policies with ``separate_partitions``; the others need one partition for both, balancing
        the sum). Too little memory for the policy's stage count raises the count (a policy that
        takes any count, like roundpipe) or PlanError.
        """
        from roundpipe.partition.partitioner import optimal_partition

        if self._auto is not None:
            return self._auto
        names = self.names
        fwd = [self.layer_times[n][0] for n in names]
        bwd = [self.layer_times[n][0] + self.layer_times[n][1] for n in names]
        budget = None if self.capacity is None else int(self.capacity * 0.9)
        weights = self.store.layer_bytes
        stages = self._stage_count()

        def cut(times, what):
            s = stages
            while True:
                try:
                    return optimal_partition(
                        times,
                        s,
                        weight_bytes=weights,
                        added_bytes=weights,
                        budget=budget,
                        names=names,
                        what=what,
                    ).partition
                except PlanError as e:
                    any_count = self._spec.stages_per_device is None
                    if not any_count or getattr(e, "min_stages", None) is None or s >= len(times):
                        raise
                    s = min(len(times), max(s + 1, e.min_stages))

        if self._spec.separate_partitions:
            self._auto = (cut(fwd, "forward"), cut(bwd, "backward"))
        else:
            both = cut([f + b for f, b in zip(fwd, bwd)], "forward+backward")
            self._auto = (both, both)
        return self._auto

    def _check_schedule(self, table) -> None:
        """A hand-written table must fit this model and these devices, and be runnable in the
        configured order (strict order rejects one that would deadlock)."""
        from roundpipe.schedule.check import validate_table

        n, d = len(self.names), self.num_devices
        if table.forward.num_layers != n:
            raise ConfigError(
                f"the schedule's partitions cut {table.forward.num_layers} layers; this model has {n}"
            )
        if table.num_devices != d:
            raise ConfigError(
                f"the schedule has {table.num_devices} device rows; devices={self.config.devices!r} gives {d}"
            )
        validate_table(table, in_order=self.config.order == "strict")


@dataclass(frozen=True)
class RuntimePlan:
    """What the runtime will run: stages of both partitions with their estimated cost.

    ``est_s`` is per microbatch from measured layer times (None before ``profile``); ``weight_bytes``
    in the run dtype; ``peak_bytes`` a worker's bound for that stage: its weights, the next stage's
    (prefetched), and its fp32 weight-gradient accumulator.
    """

    policy: str
    devices: tuple[str, ...]
    rows: tuple[dict, ...]

    @classmethod
    def build(cls, planner: Planner, forward: Partition, backward: Partition) -> RuntimePlan:
        names, times, store = planner.names, planner.layer_times, planner.store
        wbytes = store.layer_bytes
        rows = []
        for kind, part in (("F", forward), ("B", backward)):
            stage_w = [sum(wbytes[i] for i in part.layers(s)) for s in range(part.num_stages)]
            for s in range(part.num_stages):
                layers = part.layers(s)
                est = None
                if times is not None:
                    est = sum(
                        times[names[i]][0] + (times[names[i]][1] + times[names[i]][0] if kind == "B" else 0)
                        for i in layers
                    )
                grads = (
                    0
                    if kind == "F"
                    else sum(4 * e.tensor.numel() for e in store.entries if e.trainable and e.owner in layers)
                )
                nxt = stage_w[s + 1] if s + 1 < part.num_stages else 0
                rows.append(
                    {
                        "kind": kind,
                        "stage": s,
                        "layers": f"{names[layers.start]}..{names[layers.stop - 1]}"
                        if len(layers) > 1
                        else names[layers.start],
                        "num_layers": len(layers),
                        "est_s": est,
                        "weight_bytes": stage_w[s],
                        "peak_bytes": stage_w[s] + nxt + grads,
                    }
                )
        return cls(planner.config.policy, planner.device_names, tuple(rows))

    def to_json(self) -> str:
        return json.dumps(
            {"policy": self.policy, "devices": list(self.devices), "stages": list(self.rows)}, indent=2
        )

    def table(self) -> str:
        head = f"{'stage':>6}  {'layers':<24} {'est. ms':>9} {'weights MiB':>12} {'peak MiB':>9}"
        lines = [f"plan: policy {self.policy} on {', '.join(self.devices)}", head]
        for r in self.rows:
            est = "-" if r["est_s"] is None else f"{r['est_s'] * 1e3:.2f}"
            lines.append(
                f"{r['kind']}{r['stage']:>5}  {r['layers']:<24} {est:>9} {r['weight_bytes'] / 2**20:>12.2f} {r['peak_bytes'] / 2**20:>9.2f}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
