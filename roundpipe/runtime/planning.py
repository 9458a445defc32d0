"""What the runtime runs: the policy, partitions and microbatch count of each batch, and its table.

The ``Planner`` turns a ``RunConfig`` plus what is known about the model (layer weight bytes, and
layer times once ``Pipeline.profile`` has measured them) into a :class:`Decision` per batch shape
and a ``FlowPlan`` per decision: the policy's schedule table with the hand-offs each task consumes
and produces.

``RunConfig``'s defaults are ``policy="auto"``, ``partition="auto"`` and ``num_microbatches="auto"``.
Until the first batch has been profiled an automatic part runs as the provisional plan (roundpipe,
which executes any stage count, one layer per stage, one microbatch per device); after it the
three are chosen together from the measured times (``roundpipe.sim.choice``), once per batch
shape, and cached. A value the config gives pins its part. ``RuntimePlan`` (``decision.py``) is
the printable report of what the next step runs and why (``pipe.plan``). The first time a plan is
asked for a batch shape, each device's planned peak is compared with its free memory
(``memory_guard``), so a plan that cannot fit is refused with ``DeviceMemoryError`` before any of
it runs.

All of it runs on the caller's thread, between steps; workers and the host thread never touch it.
"""

from __future__ import annotations

from typing import cast

import roundpipe.runtime.memory_guard as memory_guard
from roundpipe.config import RunConfig, known_policies
from roundpipe.errors import ConfigError, DeviceOutOfMemory, PlanError
from roundpipe.partition.cost import LayerCost, model_costs
from roundpipe.partition.shape import ConfigView
from roundpipe.runtime.decision import Decision, RuntimePlan
from roundpipe.runtime.plan import FlowPlan, build_flow_plan
from roundpipe.runtime.store import ParameterStore
from roundpipe.schedule import Partition
from roundpipe.schedule.policies import POLICIES, PROVISIONAL_POLICY

BUDGET_SHARE = 0.9  # of a device's capacity, for the stages' estimated bytes
GIVEN = "given by RunConfig"
Measured = tuple[tuple[tuple[float, float], ...], float, tuple[int, int]]
"""A profile: per layer (forward s, backward s), tokens per microbatch, batch shape (samples, tokens)."""


