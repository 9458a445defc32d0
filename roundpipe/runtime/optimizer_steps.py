"""When and how the optimizer steps each layer: eagerly as gradients become final, or deferred.

With the synchronous optimizer and nothing that needs every gradient first, the host thread steps
a layer's group the moment its last gradient contribution lands (``StepRun`` calls
``step_group``), overlapping the backward of lower layers. Gradient clipping and fp16 loss scaling
need the whole gradient, so those runs defer every step to ``deferred_step`` (``Pipeline.step``,
or the host queue under ``optimizer_mode="async"``), and so does ``nan_policy="skip"``: a step is
dropped whole when a non-finite value was found (``runtime/numerics.py``), so no layer may be
stepped before every layer's gradient is known to be finite. Either way the steps themselves run on the
host thread or the caller's thread, never on a worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from roundpipe.distributed.updates import RankUpdates
from roundpipe.errors import OptimizerError, PipelineStateError
from roundpipe.optim import DynamicLossScaler, LayerwiseAdamW, OptimizerConfig, clip_factor
from roundpipe.runtime.hostqueue import HostQueue
from roundpipe.runtime.numerics import NonFinite
from roundpipe.runtime.report import Recorder
from roundpipe.runtime.store import ParameterStore
from roundpipe.testing import faults

# The most fp32 master bytes one host job of an async update steps: a group (a layer) is cut into
# runs of its parameters up to this size, a larger parameter alone, so that a gradient addition into
# the group waits for the part running when it arrives, not for the whole layer (a Qwen3-32B layer:
# ~125 ms of update, its largest parameter ~33 ms, on the preset host).
UPDATE_PART_BYTES = 256 << 20


def grads_of(owner: int) -> tuple[str, int]:
    """What a host job touches when it reads or writes the gradients of ``owner``'s group."""
    return ("grads", owner)


