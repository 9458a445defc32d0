"""The Pipeline: wraps a HF model and trains it with stateless workers.

One ``forward_backward`` call: split the batch into microbatches, build (or reuse) the schedule
table for that microbatch count, let one worker thread per device issue its tasks, and let the host
thread accumulate gradients and step each layer as soon as its gradient is final. Errors from any
thread reach the caller as ``StageError`` / ``OptimizerError`` with where they happened; a watchdog
turns a stall into ``WatchdogTimeout``. Nothing is left running after an error.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from roundpipe.backend import MemoryLedger, make_backend
from roundpipe.backend.cpu import Aborted
from roundpipe.config import RunConfig
from roundpipe.errors import (
    ConfigError,
    DeviceOutOfMemory,
    InputError,
    OptimizerError,
    PipelineStateError,
    PlanError,
    RoundpipeError,
    StageError,
    WatchdogTimeout,
)
from roundpipe.models import adapt_model
from roundpipe.models.base import MicrobatchInputs, loss_positions
from roundpipe.optim import DynamicLossScaler, LayerwiseAdamW, OptimizerConfig, clip_factor
from roundpipe.runtime.exchange import AbortedWait, Exchange, Slot
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.runtime.plan import FlowPlan, build_flow_plan
from roundpipe.runtime.store import ParameterStore
from roundpipe.runtime.worker import Worker
from roundpipe.schedule import Partition
from roundpipe.schedule.policies import POLICIES


@dataclass(frozen=True)
class StepOutput:
    """What ``forward_backward`` returns: the batch loss (mean over label tokens) and that token count."""

    loss: float
    num_tokens: int


class StepRun:
    """State of one ``forward_backward`` call shared by the workers and the host thread."""

    def __init__(
        self, pipe: Pipeline, index: int, microbatches, total_tokens: int, flow_plan: FlowPlan, eager: bool
    ):
        self.pipe = pipe
        self.index = index
        self.microbatches = microbatches
        self.total_tokens = total_tokens
        self.flow_plan = flow_plan
        self.grad_seed = pipe._loss_scale() / total_tokens
        self.exchange = Exchange(lambda: pipe.backend.aborted)
        self.loss_sum = 0.0
        self.eager = eager
        store = pipe.store
        # How many gradient contributions each trainable entry gets this call (one per backward stage
        # that uses it, per microbatch); a step group is final when all of its entries reach zero.
        self.remaining: dict[int, int] = {}
        bwd = flow_plan.table.backward
        for s in range(bwd.num_stages):
            for k in store.trainable_keys(bwd.layers(s)):
                self.remaining[k] = self.remaining.get(k, 0) + flow_plan.table.num_microbatches
        self.group_left = {
            owner: sum(1 for k in keys if self.remaining.get(k, 0) > 0)
            for owner, keys in pipe._groups().items()
        }

    def on_loss(self, host_loss: Slot, event) -> None:
        """Worker thread: queue adding a microbatch's loss sum (downloaded with ``event``)."""
        self.pipe._hostq.submit(lambda: self._add_loss(host_loss), event)

    def _add_loss(self, host_loss: Slot) -> None:
        self.loss_sum += float(host_loss.value)

    def on_grads(self, layers: range, host_grads: Slot, contributions: int, event) -> None:
        """Worker thread: queue adding a backward stage's weight gradients, summed over
        ``contributions`` microbatches on the device, into the fp32 buffers."""
        self.pipe._hostq.submit(lambda: self._accumulate(layers, host_grads, contributions), event)

    def _accumulate(self, layers: range, host_grads: Slot, contributions: int) -> None:
        """Host thread: add gradients into the fp32 buffers; step groups that became final.

        ``host_grads.value`` is keyed by piece ``(entry key, rows)``: a gradient of rows
        ``[start, stop)`` only (a vocabulary shard's) goes into those rows of the whole buffer.
        """
        with self.pipe._host_span(f"acc:{self.pipe.adapter.layers[layers.start].name}", "accumulate"):
            store = self.pipe.store
            for (k, rows), g in (host_grads.value or {}).items():
                grad = store.entries[k].grad
                (grad if rows is None else grad[rows[0] : rows[1]]).add_(g)
            for k in store.trainable_keys(layers):
                self.remaining[k] -= contributions
                if self.remaining[k] == 0:
                    owner = store.entries[k].owner
                    self.group_left[owner] -= 1
                    if self.group_left[owner] == 0 and self.eager:
                        self.pipe._step_group(owner)


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
    def build(cls, pipe: Pipeline, forward: Partition, backward: Partition) -> RuntimePlan:
        names = [layer.name for layer in pipe.adapter.layers]
        times = pipe.layer_times
        wbytes = pipe.store.layer_bytes
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
                    else sum(
                        4 * e.tensor.numel() for e in pipe.store.entries if e.trainable and e.owner in layers
                    )
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
        return cls(pipe.config.policy, tuple(d.name for d in pipe.backend.devices), tuple(rows))

    def to_json(self) -> str:
        import json

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