class Planner:
    """Decisions, flow plans and measured costs of one Pipeline.

    Holds the measured layer times (``layer_times``: name -> (forward s, backward s) per microbatch
    of the profiled size, refreshed by a moving average during training; None before ``profile``),
    the snapshot of them that automatic choices are made from (so training noise never changes a
    choice), the decision per batch shape, and the device the next rotating deal starts on.
    """

    def __init__(self, config: RunConfig, adapter, store: ParameterStore, backend, cost_settings: dict):
        self.config = config
        self.cost_settings = cost_settings  # what the cost model needs of the run (runtime/cost_settings.py)
        self.names = [layer.name for layer in adapter.layers]
        self.kinds = [layer.kind for layer in adapter.layers]
        self.model_config = adapter.config
        self._analytic: dict[int, list[LayerCost] | None] = {}  # model_costs per microbatch tokens
        self.store = store
        self.device_names = tuple(d.name for d in backend.devices)
        self.capacity = backend.devices[0].memory.capacity
        # What a plan may use of a device: its capacity less its allocator's slack (None: unbounded).
        slack = backend.devices[0].allocation_slack()
        self.usable = None if self.capacity is None else max(0, self.capacity - slack)
        self.devices = backend.devices  # asked for their free bytes before a plan first runs
        # plans (and batch shapes) whose memory fits -> each device's room (``memory_guard.room``)
        self._memory_checked: dict[tuple, list[int | None]] = {}
        self.layer_times: dict[str, tuple[float, float]] | None = None
        self.profiled_tokens = 1.0  # tokens per microbatch when ``layer_times`` was measured
        self.context_s: float | None = None  # measured seconds per microbatch context build
        self.task_s: float | None = None  # measured seconds a device idles between operations
        self._measured: Measured | None = None
        self._decisions: dict[tuple[int, int], Decision] = {}
        self._last: Decision | None = None
        self._plans: dict[tuple, FlowPlan] = {}
        self._start_device = 0
        # The loss needs every forward of the step before any backward (a router load-balancing
        # loss): only tables that run so (``schedule.check.runs_forwards_first``).
        self.forwards_first = getattr(adapter, "router_loss", None) is not None

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

    def needs_profile(self) -> bool:
        """Something is "auto" and nothing has been measured yet: profile the first batch."""
        c = self.config
        automatic = "auto" in (c.policy, c.partition, c.num_microbatches)
        return automatic and c.schedule is None and self.layer_times is None

    # ----------------------------------------------------------------- decisions
    def decide(self, batch: int, seq_len: int) -> Decision:
        """The (cached) decision for a batch of ``batch`` samples of ``seq_len`` tokens."""
        key = (batch, seq_len)
        decision = self._decisions.get(key)
        if decision is None:
            c = self.config
            if c.schedule is not None:
                decision = self._scheduled()
            elif self._measured is not None and "auto" in (c.policy, c.partition, c.num_microbatches):
                decision = self._chosen(batch, seq_len, self._measured)
            else:
                decision = self._fixed(batch)
            self._decisions[key] = decision
        self._last = decision
        return decision

    def _scheduled(self) -> Decision:
        t = self.config.schedule
        why = dict.fromkeys(("policy", "partition", "num_microbatches"), "from RunConfig.schedule")
        return Decision(t.policy, t.forward, t.backward, t.num_microbatches, why)

    def _fixed(self, batch: int | None) -> Decision:
        """The configured values, "auto" parts provisional (nothing measured yet)."""
        c, d, n = self.config, self.num_devices, len(self.names)
        waiting = "until the first batch is profiled"
        policy = self._auto_policies()[0] if c.policy == "auto" else c.policy
        why = {
            "policy": GIVEN
            if c.policy != "auto"
            else f"auto: runs as {policy} (it takes any stage count) {waiting}"
        }
        if isinstance(c.partition, tuple):
            forward, backward = self._given_partitions(c.partition)
            why["partition"] = GIVEN
        else:
            from roundpipe.sim.choice import default_partition

            forward = backward = default_partition(policy, d, c.policy_options, n)
            why["partition"] = f"the policy's default: {_default_kind(policy, forward)}" + (
                f", {waiting}" if c.partition == "auto" else ""
            )
        m: int | None
        if c.num_microbatches == "auto":
            m = None if batch is None else _provisional_count(POLICIES[policy], d, batch)
            why["num_microbatches"] = f"auto: one per device {waiting}"
        else:
            m = c.num_microbatches
            why["num_microbatches"] = GIVEN
        return Decision(policy, forward, backward, m, why)

    def _auto_policies(self) -> list[str]:
        """The policies ``"auto"`` chooses among (the provisional one first): in strict order, a
        loss that needs every forward first keeps to the policies whose tables run so."""
        known = [p for p in POLICIES if p in known_policies()]
        if self.forwards_first and self.config.order == "strict":
            return [p for p in known if POLICIES[p].forwards_first]
        return sorted(known, key=lambda p: p != PROVISIONAL_POLICY)  # stable: registry order after it

    def _chosen(self, batch: int, seq_len: int, measured: Measured) -> Decision:
        """Choose the automatic parts from the measured times (``roundpipe.sim.choice``)."""
        from roundpipe.sim.choice import PREDICTION, choose, speedup, stage_count

        c, d = self.config, self.num_devices
        times, tokens, _ = measured
        options = dict(c.policy_options)
        if c.round_size is not None:
            options.setdefault("round_size", c.round_size)
        if c.policy != "auto" and not isinstance(c.partition, tuple):
            stage_count(c.policy, d, options, len(self.names))  # too many stages: say so as ConfigError
        policies = [c.policy] if c.policy != "auto" else self._auto_policies()
        partition = (
            self._given_partitions(c.partition)
            if isinstance(c.partition, tuple)
            else c.partition or "default"
        )
        try:
            choice = choose(
                times, tokens, self._layer_costs, num_devices=d, batch=batch, seq_len=seq_len,
                policies=policies, options=options, partition=partition,
                microbatches=None if c.num_microbatches == "auto" else c.num_microbatches,
                budget=None if self.usable is None else int(self.usable * BUDGET_SHARE),
            )  # fmt: skip
        except PlanError as err:
            if (c.policy, c.partition) != ("auto", "auto"):
                raise
            # The memory estimates are conservative: run the plan that needs least, and let the
            # devices' own accounting say if even that does not fit.
            least = self._fixed(batch)
            why = {
                "policy": f"auto: runs as {least.policy}, one layer per stage: no candidate fits the "
                f"estimated memory ({err})",
                "partition": "auto: one layer per stage, the least a stage can hold",
                "num_microbatches": "auto: one per device" if c.num_microbatches == "auto" else GIVEN,
            }
            return Decision(least.policy, least.forward, least.backward, least.num_microbatches, why)
        best = choice.best
        forward, backward = best.forward, best.backward
        if forward is None or backward is None:  # choose() ranks only the plans it could build
            raise TypeError(f"the chosen {best.policy} plan has no partitions")
        why = {}
        if c.policy != "auto":
            why["policy"] = GIVEN
        else:
            rival = choice.fastest_other(same_policy=False)
            if rival is None:
                why["policy"] = f"auto: {best.policy}, the only policy that can run this batch here"
            else:
                why["policy"] = _compared(f"auto: {best.policy}", best, rival, rival.policy, "policy") + (
                    f" ({PREDICTION})"
                )
            skipped = choice.faster_unrepeatable
            if skipped is not None:
                why["policy"] += (
                    f"; {skipped.policy} was predicted {speedup(skipped, best):.2f}x as fast but runs a "
                    "stage's backward on several devices, whose gradients the host adds in arrival "
                    f"order (not repeatable bit for bit): give policy={skipped.policy!r} to run it"
                )
        if isinstance(c.partition, tuple):
            why["partition"] = GIVEN
        elif c.partition is None:
            why["partition"] = f"the policy's default: {_default_kind(best.policy, forward)}"
        elif POLICIES[best.policy].separate_partitions:
            why["partition"] = (
                f"auto: {forward.num_stages} forward + {backward.num_stages} backward stages, the "
                f"grain of the RoundPipe objective (M*S + N(N-1)) * t_max for {best.num_microbatches} "
                "microbatches on the measured times, the best of its two best grains by prediction"
            )
        else:
            stages = forward.num_stages
            why["partition"] = (
                f"auto: the policy's {stages} stage{'s' if stages > 1 else ''}, balanced on the measured times"
            )
        if c.num_microbatches != "auto":
            why["num_microbatches"] = GIVEN
        else:
            alt = choice.fastest_other(same_policy=True)
            head = f"auto: {best.num_microbatches} for a batch of {batch}"
            if alt is None:
                why["num_microbatches"] = f"{head}, the only count the policy takes"
            else:
                why["num_microbatches"] = _compared(head, best, alt, str(alt.num_microbatches), "count")
        return Decision(best.policy, forward, backward, best.num_microbatches, why, choice)

    def _given_partitions(self, partition: tuple[int, ...]) -> tuple[Partition, Partition]:
        """The partitions of ``RunConfig.partition`` (``partition``) and ``backward_partition``."""
        c, n = self.config, len(self.names)
        sizes = {"partition": partition, "backward_partition": c.backward_partition or partition}
        for name, sz in sizes.items():
            if sum(sz) != n:
                raise ConfigError(
                    f"{name}={tuple(sz)} covers {sum(sz)} layers but the model has {n} "
                    f"({', '.join(self.names[:3])}, ..., {self.names[-1]})"
                )
        return Partition.from_sizes(sizes["partition"]), Partition.from_sizes(sizes["backward_partition"])

    def _layer_costs(self, tokens: float) -> list[LayerCost]:
        """The layers' device bytes for a microbatch of ``tokens`` tokens, for the memory checks of
        an automatic choice: the cost model's own estimate from the model's config
        (``partition.cost.model_costs``, the rule the partitioner and ``roundpipe plan`` use), with
        what the store really holds replacing the config's figures: weights, trainable parameters
        and their fp32 gradient accumulators."""
        t = int(tokens)
        analytic = self._analytic_costs(t)
        store, out = self.store, []
        for i, (name, kind) in enumerate(zip(self.names, self.kinds)):
            trainable = sum(
                store.piece_bytes(p) // store.entries[p[0]].compute.element_size()
                for p in store.trainable_pieces([i])
            )
            est = analytic[i] if analytic is not None else None
            out.append(
                LayerCost(
                    name,
                    0.0,
                    0.0,
                    param_bytes=store.layer_bytes[i],
                    trainable_params=trainable,
                    act_in_bytes=est.act_in_bytes if est else 0,
                    work_bytes=est.work_bytes if est else 0,
                    kind=kind,
                    recompute=kind != "head",
                    saved_bytes=est.saved_bytes if est else 0,
                    fwd_work_bytes=est.fwd_work_bytes if est else 0,
                    grad_device_bytes=4 * trainable,
                    tokens=t,
                )  # fmt: skip
            )
        return out

    def _analytic_costs(self, tokens: int) -> list[LayerCost] | None:
        """The cost model's layers for the model's config at ``tokens`` tokens a microbatch (every
        token labelled: the head's bound), or None when it cannot read the config or its layers are
        not the adapter's (then only the store's bytes are known)."""
        if tokens not in self._analytic:
            try:
                costs = model_costs(
                    ConfigView(self.model_config), seq_len=max(tokens, 1), **self.cost_settings
                )
            except (ConfigError, TypeError, ValueError):
                costs = None
            if costs is not None and [c.kind for c in costs] != list(self.kinds):
                costs = None
            self._analytic[tokens] = costs
        return self._analytic[tokens]

    # ----------------------------------------------------------------- the plan of a step
    def flow_plan(self, decision: Decision) -> FlowPlan:
        """The (cached) flow plan of a decision: the configured table, else the policy's."""
        spec = POLICIES.get(decision.policy)
        options = dict(self.config.policy_options)
        if spec is not None and spec.rotates:
            options.setdefault("start_device", self._start_device)
        if self.config.round_size is not None:
            options.setdefault("round_size", self.config.round_size)
        key = (
            decision.policy,
            decision.forward.bounds,
            decision.backward.bounds,
            decision.num_microbatches,
            tuple(sorted(options.items())),
        )
        plan = self._plans.get(key)
        if plan is None:
            table = self.config.schedule
            if table is None:
                table = POLICIES[decision.policy](
                    decision.forward,
                    decision.backward,
                    self.num_devices,
                    decision.num_microbatches,
                    **options,
                )
            else:
                self._check_schedule(table)
            if self.forwards_first:
                self._check_forwards_first(table)
            # A loss over every forward: the head's F and B run apart (a fused pair would be a
            # backward waiting for the forwards of its own kind) and every forward over its whole
            # stage (so that no backward is the first to run a layer's forward).
            plan = self._plans[key] = build_flow_plan(
                table, fuse=not self.forwards_first, frozen=self.store.frozen_prefix
            )
        self._check_memory(decision, plan)
        return plan

    def _check_memory(self, decision: Decision, plan: FlowPlan) -> None:
        """Refuse ``plan`` with ``DeviceMemoryError`` when a device has less memory free than the
        plan's peak on it (``runtime/memory_guard.py``): once per plan and batch shape, before
        its first step; ``plan.room`` keeps the least room it leaves. A decision not made by
        ``decide`` (no batch shape) is not checked."""
        shape = next((k for k, d in self._decisions.items() if d is decision), None)
        m = decision.num_microbatches
        if shape is None or not m:
            return
        plan.room = memory_guard.least_room(plan.room, self.check_table_memory(plan.table, m, shape))

    def check_table_memory(self, table, m: int, shape: tuple[int, int]) -> list[int | None] | None:
        """:meth:`_check_memory` for one schedule table of ``m`` microbatches of a batch of
        ``shape`` (samples, tokens per sample); also the profiling step's, which no decision makes.
        Returns each device's room (``memory_guard.room``; None: unbounded), or None when the
        check is off."""
        if not memory_guard.enabled():
            return None
        key = (table.policy, table.forward.bounds, table.backward.bounds, m, shape)
        if key in self._memory_checked:
            return self._memory_checked[key]
        batch, seq_len = shape
        samples = -(-batch // m)  # the largest microbatch of an uneven split
        peaks = self.planned_peaks(table, m, shape)
        free = [d.free_bytes() for d in self.devices]
        memory_guard.check(
            peaks,
            free,
            self.device_names,
            plan=f"{table.policy}, {m} microbatch{'' if m == 1 else 'es'} of up to {samples} x {seq_len} tokens",
            levers=lambda peak: "; ".join(self._memory_levers(peak, table.policy, batch, seq_len, m)),
        )
        self._memory_checked[key] = room = memory_guard.room(peaks, free)
        return room

    def planned_peaks(self, table, m: int, shape: tuple[int, int]) -> list:
        """Per device, the planned peak bytes of ``table`` run on ``m`` microbatches of a batch of
        ``shape`` (a ``memory_guard.StagePeak``, or None for a device that runs nothing): the
        partitioner's memory rule over the estimated layer bytes of the largest microbatch."""
        batch, seq_len = shape
        samples = -(-batch // m)  # the largest microbatch of an uneven split
        spec = POLICIES.get(table.policy)
        rotates = self.config.schedule is None and spec is not None and spec.rotates
        return memory_guard.device_peaks(self._layer_costs(samples * seq_len), table, rotates)

    def _memory_levers(self, peak, policy: str, batch: int, seq_len: int, m: int) -> list[str]:
        """What lowers a device's planned peak, by ``RunConfig`` key (and the recipe's)."""
        c = self.config
        samples = -(-batch // m)
        levers = []
        if m < batch:
            levers.append(
                f"more microbatches (num_microbatches above {m}, at most the batch of {batch}; "
                "run.num_microbatches in a recipe): fewer samples each, so fewer saved activations "
                "and a smaller working set"
            )
        levers.append(
            f"shorter sequences (now {seq_len} tokens; data.max_length in a recipe)"
            + (" or a smaller batch (run.batch_size)" if m < batch else "")
        )
        weights = [(e.tensor.numel(), e.trainable) for e in self.store.entries if not e.is_buffer]
        if sum(n for n, t in weights if t) > 0.5 * sum(n for n, _ in weights):
            levers.append(
                "LoRA adapters instead of full fine-tuning (lora.enabled: true in a recipe): a frozen "
                "layer keeps no fp32 gradient accumulator on the device"
            )
        if c.dtype == "fp32":
            levers.append("dtype='bf16' (run.dtype): weights and activations in 2 bytes instead of 4")
        if any(self.kinds[i] == "head" for i in peak.layers):
            chunk = min(c.head_chunk_tokens, samples * seq_len)
            levers.append(
                f"more head shards (head_shards={2 * c.head_shards}, now {c.head_shards}) or fewer "
                f"head_chunk_tokens (below {chunk}; both run.options in a recipe): the LM head's "
                "weights and logits are in this stage"
            )
        spec = POLICIES.get(policy)
        if len(peak.layers) > 1 and c.schedule is None:
            if spec is not None and spec.stages_per_device is not None:
                levers.append(
                    f"policy='roundpipe' (run.policy), which runs stages of any size: {policy} "
                    f"places a fixed number of stages on {self.num_devices} devices"
                )
            elif c.partition != "auto":
                levers.append(
                    "partition='auto' (run.options.partition in a recipe), which cuts the stages "
                    "to fit the device's capacity"
                )
        levers.append("a device with more memory free (other processes may hold some)")
        return levers

    def _check_forwards_first(self, table) -> None:
        from roundpipe.schedule.check import runs_forwards_first

        strict = self.config.order == "strict"
        if not runs_forwards_first(table, in_order=strict):
            fit = ", ".join(repr(p) for p in POLICIES if POLICIES[p].forwards_first)
            raise ConfigError(
                f"the model's router load-balancing loss counts every MoE layer's expert choices over "
                f"the whole batch before any gradient can flow, but this {table.policy} table runs a "
                f"backward before the step's last forward in strict order: use policy={fit} (or "
                f"'auto'), order='ready' (any policy, run with that barrier), or set "
                f"model.config.output_router_logits = False"
            )

    def advance_start_device(self, plan: FlowPlan) -> None:
        """Deal the next call's first stage to the device after the one that ran the last deal
        (the last round's first backward stage), after every ``forward_backward``, accumulating
        calls included: one call's tail and the next call's head land on different workers."""
        spec = POLICIES.get(plan.table.policy)
        if spec is not None and spec.next_start_device is not None:  # where the policy's deal goes on
            self._start_device = spec.next_start_device(plan.table)

    def report(self) -> RuntimePlan:
        """What the next step runs: the last batch shape's decision, else the profiled shape's,
        else the provisional plan."""
        decision = self._last
        if decision is None:
            if self._measured is not None:
                decision = self.decide(*self._measured[2])
            elif self.config.schedule is not None:
                decision = self._scheduled()
            else:
                decision = self._fixed(None)
        return RuntimePlan.build(
            decision,
            self.names,
            self.layer_times,
            self.store,
            self.device_names,
            shown_predictions(decision.choice),
        )

    # ----------------------------------------------------------------- measured costs
    def set_measured(
        self,
        layer_times: dict[str, tuple[float, float]],
        microbatch_tokens: float,
        shape: tuple[int, int],
        context_s: float = 0.0,
        task_s: float = 0.0,
    ) -> None:
        """Adopt freshly profiled layer times (of a batch of ``shape`` = (samples, tokens per
        sample)), context-build seconds and the gap between operations: automatic choices and plans
        are made anew from them."""
        self.layer_times = dict(layer_times)
        self.context_s = float(context_s)
        self.task_s = float(task_s)
        self.profiled_tokens = microbatch_tokens
        # (forward, backward) pairs, as ``layer_times`` holds them
        pairs = cast(tuple[tuple[float, float], ...], tuple(tuple(layer_times[n]) for n in self.names))
        self._measured = (pairs, microbatch_tokens, cast(tuple[int, int], tuple(shape)))
        self._decisions.clear()
        self._last = None
        self._plans.clear()

    def measured_state(self) -> dict | None:
        """The profile automatic choices are made from (for checkpoints), None before one."""
        if self._measured is None:
            return None
        times, tokens, shape = self._measured
        return {
            "layer_times": {n: list(t) for n, t in zip(self.names, times)},
            "microbatch_tokens": tokens,
            "shape": list(shape),
            "context_s": self.context_s,
            "task_s": self.task_s,
        }

    def load_measured(self, state: dict | None) -> None:
        """Take a checkpoint's profile, so a resumed run makes the same choices without profiling
        again (ignored when it names other layers)."""
        if not state or set(state["layer_times"]) != set(self.names):
            return
        times = {n: tuple(float(x) for x in t) for n, t in state["layer_times"].items()}
        self.set_measured(
            cast(dict[str, tuple[float, float]], times),  # as measured_state wrote them: pairs
            float(state["microbatch_tokens"]),
            cast(tuple[int, int], tuple(int(x) for x in state["shape"])),
            context_s=float(state.get("context_s") or 0.0),  # checkpoints before it was measured: none
            task_s=float(state.get("task_s") or 0.0),
        )

    def observe(self, spans, plan: FlowPlan, microbatch_tokens: float) -> None:
        """Fold a training step's compute spans into the measured times (no-op before profiling).
        Decisions and plans already made are kept."""
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


def _default_kind(policy: str, partition: Partition) -> str:
    if POLICIES[policy].stages_per_device is None:
        return "one layer per stage"
    return f"{partition.num_stages} even stages"


def _provisional_count(spec, num_devices: int, batch: int) -> int:
    """One microbatch per device (at most the batch), as the policy accepts it."""
    m = min(batch, num_devices)
    fits = [k for k in range(m, 0, -1) if spec.accepts_microbatches(k, num_devices)]
    return fits[0] if fits else m


def _compared(head: str, best, rival, rival_name: str, what: str) -> str:
    """``head`` plus how ``best`` compares with ``rival`` (the fastest alternative)."""
    from roundpipe.sim.choice import PREFER_FEWER_WITHIN, speedup

    ratio = speedup(best, rival)
    tie = (
        f"a tie within {PREFER_FEWER_WITHIN:.0%}: fewer microbatches, then the registry's order, then "
        "fewer stages decide"
    )
    if ratio >= 1.005:
        return f"{head}, predicted {ratio:.2f}x as fast as {rival_name}, the next-best {what}"
    if ratio >= 1:
        return f"{head}, predicted as fast as {rival_name}, the next-best {what} ({tie})"
    return f"{head}, predicted within {1 / ratio - 1:.1%} of {rival_name}, the fastest {what} ({tie})"


SHOWN_PREDICTIONS = 5  # candidates a plan lists, fastest first


def shown_predictions(choice) -> tuple[dict, ...]:
    """The fastest candidates of an automatic choice (None: no choice was made), then the chosen
    one if it is not among them: the tie and repeatability rules can pick a slower candidate."""
    if choice is None:
        return ()
    shown = choice.ranked[:SHOWN_PREDICTIONS]
    shown += (choice.best,) if choice.best not in shown else ()
    return tuple(c.summary() for c in shown)
