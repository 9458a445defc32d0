"""The Pipeline: wraps a HF model and trains it with stateless workers.

One ``forward_backward`` call: split the batch into microbatches (``inputs``), build or reuse the
schedule table for that microbatch count (``planning``), let one worker thread per device issue its
tasks while the host thread accumulates gradients and steps each layer as soon as its gradient is
final (``executor``, ``step``, ``optimizer_steps``), and keep the step's spans (``report``). Errors
from any thread reach the caller as ``StageError`` / ``OptimizerError`` with where they happened;
a watchdog turns a stall into ``WatchdogTimeout``. Nothing is left running after an error.

Workers get a ``WorkerSetup`` (``worker_setup.py``): the parts of the pipeline they read, and no
more; everything else here is the caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import cast

import torch
from torch import nn

from roundpipe.backend import MemoryLedger, make_backend
from roundpipe.config import RunConfig
from roundpipe.distributed import join as join_data_parallel
from roundpipe.errors import InputError, PipelineStateError
from roundpipe.models import adapt_model
from roundpipe.models.parametrized import layers_that_parametrize
from roundpipe.models.random_draws import layers_that_draw
from roundpipe.models.verify import verify_model
from roundpipe.optim import LayerwiseAdamW, OptimizerConfig
from roundpipe.runtime.cost_settings import cost_settings
from roundpipe.runtime.data_parallel import DataParallelSteps
from roundpipe.runtime.decision import RuntimePlan, for_short_batch
from roundpipe.runtime.exchange import Exchange
from roundpipe.runtime.executor import Executor
from roundpipe.runtime.hostqueue import HostQueue, default_host_threads
from roundpipe.runtime.inputs import mean_tokens, split_batch
from roundpipe.runtime.masters import export_masters, load_masters, load_stale, masters_state, stale_state
from roundpipe.runtime.numerics import first_nonfinite, nonfinite_error
from roundpipe.runtime.optimizer_steps import OptimizerSteps
from roundpipe.runtime.overlapped_calls import OverlappedCalls
from roundpipe.runtime.plan import FlowPlan, build_flow_plan
from roundpipe.runtime.planning import Planner
from roundpipe.runtime.report import Recorder
from roundpipe.runtime.router_totals import RouterTotals
from roundpipe.runtime.step import StepOutput, StepRun
from roundpipe.runtime.store import ParameterStore, Weights
from roundpipe.runtime.worker import Worker
from roundpipe.runtime.worker_setup import WorkerSetup


class Pipeline:
    """A HF causal LM (optionally peft-wrapped) trained with all state on the CPU.

    Use as a context manager, or call ``close()``. Thread-safety: one caller thread at a time.

    Args:
        model: the model to train. Its parameters on the meta device (a model built without
            weights) are read from ``weights`` straight into the parameter store, and the model's
            tensors are re-pointed at the store's copies (see ``runtime/store.py``).
        config: how to run (default ``RunConfig()``).
        weights: ``name in weights`` and ``weights.fill(name, out)`` for the model's meta
            parameters, e.g. ``roundpipe.train.loading.SafetensorsWeights(model_dir)``; None when
            the model holds its weights.
    """

    def __init__(self, model: nn.Module, config: RunConfig | None = None, weights: Weights | None = None):
        self.config = config or RunConfig()
        # The data-parallel group when launched as one rank of several (torchrun), else None.
        self.dp = join_data_parallel(self.config)
        self.adapter = adapt_model(model, head_shards=self.config.head_shards)
        random_layers = layers_that_draw(self.adapter)  # refuses draws no seed replays
        self.verified = verify_model(
            model, self.adapter, full=self.config.verify_model, head_shards=self.config.head_shards
        )
        self.backend = make_backend(self.config.devices, self.config.device_capacity, self.config.sanitize)
        if self.config.fp16_accumulation:
            self.backend.use_fp16_accumulation()
        model_config, settings = cost_settings(model, self.config)
        self.backend.attach(model_config, settings)
        if weights is None and self.backend.host_device.type == "meta":
            from roundpipe.backend.virtual import ShapesOnly

            weights = ShapesOnly()  # a virtual run: shapes, no data
        names = [layer.name for layer in self.adapter.layers]
        try:
            self.store = ParameterStore(
                self.adapter,
                self.config.torch_dtype,
                self.backend,
                double_buffer=self.config.optimizer_mode == "async",
                host_memory=self.config.host_memory,
                weights=weights,
                quantization=self.config.quantization,
            )
            self.backend.host_buffers = self.store.host.pool  # where downloads land
            self._planner = Planner(self.config, self.adapter, self.store, self.backend, settings)
            self._planner.check_capacity()
            # Hand-offs (activations, gradients) held on the CPU.
            self.host_memory = MemoryLedger("host", None)
            capacity = self.backend.devices[0].memory.capacity
            setup = WorkerSetup(
                self.backend,
                self.store,
                self.adapter,
                self.config,
                self.host_memory,
                random_layers=random_layers,
                parametrized_layers=layers_that_parametrize(self.adapter),
                rank=None if self.dp is None else self.dp.rank,
                weight_cache_bytes=self.config.weight_cache_bytes or (capacity // 2 if capacity else None),
            )
            self.workers = [Worker(setup, d) for d in self.backend.devices]
            host_threads = self.config.host_threads or default_host_threads(len(self.workers))
            self._hostq = HostQueue(threads=host_threads, context=self.backend.host_work)
        except BaseException:
            self.backend.close()
            raise
        self._recorder = Recorder(self.backend, self.host_memory, self.store.host_memory_stats)
        self._updates = OptimizerSteps(
            self.store, names, self._recorder, loss_scaling=self.config.dtype == "fp16",
            nan_policy=self.config.nan_policy,
        )  # fmt: skip
        self._executor = Executor(
            self.backend, self.workers, self._hostq, self.host_memory, self.config.watchdog_s
        )
        self._calls = OverlappedCalls(self._executor, self._hostq, self._updates, self.config.overlap_calls)
        self._ranks = None
        if self.dp is not None:
            self._ranks = DataParallelSteps(self.dp, self.store, self._updates, self._recorder, self.config)
        self.last_plan: FlowPlan | None = None  # the flow plan of the last forward_backward
        self._steps_run = 0  # forward_backward calls: with the layer and microbatch, the dropout seeds
        self._steps_at_update = 0  # ... as the last completed step() left it (abandon_step)
        # Optimizer steps taken: every forward_backward of optimizer step k reads compute copy k % 2
        # (async mode), also when several calls accumulate into one step.
        self._updates_run = 0
        self._grads_pending = False  # forward_backward ran since the last step
        self._stepped_eagerly = False
        self._closed = False

    # ----------------------------------------------------------------- training
    def configure_optimizer(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float | None = None,
        state_dtype: str = "fp32",
    ) -> None:
        """AdamW on the fp32 CPU masters: ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)``
        over every trainable parameter, parameter by parameter (fused CPU kernel), one with no
        gradient in a step skipped as torch skips a ``.grad`` of None; ``max_grad_norm`` clips as
        ``torch.nn.utils.clip_grad_norm_`` does before the step. ``state_dtype``: the moments kept in
        ``"bf16"`` or 8-bit blocks (``"int8"``) on the host (``optim/low_precision_state.py``).

        Raises:
            ConfigError: a setting torch would reject, or one that is not finite.
        """
        self._updates.configure(OptimizerConfig(lr, weight_decay, betas, eps, max_grad_norm, state_dtype))

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next ``step()``. In async mode an update may still be running
        on the host thread: the change is queued behind it, so that update keeps its own rate."""
        optimizer = self._updates.require("set_lr")
        if self.config.optimizer_mode == "async":
            self._calls.after_issue(lambda: self._hostq.submit(lambda: optimizer.set_lr(lr)))
        else:
            optimizer.set_lr(lr)

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        accumulate: bool = False,
        loss_tokens: int | None = None,
    ) -> StepOutput:
        """Run forward and backward over the whole batch; gradients accumulate on the CPU.

        The loss is the mean cross-entropy over every label token of the batch (labels are shifted
        inside, -100 ignored), whatever the microbatch count. With an optimizer configured, each
        layer's update starts as soon as its gradient is final (overlapping the backward of lower
        layers) unless ``accumulate=True`` (keep the gradients for a later call) or the update
        needs every gradient first (``max_grad_norm``, fp16 loss scaling); ``step()`` completes it.

        ``loss_tokens``: the gradient is that of the loss summed over tokens and divided by this
        count instead of this batch's own label count. Gradient accumulation passes the label
        tokens of every batch of the optimizer step, so that the accumulated gradient is exactly
        that of the token-mean loss of the whole step. The returned loss stays this batch's mean.
        """
        self._check_open()
        if self._stepped_eagerly:
            raise PipelineStateError(
                "call step() after each forward_backward (or pass accumulate=True to the earlier call)"
            )
        if self._ranks is not None:
            with self._ranks.failing("forward_backward"):
                return self._forward_backward(
                    *self._ranks.rows_of(input_ids, labels, attention_mask, position_ids),
                    accumulate,
                    loss_tokens,
                    ranks_step=self._ranks.step(reduce=not accumulate),
                )
        return self._forward_backward(
            input_ids, labels, attention_mask, position_ids, accumulate, loss_tokens
        )

    def _forward_backward(
        self, input_ids, labels, attention_mask, position_ids, accumulate, loss_tokens, ranks_step=None
    ) -> StepOutput:
        """``forward_backward`` on this process's batch; ``ranks_step`` (data-parallel) makes the
        counts global and hands each final gradient to the reduction (``DataParallelSteps``)."""
        if self._planner.needs_profile():  # something is "auto": measure the layers on this batch
            self._profile(input_ids, labels, attention_mask, position_ids, steps=1)
        microbatches, total = self._split(input_ids, labels, attention_mask, position_ids)
        mine = total
        if ranks_step is not None:
            total = ranks_step.global_tokens(total)
        if loss_tokens is not None and (not isinstance(loss_tokens, int) or loss_tokens < total):
            raise InputError(
                f"loss_tokens must be an int of at least this batch's {total} label tokens "
                f"(the label tokens of every batch of the optimizer step), got {loss_tokens!r}"
            )
        plan = self._planner.flow_plan(self._planner.decide(*input_ids.shape))
        eager = self._updates.eager(accumulate, self.config.optimizer_mode)
        step = self._run(microbatches, loss_tokens or total, plan, eager, mine, ranks_step)
        self.last_plan = plan
        self._planner.advance_start_device(plan)
        self._planner.observe(self._recorder.last_spans, plan, mean_tokens(microbatches))
        self._steps_run += 1
        self._grads_pending = True
        self._stepped_eagerly = eager
        # overlapped: the flags are read on the host thread (OverlappedCalls), raised by a later call
        found = None if self._calls.enabled else first_nonfinite(step.nonfinite)
        router = step.router_loss()
        if ranks_step is not None:  # one loss on every rank: the router's, weighted by tokens
            step.loss_sum, found, router_sum = ranks_step.agree(step.loss_sum, found, router * mine)
            router = router_sum / total
        if found is not None:
            if self._updates.nonfinite is None:  # the first of this optimizer step's calls decides
                self._updates.nonfinite = found
            if self._updates.stops_on(found):
                raise nonfinite_error(found, step.index, len(step.nonfinite))
        return StepOutput(step.loss_sum / total + router, total)

    def evaluate(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> StepOutput:
        """The loss of a batch on the weights the next training step would read, without
        training: held-out evaluation through the same workers.

        Runs the batch's forward and backward like ``forward_backward`` (the runtime has no
        forward-only tables yet, so an evaluation costs a training step's compute) and discards
        the gradients. It does not count as a step: the step counter, the async double buffer,
        the dropout seeds of later steps and the measured layer times are left as they were, so a
        run with evaluations trains exactly as one without. Call it between steps, not between an
        ``accumulate=True`` call and its ``step()``.
        """
        self._check_open()
        if self._grads_pending:
            raise PipelineStateError(
                "evaluate() would mix its gradients with pending ones: call step() first"
            )
        self._settle()  # an async update still reading the gradient buffers must finish
        if self._ranks is not None:
            with self._ranks.failing("evaluate"):
                return self._evaluate(
                    *self._ranks.rows_of(input_ids, labels, attention_mask, position_ids),
                    ranks_step=self._ranks.step(reduce=False),
                )
        return self._evaluate(input_ids, labels, attention_mask, position_ids)

    def _evaluate(self, input_ids, labels, attention_mask, position_ids, ranks_step=None) -> StepOutput:
        # A held-out set's short last batch runs with fewer microbatches (at most one per sample).
        planner = self._planner
        decision = for_short_batch(planner.decide(*input_ids.shape), len(input_ids), planner.num_devices)
        count = decision.num_microbatches
        microbatches, total = self._split(input_ids, labels, attention_mask, position_ids, count)
        plan = self._planner.flow_plan(decision)
        step = self._run(microbatches, total, plan, eager=False, evaluation=True)
        self.store.zero_grads()
        if ranks_step is not None:
            router = step.router_loss() * total
            (step.loss_sum, router, total) = ranks_step.sums(
                [step.loss_sum, router, total], "evaluation losses"
            )
            return StepOutput(step.loss_sum / total + router / total, int(total))
        return StepOutput(step.loss_sum / total + step.router_loss(), total)

    def step(self) -> None:
        """Complete the optimizer update for the gradients accumulated so far, then zero them."""
        self._check_open()
        self._updates.require("step")
        if not self._grads_pending:
            raise PipelineStateError("step() needs gradients: call forward_backward first")
        found = self._updates.nonfinite
        if found is not None and self._updates.stops_on(found):
            raise PipelineStateError(
                f"the step stopped on a non-finite value ({found.describe()}): call abandon_step() "
                f"to drop it, or use nan_policy='skip'"
            )
        self._updates.last_step_skipped = False
        if self.config.optimizer_mode == "async":
            # Publish into the copy this step read: the step after next reads it, while the next
            # one computes on the other copy (staleness exactly 1).
            self._calls.queue_update(publish_to=self._updates_run)
        else:
            if not self._stepped_eagerly:  # on this thread, costed as host work (virtual devices)
                ranks = self._ranks.failing("step") if self._ranks is not None else contextlib.nullcontext()
                with self.backend.host_work(), ranks:
                    self._updates.deferred_step()
            self._updates.partial = 0
        self._updates_run += 1
        self._grads_pending = False
        self._stepped_eagerly = False
        self._steps_at_update = self._steps_run

    def abandon_step(self) -> bool:
        """After a failure: drop what the unfinished optimizer step left (accumulated gradients, the
        calls counted since the last ``step()``) so that the pipeline is exactly as the last completed
        step left it, and return True; or return False, leaving everything, when part of the update
        has already been applied (an eager update that failed half-way, a failed async update):
        then no consistent state is left to save or continue from."""
        self._check_open()
        with contextlib.suppress(BaseException):
            self._settle()  # a failed async update surfaces here: it is judged by `partial`
        if self._updates.partial:
            return False
        self._updates.nonfinite = None
        self.store.zero_grads()
        self._steps_run = self._steps_at_update
        self._grads_pending = False
        self._stepped_eagerly = False
        return True

    def zero_grad(self) -> None:
        self._settle()
        self.store.zero_grads()
        self._grads_pending = False

    @property
    def _optimizer(self) -> LayerwiseAdamW | None:
        return self._updates.optimizer

    @property
    def last_step_skipped(self) -> bool:
        """The last ``step()`` found a non-finite value (``nan_policy="skip"``, or an fp16 gradient
        overflow) and skipped the update."""
        return self._updates.last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Updates skipped on non-finite values so far (kept in ``state_dict``)."""
        return self._updates.skipped_steps

    @property
    def last_nonfinite(self):
        """Where the last skipped step's first non-finite value appeared (a ``NonFinite``: what,
        layer, microbatch, device), or None."""
        return self._updates.last_nonfinite

    @property
    def last_grad_norm(self) -> float | None:
        """The gradient norm of the last clipped ``step()`` (``max_grad_norm``), before clipping."""
        return self._updates.last_grad_norm

    # ----------------------------------------------------------------- weights and checkpoints
    def export_to(self, model: nn.Module) -> None:
        """Write the trained fp32 masters into ``model`` (the wrapped HF / peft model, or a copy of it)."""
        self._settle()  # an async update still running must land first
        export_masters(self.store, model)

    def state_dict(self) -> dict:
        """fp32 masters and optimizer state keyed by parameter name (a checkpoint).

        In async mode also the compute copy the next step reads (``stale``): the weights from one
        update before the masters, which the staleness-1 contract has that step compute on. With
        an automatic choice (``"auto"`` in the config) also the profile it was made from
        (``measured``), so a resumed run makes the same choice without profiling again.
        """
        self._settle()
        sd = {
            "masters": masters_state(self.store),
            "steps_run": self._steps_run,
            "updates_run": self._updates_run,
            **self._updates.state_dict(),
        }
        measured = self._planner.measured_state()
        if measured is not None:
            sd["measured"] = measured
        if self.dp is not None and self.dp.sharded:
            sd["optimizer_shard"] = {"rank": self.dp.rank, "world_size": self.dp.world_size}
        if self.store.double_buffer:
            sd["stale"] = stale_state(self.store, self._updates_run)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        masters = sd["masters"]
        self._settle()
        load_masters(self.store, masters)
        self._steps_run = self._steps_at_update = sd.get("steps_run", 0)
        self._updates_run = sd.get("updates_run", self._steps_run)
        if self.store.double_buffer and "stale" in sd:
            load_stale(self.store, sd["stale"], self._updates_run)
        self._updates.load_state_dict(sd)
        self._planner.load_measured(sd.get("measured"))

    # ----------------------------------------------------------------- planning and measuring
    @property
    def plan(self) -> RuntimePlan:
        """What the next step runs: the policy, both partitions with per-stage estimates and the
        microbatch count, each with a line saying why (given, default, or what the automatic
        choice predicted); ``print(pipe.plan)``, ``pipe.plan.to_json()``."""
        report = self._planner.report()
        if self._ranks is not None:
            report = dataclasses.replace(report, why={**report.why, "data parallel": self._ranks.describe()})
        return report

    @property
    def layer_times(self) -> dict[str, tuple[float, float]] | None:
        """Measured (forward s, backward s) per layer and microbatch; None before ``profile``."""
        return self._planner.layer_times

    @property
    def context_time(self) -> float | None:
        """Measured seconds a worker spends building one microbatch's layer context (inputs, masks,
        rotary tables), what ``roundpipe.sim.Workload.context_s`` takes; None before ``profile``."""
        return self._planner.context_s

    @property
    def task_time(self) -> float | None:
        """Measured seconds a device idles between operations while its worker gets the next one
        going, what ``roundpipe.sim.Workload.task_s`` takes; None before ``profile``."""
        return self._planner.task_s

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
        then refreshed by a moving average during training). The automatic choices of the config's
        ``"auto"`` parts are made from these times (anew after every call; the first
        ``forward_backward`` calls it when they are not measured yet). Weights and optimizer state
        are not touched; the gradients it makes are discarded.
        """
        self._check_open()
        if self._ranks is not None:  # this rank's rows, as its steps will compute on
            input_ids, labels, attention_mask, position_ids = self._ranks.rows_of(
                input_ids, labels, attention_mask, position_ids
            )
        return self._profile(input_ids, labels, attention_mask, position_ids, steps)

    def _profile(self, input_ids, labels, attention_mask, position_ids, steps: int):
        """``profile`` on this process's batch."""
        if self._grads_pending:
            raise PipelineStateError("profile() would mix its gradients with pending ones: call step() first")
        self._settle()
        from roundpipe.runtime import profiler

        microbatches, total = self._split(input_ids, labels, attention_mask, position_ids)
        table = profiler.profiling_table(
            len(self.adapter.layers), len(self.backend.devices), len(microbatches)
        )
        self._planner.check_table_memory(table, len(microbatches), tuple(input_ids.shape))
        plan = build_flow_plan(table, fuse=False, frozen=self.store.frozen_prefix)
        per_step = []
        for _ in range(steps):
            step = self._new_step(microbatches, total, plan, eager=False)
            with self._recorder.recording():
                self._executor.run(step)
            step.router_loss()  # not reported: gives the statistics' download buffers back
            per_step.append(self._recorder.last_spans)
        self.store.zero_grads()
        spans = [span for ran in per_step for span in ran]
        times = profiler.layer_times_from_spans(spans, self._planner.names)
        self._planner.set_measured(
            times,
            mean_tokens(microbatches),
            tuple(input_ids.shape),
            context_s=profiler.context_seconds_from_spans(spans),
            task_s=profiler.task_gap_seconds_from_spans(per_step),
        )
        return dict(times)

    def stats(self) -> dict:
        """Figures of the last ``forward_backward``: per device busy (compute) time, idle (bubble)
        time within the step, bytes copied each way, the caching allocator's allocated and reserved
        peaks and figures (``allocator``), the ledger's planned peak; host-side time, the host
        memory (``host_memory``: the store and the pinned hand-off pool, reserved and in use) and the
        host syncs (``host_syncs``: how many device values the step read on the host, and where;
        None on a backend that cannot count them). docs/guide.md lists every key."""
        return self._recorder.stats()

    def last_timeline(self):
        """Every labelled piece of work of the last step: a ``roundpipe.schedule.timeline.Timeline``
        (device lanes ``compute``/``h2d``/``d2h``, and the ``host`` lane as device -1)."""
        return self._recorder.timeline(self.last_plan.table.policy if self.last_plan else self.config.policy)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._calls.settle()  # a call in flight completes (or raises) before anything closes
        finally:
            if self.dp is not None:
                self.dp.close()
            self._hostq.close()
            self.backend.close()
            self.store.close()  # unpins the host arena: only after every device has synchronized

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # ----------------------------------------------------------------- internals
    def _split(self, input_ids, labels, attention_mask, position_ids, given: int | None = None):
        def count(batch: int) -> int:  # called once input_ids is known to be [batch, seq]
            # a decision for a batch has its count (None only in a report before any batch)
            return given or cast(int, self._planner.decide(batch, input_ids.shape[1]).num_microbatches)

        return split_batch(
            input_ids,
            labels,
            attention_mask,
            position_ids,
            vocab_size=self.adapter.config.vocab_size,
            microbatch_count=count,
        )

    def _run(
        self,
        microbatches,
        total: int,
        plan: FlowPlan,
        eager: bool,
        batch_tokens: int | None = None,
        ranks_step=None,
        evaluation: bool = False,
    ) -> StepRun:
        """One forward and backward over the workers, on the compute copy of this optimizer step;
        with ``ranks_step``, the gradient reduction across ranks runs beside it and is waited for."""
        self.store.set_read_buffer(self._updates_run)
        step = self._new_step(microbatches, total, plan, eager, batch_tokens)
        step.read_buffer = self._updates_run
        if ranks_step is not None:
            ranks_step.attach(step)
        with self._recorder.recording():
            if self._calls.enabled and not evaluation:
                self._calls.run(step)
            else:
                self._executor.run(step)
            if ranks_step is not None:
                ranks_step.finish()
        return step

    def _new_step(
        self, microbatches, total: int, plan: FlowPlan, eager: bool, batch_tokens: int | None = None
    ) -> StepRun:
        """``total``: the label tokens the gradient is divided by; ``batch_tokens``: this batch's
        (the router loss's share of the step is theirs over ``total``)."""
        exchange = Exchange(lambda: self.backend.aborted)
        step = StepRun(
            self._steps_run, microbatches, total, plan, eager, exchange, self._hostq, self._updates
        )
        seed = step.grad_seed * (batch_tokens or total)
        release = self.store.host.pool.release
        step.router = RouterTotals.of_step(self.adapter, len(microbatches), seed, exchange, release)
        return step

    def _settle(self) -> None:
        """Complete the calls in flight (``overlap_calls``) and every host job."""
        self._calls.settle()
        self._hostq.drain()

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineStateError("this pipeline is closed; wrap the model again")