class OptimizerSteps:
    """The optimizer (None until configured), the fp16 loss scaler, and what the last step did.

    ``store`` holds the fp32 gradient buffers and masters it steps; ``names`` the layer names (for
    errors and host spans); ``recorder`` times each step on the host lane.

    ``last_step_skipped``: the last deferred step found a non-finite value and skipped
    (``last_nonfinite`` says where; ``skipped_steps`` counts them, checkpointed);
    ``nonfinite``: the first non-finite value found since the last update (``Pipeline`` sets it);
    ``last_grad_norm``: the unscaled gradient norm of the last clipped step; ``partial``: layer
    groups stepped since the last update completed (``Pipeline.step`` resets it): nonzero after a
    failure in the middle of an update, when some layers hold the new weights and some the old.
    """

    def __init__(
        self,
        store: ParameterStore,
        names: list[str],
        recorder: Recorder,
        loss_scaling: bool,
        nan_policy: str = "stop",
    ):
        self.store = store
        self.nan_policy = nan_policy
        self.nonfinite: NonFinite | None = None
        self.last_nonfinite: NonFinite | None = None
        self.skipped_steps = 0
        self.names = names
        self.recorder = recorder
        self.optimizer: LayerwiseAdamW | None = None
        self.scaler = DynamicLossScaler() if loss_scaling else None
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None
        self.partial = 0  # groups stepped since the last complete update (see Pipeline.abandon_step)
        # Data-parallel: the groups this rank steps and its agreements with the others
        # (roundpipe.distributed.updates.RankUpdates); None in a single process.
        self.ranks: RankUpdates | None = None

    def configure(self, config: OptimizerConfig) -> None:
        self.optimizer = LayerwiseAdamW(self.store, config)

    def require(self, what: str) -> LayerwiseAdamW:
        """The optimizer; PipelineStateError naming ``what`` when none is configured."""
        if self.optimizer is None:
            raise PipelineStateError(f"{what}() needs an optimizer: call configure_optimizer(lr=...) first")
        return self.optimizer

    def groups(self) -> dict[int, list[int]]:
        """Step groups: owner layer -> keys of the trainable entries stepped together."""
        if self.optimizer is not None:
            return self.optimizer.groups
        groups: dict[int, list[int]] = {}
        for e in self.store.entries:
            if e.trainable:
                groups.setdefault(e.owner, []).append(e.key)
        return groups

    def eager(self, accumulate: bool, mode: str) -> bool:
        """Whether this ``forward_backward`` steps each layer as soon as its gradient is final."""
        return (
            self.optimizer is not None
            and not accumulate
            and mode == "sync"
            and self.optimizer.config.max_grad_norm is None
            and self.scaler is None
            and self.nan_policy != "skip"
        )

    def stops_on(self, found: NonFinite) -> bool:
        """Whether ``found`` stops the run: under "stop", except a gradient overflow in fp16,
        which loss scaling expects (the step is skipped and the scale lowered)."""
        return self.nan_policy == "stop" and not (self.scaler is not None and found.what == "gradient")

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def step_group(
        self, owner: int, factor: float = 1.0, publish_to: int | None = None, part: list[int] | None = None
    ) -> None:
        """Step one layer's group, or ``part`` of its entries (host or caller's thread); errors name
        the layer."""
        name = self.names[owner]
        try:
            if part is None or part[0] == self.require("step").groups[owner][0]:  # once a group
                faults.point("optimizer", layer=name)
            self.partial += 1  # counted before: a failure inside may have updated part of the group
            with self.recorder.host_span(f"optim:{name}", "optim"):
                self.require("step").step_group(owner, factor, publish_to, part)
        except BaseException as e:
            raise OptimizerError(
                f"{type(e).__name__} while stepping layer {name}: {e}", layer=name, device="host"
            ) from e

    def deferred_step(self, publish_to: int | None = None) -> None:
        """Step every group with the whole gradient known: unscale, skip on overflow, clip."""
        factor = self.prepare_step()
        if factor is None:
            return
        for owner in self.step_order():
            self.step_group(owner, factor, publish_to)
        if self.ranks is not None:
            self.ranks.publish()

    def queue_update(self, hostq: HostQueue, publish_to: int, written: threading.Event | None = None) -> None:
        """``optimizer_mode="async"``: queue the update on the host thread, where it runs while the
        next step computes. One job for what needs the whole gradient (finiteness, the loss scale,
        the norm: no job passes it), then one background job per group, each touching that group's
        gradients only, so the next step's additions into other groups pass it (a worker waits for
        its additions); the last job ends the update (``partial``) and sets ``written``.
        Data-parallel: one job, so the agreements with the other ranks keep their order."""

        def ended() -> None:
            self.partial = 0
            if written is not None:
                written.set()

        if self.ranks is not None:

            def update() -> None:
                self.deferred_step(publish_to)
                ended()

            hostq.submit(update)
            return
        decided: dict[str, float | None] = {}

        def prepare() -> None:
            decided["factor"] = self.prepare_step()

        def step(owner: int, part: list[int]) -> Callable[[], None]:
            def run() -> None:
                factor = decided["factor"]
                if factor is not None:
                    self.step_group(owner, factor, publish_to, part)

            return run

        hostq.submit(prepare, background=True)
        for owner in self.step_order():
            for part in self.update_parts(owner):
                hostq.submit(step(owner, part), touches=[grads_of(owner)], background=True)
        hostq.submit(ended, touches=(), background=True)  # background jobs keep their order

    def update_parts(self, owner: int) -> list[list[int]]:
        """``owner``'s group cut into runs of its entries of at most ``UPDATE_PART_BYTES`` of fp32
        masters each (an entry larger than that alone): the host jobs of an async update."""
        parts: list[list[int]] = [[]]
        size = 0
        for k in self.require("step").groups[owner]:
            n = 4 * self.store.entries[k].tensor.numel()
            if parts[-1] and size + n > UPDATE_PART_BYTES:
                parts.append([])
                size = 0
            parts[-1].append(k)
            size += n
        return parts

    def step_order(self) -> list[int]:
        """The groups a deferred step steps, in the order the next step's backward adds into them:
        from the last layer down, each layer's owners (a tied head's weight is the embedding's)."""
        held = None if self.ranks is None else self.ranks.held
        groups = self.require("step").groups if held is None else held
        order: dict[int, None] = {}
        for layer in reversed(range(len(self.names))):
            for k in self.store.trainable_keys(range(layer, layer + 1)):
                owner = self.store.entries[k].owner
                if owner in groups:
                    order.setdefault(owner)
        return list(order) + sorted(set(groups) - set(order), reverse=True)

    def prepare_step(self) -> float | None:
        """What a deferred step does before stepping groups: unscale, skip on a non-finite value,
        clip; the factor to step every group with, or None when the step is skipped."""
        factor = 1.0 / self.loss_scale()
        found, self.nonfinite = self.nonfinite, None  # data-parallel: already agreed by every rank
        held = None if self.ranks is None else self.ranks.held
        if self.scaler is not None:
            grads_finite = self.require("step").grads_finite(held)
            if self.ranks is not None:
                grads_finite = self.ranks.all_finite(grads_finite)
            finite = found is None and grads_finite
            self.scaler.update(not finite)
        else:
            finite = found is None
        if not finite:
            self.store.zero_grads()
            self.last_step_skipped, self.last_nonfinite = True, found
            self.skipped_steps += 1
            return None
        optimizer = self.require("step")
        if optimizer.config.max_grad_norm is not None:
            norm_sq = optimizer.grad_norm_sq(held)
            if self.ranks is not None:
                norm_sq = self.ranks.norm_sq(norm_sq)
            norm = (norm_sq**0.5) * factor
            self.last_grad_norm = norm
            factor *= clip_factor(norm, optimizer.config.max_grad_norm)
        return factor

    def state_dict(self) -> dict:
        """The optimizer's and the loss scaler's state, where there is one."""
        sd: dict[str, Any] = {"skipped_steps": self.skipped_steps}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        if "optimizer" in sd and self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"], None if self.ranks is None else self.ranks.held)
        if "loss_scaler" in sd and self.scaler is not None:
            self.scaler.load_state_dict(sd["loss_scaler"])
