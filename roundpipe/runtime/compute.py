"""A task's compute on the device's compute stream: its layers' forwards, then its backward.

Forward runs without autograd and leaves what later stages need in the task's produced slots;
backward recomputes its stage's forward from the saved input (with the same random draws: each
training-mode layer runs in ``Device.seeded`` by step, layer, microbatch and rank, see
``models/random_draws.py``) and runs autograd on it, moving each weight gradient into the
stage's open accumulator as soon as autograd has it (``gradients.into_accumulator``). The head's
forward and backward run back to back in one task. Whatever the compute leaves on the device is
reserved in the device's ledger here and freed after its download (``transfers.TaskOutputs``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roundpipe.backend import Device
from roundpipe.models.parametrized import confined_cache
from roundpipe.runtime.exchange import Slot
from roundpipe.runtime.gradients import into_accumulator
from roundpipe.runtime.mlp_chunks import chunked_mlp
from roundpipe.runtime.numerics import TaskChecks
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.residency import Resident
from roundpipe.runtime.router_totals import router_pairs
from roundpipe.runtime.shells import LayerShells
from roundpipe.runtime.task_errors import failing_as_task
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.testing import faults

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun


@dataclass
class TaskSlots:
    """What one task's compute reads and fills: the slots its worker made when it issued it.

    ``incoming``: the hand-offs uploaded for it; ``produced``: the hand-offs it makes, keyed as in
    the exchange; ``param_grads``: its stage's open fp32 weight-gradient accumulator (an empty
    slot for a forward); ``loss``, ``stats`` (the router statistics it computes, see
    ``router_totals.py``) and ``checks_flags`` (its packed finiteness ``checks``): what it leaves
    for the download after it.
    """

    incoming: dict[tuple, Slot]
    produced: dict[tuple, Slot]
    param_grads: Slot
    checks: TaskChecks
    loss: Slot = field(default_factory=Slot)
    stats: Slot = field(default_factory=Slot)
    checks_flags: Slot = field(default_factory=Slot)

    def all(self) -> list[Slot]:
        return [
            *self.incoming.values(),
            *self.produced.values(),
            self.param_grads,
            self.loss,
            self.stats,
            self.checks_flags,
        ]


def _failed_in(t) -> Callable[[BaseException], str]:
    return lambda e: f"{type(e).__name__} in {t.kind} of stage {t.stage}: {e}"


class TaskCompute:
    """Runs one device's tasks on its compute stream (each call is one closure's body)."""

    def __init__(self, setup: WorkerSetup, device: Device, shells: LayerShells):
        self.setup = setup
        self.device = device
        self.shells = shells

    def run(
        self,
        step: StepRun,
        flow: TaskFlow,
        residents: list[Resident],
        inputs,
        ctx,
        slots: TaskSlots,
        say: Callable[[str], None],
    ) -> None:
        """The task ``flow`` on the weights of ``residents``, the microbatch's ``inputs`` and layer
        context ``ctx``; ``say``: the worker's status (a wait for the router statistics)."""
        dev = self.device
        t = flow.task
        checks = slots.checks
        weights: dict[int, torch.Tensor] = {}
        for r in residents:
            weights.update(r.slot.value)
        dev.ledger.mark(f"compute {t}")
        where = dict(
            task=str(t) + (f"+{flow.fused_with}" if flow.fused_with else ""),
            stage=t.stage,
            layer=None,
            microbatch=t.microbatch,
            step=step.index,
        )

        def oom_note() -> str:
            return (
                f"while running {t} (layer {where['layer']}, microbatch {t.microbatch}) of step "
                f"{step.index} under the {step.flow_plan.table.policy} plan of "
                f"{step.flow_plan.table.num_microbatches} microbatches; see pipe.plan"
            )

        try:
            with failing_as_task(dev, _failed_in(t), where, oom_note):
                start = flow.layers.start
                x = inputs.input_ids if start == 0 else slots.incoming[("act", start, t.microbatch)].value
                stats: list[torch.Tensor] = []  # router statistics, in router_pairs order
                with torch.no_grad():
                    for i in flow.layers_fwd:
                        where["layer"] = self.setup.adapter.layers[i].name
                        x = self._run_layer(step, i, weights, x, ctx, t.microbatch, checks)
                        self.shells.unbind(range(i, i + 1))  # no graph: its weights can go now
                        got = ctx.router_logits.pop(i, None)
                        if got:
                            stats.append(step.router_totals().loss.stats(got, ctx.inputs.attention_mask))
                        del got
                        key = ("act", i + 1, t.microbatch)
                        if key in slots.produced:
                            self._produce(slots.produced[key], x, f"act[{i + 1}].{t.microbatch}")
                if flow.layers_bwd:
                    where["layer"] = None
                    self._backward(step, flow, weights, x, ctx, slots, stats, say)
                del x
                if stats:
                    packed = torch.stack(stats)
                    stats.clear()
                    self._produce(slots.stats, packed, f"router.{t.microbatch}")
                    del packed
                flags = checks.packed()
                if flags is not None:
                    self._produce(slots.checks_flags, flags, f"checks.{t.microbatch}")
                del flags
        finally:
            checks.flags.clear()  # a failed task's flags are device tensors too (packed() clears them otherwise)
            self.shells.unbind(flow.layers)

    def _produce(self, slot: Slot, t: torch.Tensor, what: str) -> None:
        """Leave ``t`` for a download: reserve it (compute stream); ``TaskOutputs.drop`` frees it
        on compute once the download is done."""
        self.device.ledger.reserve(t, what, "activations")
        slot.value = t

    def _run_layer(self, step, i: int, weights, x, ctx, mb: int, checks: TaskChecks | None):
        """Layer ``i``'s forward; ``checks``: where to note whether its output is finite (None for a
        recompute: the first forward noted it)."""
        layer = self.setup.adapter.layers[i]
        poison = faults.point(
            "forward", step=step.index, layer=layer.name, microbatch=mb, device=self.device.name
        )
        module = self.shells.bind(i, weights)
        chunk = self.setup.config.mlp_chunk_tokens if layer.kind == "block" else None
        with confined_cache(module) if i in self.setup.parametrized_layers else chunked_mlp(module, chunk):
            if i in self.setup.random_layers:  # every training-mode layer; ranks draw their own
                seed = draw_seed(self.setup.config.seed, step.index, i, mb, self.setup.rank)
                with self.device.seeded(seed):
                    y = layer.forward(module, x, ctx)
            else:
                y = layer.forward(module, x, ctx)
        if poison:
            y = y * float("nan")
        if checks is not None:
            checks.output(i, y)
        return y

    def _backward(self, step, flow, weights, x, ctx, slots: TaskSlots, stats, say) -> None:
        setup, dev = self.setup, self.device
        t = flow.task
        mb = t.microbatch
        r = flow.layers_bwd
        produced, checks = slots.produced, slots.checks
        grad_in = ("grad", r.start, mb) in produced  # someone below needs the input's gradient
        if grad_in:
            x = x.detach().requires_grad_(True)
        x0 = x
        pieces = setup.store.trainable_pieces(r)
        params = [weights[p] for p in pieces]
        acc = slots.param_grads.value  # this stage's open fp32 accumulator, keyed by piece
        made: list = []
        # Each parameter's gradient goes into the accumulator as soon as autograd has it (and is then
        # dropped), instead of all of a stage's fresh gradients living at once beside the accumulator.
        entries = setup.store.entries
        hooks = [
            param.register_post_accumulate_grad_hook(
                into_accumulator(
                    acc, p, made, checks, max(u for u in entries[p[0]].users if u in r), entries[p[0]].name
                )
            )
            for p, param in zip(pieces, params)
        ]
        first = checks if flow.first_forward else None  # a recompute's outputs were checked by its F
        try:
            routed: list = []  # router logits of this stage's layers (with their graph)
            with torch.enable_grad():
                y = x
                for i in r:
                    where = dict(
                        task=str(t),
                        stage=t.stage,
                        layer=setup.adapter.layers[i].name,
                        microbatch=mb,
                        step=step.index,
                    )
                    with failing_as_task(dev, _failed_in(t), where):
                        y = self._run_layer(step, i, weights, y, ctx, mb, first)
                    got = ctx.router_logits.pop(i, None)
                    if got:
                        routed.append(got)
                        if flow.first_forward:
                            stats.append(step.router_totals().loss.stats(got, ctx.inputs.attention_mask))
                    del got
                if r.stop == setup.num_layers:
                    self._produce(slots.loss, y.detach(), f"loss.{mb}")
                    seed = y.new_full(y.shape, step.grad_seed)  # a fill kernel: no host-to-device copy
                else:
                    seed = slots.incoming[("grad", r.stop, mb)].value
                outputs, seeds = [y], [seed]
                if routed:  # this stage's share of the load-balancing loss, on the batch's totals
                    term = self._router_term(step, flow, routed, stats, ctx, say)
                    outputs.append(term)
                    seeds.append(term.new_full((), step.router_totals().seed))
                    del term
                routed.clear()
                wrt = ([x0] if grad_in else []) + params
                if faults.point(
                    "backward",
                    step=step.index,
                    layer=setup.adapter.layers[r.start].name,
                    microbatch=mb,
                    device=dev.name,
                ):
                    seeds = [s * float("nan") for s in seeds]
                # An output none of ``wrt`` reaches has no graph: none of this stage's parameters
                # is in it (a LoRA on a module whose weight the model reads directly, or peft's
                # module_dropout skipping every adapter of a frozen stage this microbatch) and
                # nothing is handed down. Autograd would refuse it; plain PyTorch's backward of the
                # whole model just leaves those parameters' .grad None (``requires_grad``: no host
                # sync).
                differentiable = [(o, s) for o, s in zip(outputs, seeds) if o.requires_grad]
                if wrt and differentiable:
                    torch.autograd.backward(
                        [o for o, _ in differentiable],
                        grad_tensors=[s for _, s in differentiable],
                        inputs=wrt,
                    )
                del differentiable
                del outputs, seeds
        finally:
            for h in hooks:
                h.remove()
        del y, seed, x
        if grad_in:
            gx, x0.grad = x0.grad, None
            self._produce(produced[("grad", r.start, mb)], gx, f"grad[{r.start}].{mb}")
        for p in made:
            dev.ledger.reserve(acc[p], f"grads:{range(r.start, r.stop)}", "grads")

    def _router_term(self, step, flow, routed, stats, ctx, say) -> torch.Tensor:
        """The differentiable ``coef * aux`` share of the routers in ``routed`` (compute stream):
        the batch's totals are every other op's statistics (waited for on the host, then uploaded)
        plus this op's own."""
        rl = step.router_totals().loss
        own = set(router_pairs(self.setup.adapter, flow))
        say(f"{flow.task}: waiting for the router statistics of the batch")
        with self.device.waiting():
            others = step.router_totals().totals(own, lambda: self.setup.backend.aborted)
        totals = self.device.to_device(others)
        if stats:
            totals = totals + torch.stack(stats).sum(0)
        weights = rl.weights(totals)
        mask = ctx.inputs.attention_mask
        terms = [rl.term(got, mask, weights) for got in routed]
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def draw_seed(base: int, step: int, layer: int, mb: int, rank: int | None = None) -> int:
    """The seed of layer ``layer``'s random draws in microbatch ``mb`` of step ``step`` (``base``:
    ``RunConfig.seed``; ``rank``: the data-parallel rank, None alone): a hash of these only, so a
    recompute, another device count or another thread draws the same."""
    key = f"{base}/{step}/{layer}/{mb}" + ("" if rank is None else f"/rank{rank}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