class Pipeline:
    """A HF causal LM (optionally peft-wrapped) trained with all state on the CPU.

    Use as a context manager, or call ``close()``. Thread-safety: one caller thread at a time.
    """

    def __init__(self, model: nn.Module, config: RunConfig | None = None):
        self.config = config or RunConfig()
        self.adapter = adapt_model(model, head_shards=self.config.head_shards)
        self.backend = make_backend(self.config.devices, self.config.device_capacity)
        try:
            self.store = ParameterStore(
                self.adapter,
                self.config.torch_dtype,
                self.backend,
                double_buffer=self.config.optimizer_mode == "async",
            )
            self.store_num_layers = len(self.adapter.layers)
            self._check_capacity()
            self.random_layers = _layers_with_dropout(self.adapter)
            self.workers = [Worker(self, d) for d in self.backend.devices]
            self._hostq = HostQueue()
        except BaseException:
            self.backend.close()
            raise
        self.host_memory = MemoryLedger("host", None)  # hand-offs (activations, gradients) held on the CPU
        self._optimizer: LayerwiseAdamW | None = None
        self._scaler = DynamicLossScaler() if self.config.dtype == "fp16" else None
        self._plans: dict[tuple, FlowPlan] = {}
        self.layer_times: dict[str, tuple[float, float]] | None = None  # measured (see profile)
        self._profiled_tokens = 1.0
        self._auto: tuple[Partition, Partition] | None = None
        self._start_device = 0  # roundpipe rotates the device the next iteration starts on
        self.weight_bound = False
        capacity = self.backend.devices[0].memory.capacity
        self.weight_cache_bytes = self.config.weight_cache_bytes or (capacity // 2 if capacity else None)
        self._steps_run = 0
        self._grads_pending = False  # forward_backward ran since the last step
        self._stepped_eagerly = False
        self.last_step_skipped = False
        self._closed = False
        self._recording_origin = None
        self._host_spans: list = []
        self._last_spans: list = []
        self._last_wall = 0.0
        self._bytes_at_start: dict = {}

    # ----------------------------------------------------------------- public API
    def configure_optimizer(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float | None = None,
    ) -> None:
        """AdamW on the fp32 CPU masters (``torch.optim.AdamW`` semantics, fused CPU kernel)."""
        self._optimizer = LayerwiseAdamW(
            self.store, OptimizerConfig(lr, weight_decay, tuple(betas), eps, max_grad_norm)
        )

    def set_lr(self, lr: float) -> None:
        self._require_optimizer("set_lr")
        self._optimizer.set_lr(lr)

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> StepOutput:
        """Run forward and backward over the whole batch; gradients accumulate on the CPU.

        The loss is the mean cross-entropy over every label token of the batch (labels are shifted
        inside, -100 ignored), whatever the microbatch count. With an optimizer configured, each
        layer's update starts as soon as its gradient is final (overlapping the backward of lower
        layers) unless ``accumulate=True`` (keep the gradients for a later call) or the update
        needs every gradient first (``max_grad_norm``, fp16 loss scaling); ``step()`` completes it.
        """
        self._check_open()
        if self._stepped_eagerly:
            raise PipelineStateError(
                "call step() after each forward_backward (or pass accumulate=True to the earlier call)"
            )
        microbatches, total = self._split(input_ids, labels, attention_mask, position_ids)
        if self.config.partition == "auto" and self.layer_times is None:
            self.profile(input_ids, labels, attention_mask, position_ids, steps=1)
        plan = self._flow_plan(len(microbatches))
        eager = (
            self._optimizer is not None
            and not accumulate
            and self.config.optimizer_mode == "sync"
            and self._can_step_eagerly()
        )
        self.store.set_read_buffer(self._steps_run)
        step = StepRun(self, self._steps_run, microbatches, total, plan, eager)
        self.weight_bound = plan.table.weight_bound
        self.last_plan = plan
        self._begin_recording()
        try:
            self._execute(step)
        finally:
            self._end_recording()
        self._advance_start_device(plan)
        if self.layer_times is not None:
            from roundpipe.runtime.profiler import update_moving_average

            update_moving_average(
                self.layer_times,
                self._last_spans,
                plan.table.forward,
                plan.table.backward,
                [layer.name for layer in self.adapter.layers],
                microbatch_scale=self._profiled_tokens / (input_ids.numel() / len(microbatches)),
            )
        self._steps_run += 1
        self._grads_pending = True
        self._stepped_eagerly = eager
        return StepOutput(step.loss_sum / total, total)

    def step(self) -> None:
        """Complete the optimizer update for the gradients accumulated so far, then zero them."""
        self._check_open()
        self._require_optimizer("step")
        if not self._grads_pending:
            raise PipelineStateError("step() needs gradients: call forward_backward first")
        self.last_step_skipped = False
        if self.config.optimizer_mode == "async":
            # Publish into the copy this iteration read: the iteration after next reads it, while
            # the next one computes on the other copy (staleness exactly 1).
            publish_to = self._steps_run - 1
            self._hostq.submit(lambda: self._deferred_step(publish_to))
        elif not self._stepped_eagerly:
            self._deferred_step()
        self._grads_pending = False
        self._stepped_eagerly = False

    def zero_grad(self) -> None:
        self.store.zero_grads()
        self._grads_pending = False

    def export_to(self, model: nn.Module) -> None:
        """Write the trained fp32 masters into ``model`` (the wrapped HF / peft model, or a copy of it)."""
        self._hostq.drain()  # an async update still running must land first
        own = {id(e.tensor): e for e in self.store.entries}
        by_name = {e.name: e for e in self.store.entries if e.trainable}
        written = 0
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                e = own.get(id(p)) or _match_name(name, by_name)
                if e is not None and e.trainable:
                    p.data.copy_(e.master.data)
                    written += 1
        if written == 0 and by_name:
            raise PipelineStateError(
                "export_to found none of the trained parameters in that model; pass the model given to wrap() "
                "or one with the same parameter names"
            )

    def state_dict(self) -> dict:
        """fp32 masters and optimizer state keyed by parameter name (a checkpoint)."""
        self._hostq.drain()  # an async update still running must land first
        sd = {
            "masters": {e.name: e.master.detach().clone() for e in self.store.entries if e.trainable},
            "steps_run": self._steps_run,
        }
        if self._optimizer is not None:
            sd["optimizer"] = self._optimizer.state_dict()
        if self._scaler is not None:
            sd["loss_scaler"] = self._scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        masters = sd["masters"]
        self._hostq.drain()  # an async update still running must land first
        with torch.no_grad():
            for e in self.store.entries:
                if e.trainable:
                    if e.name not in masters:
                        raise PipelineStateError(
                            f"checkpoint lacks parameter {e.name!r}; was it saved from this model?"
                        )
                    e.master.data.copy_(masters[e.name])
            self.store.refresh_compute([e.key for e in self.store.entries if e.trainable])
        self._steps_run = sd.get("steps_run", 0)
        if "optimizer" in sd and self._optimizer is not None:
            self._optimizer.load_state_dict(sd["optimizer"])
        if "loss_scaler" in sd and self._scaler is not None:
            self._scaler.load_state_dict(sd["loss_scaler"])

    def stats(self) -> dict:
        """Figures of the last ``forward_backward``: per device busy (compute) time, idle (bubble)
        time within the step, bytes copied each way, peak bytes held; and host-side time."""
        wall = self._last_wall
        devices = []
        for d in self.backend.devices:
            busy = sum(
                e - s for dev, lane, _, _, s, e in self._last_spans if dev == d.index and lane == "compute"
            )
            devices.append(
                {
                    "device": d.name,
                    "busy_s": busy,
                    "idle_s": max(0.0, wall - busy),
                    "bubble_fraction": (max(0.0, wall - busy) / wall) if wall else 0.0,
                    "bytes_to_device": d.bytes_in - self._bytes_at_start.get(d.index, (0, 0))[0],
                    "bytes_to_host": d.bytes_out - self._bytes_at_start.get(d.index, (0, 0))[1],
                    "peak_bytes": d.memory.peak,
                }
            )
        host = sum(e - s for dev, lane, _, _, s, e in self._last_spans if lane == "host")
        return {
            "step_s": wall,
            "devices": devices,
            "host_busy_s": host,
            "host_handoff_peak_bytes": self.host_memory.peak,
        }

    def last_timeline(self):
        """Every labelled piece of work of the last step: a ``roundpipe.schedule.timeline.Timeline``
        (device lanes ``compute``/``h2d``/``d2h``, and the ``host`` lane as device -1)."""
        from roundpipe.schedule.timeline import Span, Timeline

        spans = [
            Span(dev, lane, name, kind, start, end) for dev, lane, name, kind, start, end in self._last_spans
        ]
        return Timeline(
            spans,
            {
                "source": "runtime",
                "backend": self.backend.name,
                "policy": self.config.policy,
                "devices": [d.name for d in self.backend.devices],
            },
        )

    def _begin_recording(self) -> None:
        self.host_memory.reset_peak()
        for d in self.backend.devices:
            d.memory.reset_peak()
        self._bytes_at_start = {d.index: (d.bytes_in, d.bytes_out) for d in self.backend.devices}
        self._host_spans = []
        self.backend.start_recording()
        self._recording_origin = getattr(self.backend, "recording_origin", time.perf_counter())
        self._step_started = time.perf_counter()

    def _end_recording(self) -> None:
        self._last_wall = time.perf_counter() - self._step_started
        self._last_spans = self.backend.collect_spans() + self._host_spans
        self._recording_origin = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hostq.close()
        self.backend.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # ----------------------------------------------------------------- planning
    def _flow_plan(self, num_microbatches: int) -> FlowPlan:
        options = dict(self.config.policy_options)
        if self.config.policy == "roundpipe":
            options.setdefault("start_device", self._start_device)
        key = (num_microbatches, tuple(sorted(options.items())))
        plan = self._plans.get(key)
        if plan is None:
            table = self.config.schedule
            if table is None:
                forward, backward = self._partitions()
                policy = POLICIES[self.config.policy]
                table = policy(forward, backward, len(self.backend.devices), num_microbatches, **options)
            else:
                self._check_schedule(table)
            plan = self._plans[key] = build_flow_plan(table)
        return plan

    def _check_schedule(self, table) -> None:
        from roundpipe.schedule.check import validate_table

        n, d = len(self.adapter.layers), len(self.backend.devices)
        if table.forward.num_layers != n:
            raise ConfigError(
                f"the schedule's partitions cut {table.forward.num_layers} layers; this model has {n}"
            )
        if table.num_devices != d:
            raise ConfigError(
                f"the schedule has {table.num_devices} device rows; devices={self.config.devices!r} gives {d}"
            )
        validate_table(table, in_order=self.config.order == "strict")

    def _partitions(self) -> tuple[Partition, Partition]:
        if self.config.partition is None:
            part = self._default_partition()
            return part, part
        if self.config.partition == "auto":
            return self._auto_partitions()
        n = len(self.adapter.layers)
        sizes = {
            "partition": self.config.partition,
            "backward_partition": self.config.backward_partition or self.config.partition,
        }
        for name, sz in sizes.items():
            if sum(sz) != n:
                raise ConfigError(
                    f"{name}={tuple(sz)} covers {sum(sz)} layers but the model has {n} "
                    f"({', '.join(layer.name for layer in self.adapter.layers[:3])}, ..., {self.adapter.layers[-1].name})"
                )
        return Partition.from_sizes(sizes["partition"]), Partition.from_sizes(sizes["backward_partition"])

    def _advance_start_device(self, plan: FlowPlan) -> None:
        """Deal the next iteration's first stage to the device after the one that ran the last
        backward stage, so one step's tail and the next step's head land on different workers."""
        if self.config.policy == "roundpipe":
            t = plan.table
            deals = t.forward.num_stages + t.backward.num_stages - 1
            self._start_device = (self._start_device + deals) % t.num_devices

    def _microbatch_count(self, batch: int) -> int:
        m = self.config.num_microbatches
        if m != "auto":
            return m
        from roundpipe.partition.partitioner import auto_microbatches

        d = len(self.backend.devices)
        if self.layer_times is None:
            return min(batch, d)
        forward, backward = self._partitions()
        names = [layer.name for layer in self.adapter.layers]
        f = [sum(self.layer_times[names[i]][0] for i in forward.layers(s)) for s in range(forward.num_stages)]
        b = [
            sum(sum(self.layer_times[names[i]]) + self.layer_times[names[i]][0] for i in backward.layers(s))
            for s in range(backward.num_stages)
        ]
        return max(1, min(batch, auto_microbatches(f, b, d)))

    def _stage_count(self) -> int:
        """Stages the policy places on the devices: one per device (roundpipe: one round),
        ``virtual_stages`` per device for interleaved, ``2 x waves`` per device for hanayo."""
        n, d, opts = len(self.adapter.layers), len(self.backend.devices), self.config.policy_options
        stages = {
            "interleaved": d * (opts.get("virtual_stages") or 2),
            "hanayo": 2 * d * (opts.get("waves") or 1),
        }.get(self.config.policy, d)
        if stages > n:
            raise ConfigError(
                f"policy {self.config.policy!r} on {d} devices needs {stages} stages but the model has only {n} "
                "layers; use fewer devices or the 'roundpipe' policy"
            )
        return stages

    def _auto_partitions(self) -> tuple[Partition, Partition]:
        """Balance measured stage times (``self.layer_times``) within the device capacity.

        Forward stages balance forward times; backward stages balance recompute + backward times
        (roundpipe only: the weight-bound policies need one partition for both, balancing the sum).
        Too little memory for the policy's stage count raises the count (roundpipe) or PlanError.
        """
        from roundpipe.partition.partitioner import optimal_partition

        if self._auto is not None:
            return self._auto
        names = [layer.name for layer in self.adapter.layers]
        fwd = [self.layer_times[n][0] for n in names]
        bwd = [self.layer_times[n][0] + self.layer_times[n][1] for n in names]
        cap = self.backend.devices[0].memory.capacity
        budget = None if cap is None else int(cap * 0.9)
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
                    if (
                        self.config.policy != "roundpipe"
                        or getattr(e, "min_stages", None) is None
                        or s >= len(times)
                    ):
                        raise
                    s = min(len(times), max(s + 1, e.min_stages))

        if self.config.policy == "roundpipe":
            self._auto = (cut(fwd, "forward"), cut(bwd, "backward"))
        else:
            both = cut([f + b for f, b in zip(fwd, bwd)], "forward+backward")
            self._auto = (both, both)
        return self._auto

    def profile(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        steps: int = 2,
    ) -> dict[str, tuple[float, float]]:
        """Measure every layer's forward and backward (without recompute) seconds per microbatch.

        Runs ``steps`` forward/backward passes of this batch, one layer per task, every worker
        taking its share of the microbatches at once (so shared-machine contention is included),
        and keeps the medians as ``self.layer_times`` (the partitioner's measured costs,
        then refreshed by a moving average during training). Weights and optimizer state are not
        touched; the gradients it makes are discarded.
        """
        self._check_open()
        if self._grads_pending:
            raise PipelineStateError("profile() would mix its gradients with pending ones: call step() first")
        from roundpipe.runtime.profiler import layer_times_from_spans, profiling_table

        microbatches, total = self._split(input_ids, labels, attention_mask, position_ids)
        table = profiling_table(len(self.adapter.layers), len(self.backend.devices), len(microbatches))
        plan = build_flow_plan(table, fuse=False)
        spans = []
        self.weight_bound = False
        for _ in range(steps):
            step = StepRun(self, self._steps_run, microbatches, total, plan, eager=False)
            self._begin_recording()
            try:
                self._execute(step)
            finally:
                self._end_recording()
            spans += self._last_spans
        self.store.zero_grads()
        names = [layer.name for layer in self.adapter.layers]
        self.layer_times = layer_times_from_spans(spans, names)
        self._profiled_tokens = input_ids.numel() / len(microbatches)
        self._auto = None
        self._plans.clear()
        return dict(self.layer_times)

    @property
    def plan(self) -> RuntimePlan:
        """The partitions and per-stage estimates the next step will use (``print(pipe.plan)``)."""
        forward, backward = self._partitions()
        return RuntimePlan.build(self, forward, backward)

    def _default_partition(self) -> Partition:
        """Until the partitioner drives the runtime: one layer per stage for ``roundpipe`` (it streams
        any number of stages), else as many even stages as the policy places on the devices."""
        n = len(self.adapter.layers)
        stages = n if self.config.policy == "roundpipe" else self._stage_count()
        return Partition.from_sizes([n // stages + (1 if i < n % stages else 0) for i in range(stages)])

    def _check_capacity(self) -> None:
        cap = self.backend.devices[0].memory.capacity
        if cap is None:
            return
        for layer, nbytes in zip(self.adapter.layers, self.store.layer_bytes):
            if nbytes > cap:
                raise DeviceOutOfMemory(
                    self.backend.devices[0].name, f"the weights of layer {layer.name!r}", nbytes, 0, cap
                )

    # ----------------------------------------------------------------- inputs
    def _split(self, input_ids, labels, attention_mask, position_ids):
        if (
            not torch.is_tensor(input_ids)
            or input_ids.dim() != 2
            or input_ids.dtype not in (torch.int64, torch.int32)
        ):
            raise InputError(
                f"input_ids must be an integer tensor of shape [batch, seq], got "
                f"{getattr(input_ids, 'shape', type(input_ids).__name__)} {getattr(input_ids, 'dtype', '')}"
            )
        batch, seq = input_ids.shape
        if labels is None:
            raise InputError("labels are required for training (use -100 for positions without a target)")
        for name, t in (("labels", labels), ("attention_mask", attention_mask)):
            if t is not None and (not torch.is_tensor(t) or tuple(t.shape) != (batch, seq)):
                raise InputError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(getattr(t, 'shape', ()))}"
                )
        if position_ids is not None and (
            position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch)
        ):
            raise InputError(f"position_ids must be [batch or 1, {seq}], got {tuple(position_ids.shape)}")
        m = self._microbatch_count(batch)
        if m > batch:
            raise InputError(
                f"num_microbatches={m} is larger than the batch ({batch} samples); "
                "use a larger batch or fewer microbatches"
            )
        vocab = self.adapter.config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise InputError(f"input_ids must lie in [0, {vocab}) (the model's vocab_size)")
        labels = labels.long()
        total = int((labels[:, 1:] != -100).sum())
        if total == 0:
            raise InputError(
                "every label is -100 (after the shift), so there is nothing to learn from this batch"
            )
        bad = labels[(labels != -100)]
        if bad.numel() and (int(bad.min()) < 0 or int(bad.max()) >= vocab):
            raise InputError(f"labels must be -100 or lie in [0, {vocab})")
        input_ids = input_ids.long()
        out = []
        for idx in torch.arange(batch).tensor_split(m):
            sl = slice(int(idx[0]), int(idx[-1]) + 1)
            pos = None
            if position_ids is not None:
                pos = position_ids if position_ids.shape[0] == 1 else position_ids[sl]
            out.append(
                MicrobatchInputs(
                    input_ids[sl].contiguous(),
                    None if attention_mask is None else attention_mask[sl].contiguous(),
                    None if pos is None else pos.long().contiguous(),
                    labels[sl].contiguous(),
                    loss_positions(labels[sl]),
                )
            )
        return out, total

    # ----------------------------------------------------------------- execution
    def _execute(self, step: StepRun) -> None:
        errors: list[BaseException] = []

        def worker_main(worker: Worker, flows) -> None:
            try:
                worker.run(step, flows)
            except BaseException as e:  # carried to the caller below
                errors.append(e)
                self.backend.abort()

        threads = [
            threading.Thread(
                target=worker_main,
                args=(w, step.flow_plan.flows[i]),
                name=f"roundpipe-worker-{i}",
                daemon=True,
            )
            for i, w in enumerate(self.workers)
        ]
        for t in threads:
            t.start()
        final_events = None
        last_progress, last_change = None, time.monotonic()
        timed_out = None
        while True:
            if final_events is None and not any(t.is_alive() for t in threads):
                final_events = [s.record_event() for d in self.backend.devices for s in d.streams.values()]
            if final_events is not None and all(ev.query() for ev in final_events):
                break
            if errors or self.backend.errors:
                break
            progress = (
                sum(w.tasks_done for w in self.workers),
                self.backend.progress(),
                self._hostq.pending,
            )
            now = time.monotonic()
            if progress != last_progress:
                last_progress, last_change = progress, now
            elif now - last_change > self.config.watchdog_s:
                timed_out = WatchdogTimeout(
                    f"no progress for {self.config.watchdog_s:.0f}s; "
                    + "; ".join(
                        f"{w.device.name}: worker {w.status} ["
                        + "; ".join(st.describe() for st in w.device.streams.values())
                        + "]"
                        for w in self.workers
                    )
                )
                break
            time.sleep(0.002)
        if not errors and not self.backend.errors and timed_out is None:
            try:
                for ev in final_events:
                    ev.synchronize()
                self._hostq.drain()
                return
            except BaseException as e:
                errors.append(e)
        late = self._recover(threads)
        raise self._root_error(timed_out, late + errors)

    def _recover(self, threads) -> list[BaseException]:
        """After a failure: stop every wait, let threads end, and leave the pipeline reusable.
        Returns the errors the streams and the host thread reported meanwhile."""
        self.backend.abort()
        for t in threads:
            t.join()
        late: list[BaseException] = []
        try:
            self._hostq.drain(is_aborted=lambda: True)
        except BaseException as e:
            late.append(e)
        late = list(self.backend.errors) + late
        self.backend.reset()
        for w in self.workers:
            w.resident.clear()
            w._ctx = None
            w._context_module = None
            w.status = "idle"
            w.device.memory.in_use = 0
            w.device.memory.by_tag.clear()
        self.host_memory.in_use = 0
        self.host_memory.by_tag.clear()
        return late

    def _root_error(self, timed_out, candidates: list[BaseException]) -> BaseException:
        """The error to raise: a timeout, else the first one that is not a side effect of aborting."""
        if timed_out is not None:
            return timed_out
        for e in candidates:
            if not isinstance(e, (Aborted, AbortedWait)):
                if isinstance(e, RoundpipeError):
                    return e
                wrapped = StageError(f"{type(e).__name__}: {e}")
                wrapped.__cause__ = e  # the traceback says where it happened
                return wrapped
        return candidates[0] if candidates else StageError("the step failed for an unknown reason")

    # ----------------------------------------------------------------- optimizer
    def _groups(self) -> dict[int, list[int]]:
        if self._optimizer is not None:
            return self._optimizer.groups
        groups: dict[int, list[int]] = {}
        for e in self.store.entries:
            if e.trainable:
                groups.setdefault(e.owner, []).append(e.key)
        return groups

    def _can_step_eagerly(self) -> bool:
        return self._optimizer.config.max_grad_norm is None and self._scaler is None

    def _loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    @contextlib.contextmanager
    def _host_span(self, name: str, kind: str):
        """Time host-side work (accumulation, optimizer steps) onto the timeline's host lane."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._recording_origin is not None:
                t0 = self._recording_origin
                self._host_spans.append((-1, "host", name, kind, start - t0, time.perf_counter() - t0))

    def _step_group(self, owner: int, factor: float = 1.0, publish_to: int | None = None) -> None:
        try:
            with self._host_span(f"optim:{self.adapter.layers[owner].name}", "optim"):
                self._optimizer.step_group(owner, factor, publish_to)
        except BaseException as e:
            raise OptimizerError(
                f"{type(e).__name__} while stepping layer {self.adapter.layers[owner].name}: {e}",
                layer=self.adapter.layers[owner].name,
                device="host",
            ) from e

    def _deferred_step(self, publish_to: int | None = None) -> None:
        factor = 1.0 / self._loss_scale()
        if self._scaler is not None:
            finite = self._optimizer.grads_finite()
            self._scaler.update(not finite)
            if not finite:
                self.store.zero_grads()
                self.last_step_skipped = True
                return
        if self._optimizer.config.max_grad_norm is not None:
            norm = (self._optimizer.grad_norm_sq() ** 0.5) * factor
            self.last_grad_norm = norm
            factor *= clip_factor(norm, self._optimizer.config.max_grad_norm)
        for owner in sorted(self._optimizer.groups, reverse=True):
            self._step_group(owner, factor, publish_to)

    def _require_optimizer(self, what: str) -> None:
        if self._optimizer is None:
            raise PipelineStateError(f"{what}() needs an optimizer: call configure_optimizer(lr=...) first")

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineStateError("this pipeline is closed; wrap the model again")


def _match_name(name: str, by_name: dict) -> object:
    if name in by_name:
        return by_name[name]
    for n, e in by_name.items():
        if name.endswith("." + n):
            return e
    return None


def _layers_with_dropout(adapter) -> set[int]:
    """Layers whose forward draws random numbers in training mode (dropout), so recompute must replay them."""
    out = set()
    attn_p = float(getattr(adapter.config, "attention_dropout", 0.0) or 0.0)
    for layer in adapter.layers:
        mods = list(layer.module.modules())
        training = any(m.training for m in mods)
        if not training:
            continue
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in mods) or (layer.kind == "block" and attn_p > 0):
            out.add(layer.index)
    return out
