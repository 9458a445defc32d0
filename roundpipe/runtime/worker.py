"""One worker per device: walks its task list and issues uploads, compute and downloads.

The worker thread only *issues* work: closures on the device's ``h2d``, ``compute`` and ``d2h``
streams, ordered by events (DESIGN.md §4). Weights are uploaded per layer into a small resident
set: the layers of the current task plus, with prefetch, those of the next task; everything else is
released (in compute-stream order) before a new upload may start, so a device never holds more than
two tasks' weights. Forward runs without autograd and leaves stage inputs on the CPU; backward
recomputes from the saved input; the head's forward and backward run back to back.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from roundpipe.backend import Device, tensor_bytes
from roundpipe.errors import StageError
from roundpipe.models.base import MicrobatchInputs
from roundpipe.runtime.exchange import HandOff, Slot
from roundpipe.runtime.plan import TaskFlow

if TYPE_CHECKING:
    from roundpipe.runtime.engine import Pipeline, StepRun


@dataclass
class Resident:
    slot: Slot  # .value: {piece (entry key, rows): device Parameter}; see store.Binding.piece
    event: object
    nbytes: int


def make_shell(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` with every parameter and buffer on the meta device."""
    memo: dict[int, object] = {}
    for p in module.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class Worker:
    def __init__(self, pipe: Pipeline, device: Device):
        self.pipe = pipe
        self.device = device
        self.streams = device.streams
        self.resident: dict[int, Resident] = {}
        self._shells: dict[int, list[tuple[nn.Module, nn.Module, str, bool, int]]] = {}
        self._context_module: Slot | None = None
        self._ctx: tuple[int, Slot, Slot] | None = None  # (microbatch, inputs slot, context slot)
        self.status = "idle"
        self.tasks_done = 0

    # ----------------------------------------------------------------- weights
    def _upload(self, layer: int) -> None:
        """Queue a layer's weights on the weights stream, cut into chunks of ``copy_chunk_bytes``
        (large tensors by rows) so that a more urgent copy is never stuck behind a whole layer."""
        store, dev = self.pipe.store, self.device
        pieces = store.layer_pieces(layer)  # whole entries, or only the rows the layer uses
        nbytes = store.layer_bytes[layer]
        name = self.pipe.adapter.layers[layer].name
        slot = Slot()
        stream, compute = self.streams["h2d_weights"], self.streams["compute"]

        def allocate():
            dev.memory.reserve(nbytes, f"weights:{name}", "weights")
            tensors = {}
            for piece in pieces:
                src = store.piece_source(piece)
                trainable = store.entries[piece[0]].trainable
                t = nn.Parameter(dev.empty(src.shape, src.dtype), requires_grad=trainable)
                dev.hand_over(t, compute)
                tensors[piece] = t
            slot.value = tensors

        stream.submit(allocate)
        chunk = self.pipe.config.copy_chunk_bytes
        for piece in pieces:
            src = store.piece_source(piece)  # for its shape; each copy reads the source when it runs
            rows = src.shape[0] if src.dim() else 1
            row_bytes = max(1, tensor_bytes(src) // max(rows, 1))
            step = max(1, chunk // row_bytes)
            for a in range(0, rows, step):
                b = min(rows, a + step)

                def copy(piece=piece, a=a, b=b):
                    data = slot.value[piece].data
                    src = store.piece_source(piece)
                    if data.dim() == 0:
                        dev.copy_in(data, src)
                    else:
                        dev.copy_in(data[a:b], src[a:b])

                stream.submit(copy, (f"W:{name}", "upload"))
        self.resident[layer] = Resident(slot, stream.record_event(), nbytes)

    def _evict(self, layer: int) -> None:
        r = self.resident.pop(layer)
        dev, name = self.device, self.pipe.adapter.layers[layer].name

        def free():
            r.slot.value = None
            dev.memory.release(r.nbytes, f"weights:{name}", "weights")

        # A prefetched layer can be released before any task used it (under ``order="ready"`` the
        # task that runs next need not be the one prefetched for): its upload may still be queued
        # on the weights stream, so the release waits for it. A no-op when compute used the layer.
        self.streams["compute"].wait_event(r.event)
        self.streams["compute"].submit(free)

    def _ensure(self, need: range, upcoming: range | None, remaining: list[TaskFlow]) -> list[Resident]:
        """Make ``need`` resident, deciding first which resident layers to release.

        Always kept: ``need`` and, with prefetch, ``upcoming`` (the next task's layers). Streaming
        tables (roundpipe) release everything else. Weight-bound tables also keep layers this device
        will run again later in the step, as long as the weight cache budget allows, releasing the
        ones needed furthest in the future first (Belady). Residency thus follows from the table
        and a budget, with no per-policy rule.
        """
        keep = set(need) | (set(upcoming) if upcoming is not None else set())
        evict = [i for i in self.resident if i not in keep]
        if self.pipe.weight_bound and evict:
            next_use: dict[int, int] = {}
            for pos, f in enumerate(remaining):
                for i in f.layers:
                    next_use.setdefault(i, pos)
            layer_bytes = self.pipe.store.layer_bytes
            held = [i for i in evict if i in next_use]
            total = sum(layer_bytes[i] for i in keep) + sum(layer_bytes[i] for i in held)
            budget = self.pipe.weight_cache_bytes
            held.sort(key=lambda i: next_use[i], reverse=True)
            while held and budget is not None and total > budget:
                total -= layer_bytes[held.pop(0)]
            evict = [i for i in evict if i not in held]
        for i in evict:
            self._evict(i)
        missing = [i for i in need if i not in self.resident]
        if evict:
            # Every later upload (needed now or prefetched) may only take memory the released layers
            # gave back, i.e. it waits until the compute that last used them is done.
            self.streams["h2d_weights"].wait_event(self.streams["compute"].record_event())
        for i in missing:
            self._upload(i)
        return [self.resident[i] for i in need]

    def _prefetch(self, layers: range) -> None:
        for i in layers:
            if i not in self.resident:
                self._upload(i)

    def release_all(self) -> None:
        for i in list(self.resident):
            self._evict(i)
        self._drop_context()

    def _bound_modules(self, layer: int, weights: dict[int, torch.Tensor]) -> nn.Module:
        """This device's shell of ``layer`` with ``weights`` bound in. Runs on the compute stream."""
        if layer not in self._shells:
            shell = make_shell(self.pipe.adapter.layers[layer].module)
            self._shells[layer] = [
                (shell, shell.get_submodule(b.module_path), b.attr, b.is_buffer, b.piece)
                for b in self.pipe.store.bindings[layer]
            ]
        bound = self._shells[layer]
        for _, mod, attr, is_buffer, piece in bound:
            (mod._buffers if is_buffer else mod._parameters)[attr] = weights[piece]
        return bound[0][0] if bound else self.pipe.adapter.layers[layer].module

    # ----------------------------------------------------------------- context
    def _ensure_context_module(self) -> Slot:
        if self._context_module is None:
            slot = Slot()
            dev, module = self.device, self.pipe.adapter.context_module

            def upload():
                m = make_shell(module)
                for sub_name, sub in module.named_modules():
                    target = m.get_submodule(sub_name)
                    for n, b in sub._buffers.items():
                        if b is not None:
                            target._buffers[n] = dev.to_device(b)
                    for n, p in sub._parameters.items():
                        if p is not None:
                            target._parameters[n] = nn.Parameter(
                                dev.to_device(p.detach()), requires_grad=False
                            )
                slot.value = m

            self.streams["h2d"].submit(upload)
            self.streams["compute"].wait_event(self.streams["h2d"].record_event())
            self._context_module = slot
        return self._context_module

    def _context(self, step: StepRun, mb: int) -> tuple[Slot, Slot]:
        if self._ctx is not None and self._ctx[0] == mb:
            return self._ctx[1], self._ctx[2]
        self._drop_context()
        module = self._ensure_context_module()
        dev, adapter, dtype = self.device, self.pipe.adapter, self.pipe.store.dtype
        host_inputs = step.microbatches[mb]
        inputs, ctx = Slot(), Slot()

        def upload():
            inputs.value = MicrobatchInputs(
                *(
                    None if t is None else dev.to_device(t)
                    for t in (getattr(host_inputs, f.name) for f in dataclasses.fields(host_inputs))
                )
            )

        def build():
            c = adapter.build_context(module.value, inputs.value, dtype)
            c.head_chunk_tokens = self.pipe.config.head_chunk_tokens
            ctx.value = c

        self.streams["h2d"].submit(upload)
        self.streams["compute"].wait_event(self.streams["h2d"].record_event())
        self.streams["compute"].submit(build, (f"ctx.{mb}", "context"))
        self._ctx = (mb, inputs, ctx)
        return inputs, ctx

    def _drop_context(self) -> None:
        if self._ctx is not None:
            _, inputs, ctx = self._ctx

            def free():
                inputs.value = None
                ctx.value = None

            self.streams["compute"].submit(free)
            self._ctx = None

    # ----------------------------------------------------------------- tasks
    def run(self, step: StepRun, flows: list[TaskFlow]) -> None:
        """Issue every task of this device for one step (worker thread).

        ``order="strict"`` issues the table's order; ``order="ready"`` issues the first task in
        table order whose incoming hand-offs have all been issued by their producers (the table is
        a hint, readiness decides), so an order that would deadlock strictly still completes.
        """
        remaining = list(flows)
        self._computed: list = []  # compute-done event of each issued task, in issue order
        self._downloaded: list = []  # downloads-done event of each issued task
        self._acc: Slot | None = None  # open weight-gradient accumulator (see _accumulator)
        self._acc_range, self._acc_count = range(0), 0
        ready = self.pipe.config.order == "ready"
        while remaining:
            flow = remaining.pop(self._pick_ready(step, remaining) if ready else 0)
            upcoming = None
            if self.pipe.config.prefetch:
                upcoming = next((f.layers for f in remaining if f.layers != flow.layers), None)
            self._issue(step, flow, upcoming, remaining)
            self.tasks_done += 1
        self.flush_grads(step)
        self.release_all()
        self.status = "done"

    def _pick_ready(self, step: StepRun, remaining: list[TaskFlow]) -> int:
        while True:
            for n, f in enumerate(remaining):
                if all(step.exchange.has(k) for k in f.consumes):
                    return n
            self.status = "ready order: no task ready; waiting for " + ", ".join(
                f"{f.task}" for f in remaining[:4]
            )
            step.exchange.wait_for_change()

    def _issue(
        self, step: StepRun, flow: TaskFlow, upcoming: range | None, remaining: list[TaskFlow]
    ) -> None:
        dev, streams = self.device, self.streams
        t, mb = flow.task, flow.task.microbatch
        label = f"{t}" + (f"+{flow.fused_with}" if flow.fused_with else "")
        self.status = f"{label}: preparing"
        needs_grad = len(flow.layers_bwd) > 0 and self._backward_needed(flow)
        layers_all = flow.layers
        if len(layers_all) == 0 or (flow.task.kind == "B" and not needs_grad):
            self._issue_empty(step, flow)
            return
        residents = self._ensure(layers_all, upcoming, remaining)
        inputs, ctx = self._context(step, mb)

        # At most two tasks in flight per device: the inputs of this task may only arrive once the
        # compute two tasks back is done, and this compute may only start once the downloads two
        # tasks back are done; otherwise the copy streams run ahead and device memory grows with the
        # number of microbatches.
        if len(self._computed) >= 2:
            streams["h2d"].wait_event(self._computed[-2])
        if len(self._downloaded) >= 2:
            streams["compute"].wait_event(self._downloaded[-2])

        # Incoming hand-offs (activation and/or gradient), uploaded on h2d in that order.
        incoming: dict[tuple, Slot] = {}
        for key in flow.consumes:
            self.status = f"{label}: waiting for {key[0]}[{key[1]}] of microbatch {key[2]}"
            host_slot, event = step.exchange.get(key)
            dev_slot = Slot()
            if event is not None:
                streams["h2d"].wait_event(event)

            def up(host_slot=host_slot, dev_slot=dev_slot, key=key):
                t_host = host_slot.value
                dev.memory.reserve(tensor_bytes(t_host), f"{key[0]}[{key[1]}].{key[2]}", "activations")
                dev_slot.value = dev.to_device(t_host)
                host_slot.take()

            streams["h2d"].submit(up, (f"{key[0]}[{key[1]}].{key[2]}", "upload"))
            incoming[key] = dev_slot
        streams["compute"].wait_event(streams["h2d"].record_event())
        for r in residents:
            streams["compute"].wait_event(r.event)
        if upcoming is not None:
            self._prefetch(upcoming)

        produced = {key: Slot() for key in flow.produces}
        param_grads = self._accumulator(step, flow) if flow.layers_bwd else Slot()
        loss_slot = Slot()
        self.status = f"{label}: issued"

        def compute():
            self._compute(
                step, flow, residents, inputs.value, ctx.value, incoming, produced, param_grads, loss_slot
            )

        kind = "FB" if flow.fused_with else t.kind
        streams["compute"].submit(compute, (label, kind))
        computed = streams["compute"].record_event()
        self._computed.append(computed)
        streams["d2h"].wait_event(computed)
        host_out = {
            key: HandOff(step.flow_plan.consumers[key], self.pipe.host_memory, f"{key[0]}[{key[1]}].{key[2]}")
            for key in produced
        }
        host_loss = Slot()

        def download():
            try:
                for key, s in produced.items():
                    v = s.value
                    host_out[key].fill(dev.to_host(v))
                    s.value = None
                    dev.memory.release(tensor_bytes(v), f"{key[0]}[{key[1]}].{key[2]}", "activations")
                if loss_slot.value is not None:
                    host_loss.value = dev.to_host(loss_slot.value)
            except BaseException as e:
                raise StageError(f"download after {label} failed: {e}", task=label, device=dev.name) from e

        streams["d2h"].submit(download, (f"out:{label}", "download"))
        done = streams["d2h"].record_event()
        self._downloaded.append(done)
        for key, s in host_out.items():
            step.exchange.put(key, s, done, step.flow_plan.consumers[key])
        if flow.layers_bwd and flow.layers_bwd.stop == self.pipe.store_num_layers:
            step.on_loss(host_loss, done)
        if flow.layers_bwd:
            self._acc_count += 1
            # Keep summing while this device's next backward is over the same layers (forwards in
            # between, as in 1F1B rows, do not touch the accumulator).
            nxt = next((f for f in remaining if f.layers_bwd), None)
            if nxt is None or nxt.layers_bwd != flow.layers_bwd:
                self.flush_grads(step)

    def _accumulator(self, step: StepRun, flow: TaskFlow) -> Slot:
        """The device-side fp32 sum of this backward stage's weight gradients.

        Consecutive backward tasks of one stage on a device (roundpipe runs a stage for every
        microbatch in a row) add into it, and it goes down to the CPU once, when the device moves
        on: M times fewer gradient downloads and host additions than one per microbatch.
        """
        if self._acc is not None and self._acc_range != flow.layers_bwd:
            self.flush_grads(step)
        if self._acc is None:
            self._acc, self._acc_range, self._acc_count = Slot({}), flow.layers_bwd, 0
        return self._acc

    def flush_grads(self, step: StepRun) -> None:
        """Download the open accumulator and hand it to the host thread (worker thread): a dict
        ``{(entry key, rows or None): fp32 gradient of those rows}``."""
        if self._acc is None:
            return
        acc, layers, count = self._acc, self._acc_range, self._acc_count
        self._acc = None
        dev, streams = self.device, self.streams
        host_grads = Slot()

        def download():
            grads = acc.value
            host_grads.value = {k: dev.to_host(g) for k, g in grads.items()}
            dev.memory.release(sum(tensor_bytes(g) for g in grads.values()), f"grads:{layers}", "grads")
            acc.value = None

        grads_stream = streams["d2h_grads"]
        grads_stream.wait_event(streams["compute"].record_event())
        grads_stream.submit(download, (f"grads:{self.pipe.adapter.layers[layers.start].name}", "download"))
        step.on_grads(layers, host_grads, count, grads_stream.record_event())

    def _issue_empty(self, step: StepRun, flow: TaskFlow) -> None:
        """A task with nothing to compute (the backward of a frozen embedding, a forward whose
        outputs nobody needs): take its hand-offs so they are freed, and account a backward."""
        for key in flow.consumes:
            host_slot, event = step.exchange.get(key)
            if event is not None:
                self.streams["h2d"].wait_event(event)
            self.streams["h2d"].submit(host_slot.take)
        if flow.task.kind == "B":
            step.on_grads(flow.layers_bwd, Slot(), 1, None)

    def _backward_needed(self, flow: TaskFlow) -> bool:
        r = flow.layers_bwd
        return r.start > 0 or bool(self.pipe.store.trainable_keys(r)) or flow.fused_with is not None

    # ----------------------------------------------------------------- compute (compute stream)
    def _compute(
        self, step, flow, residents, inputs, ctx, incoming, produced, param_grads, loss_slot
    ) -> None:
        pipe, dev = self.pipe, self.device
        t = flow.task
        layer_name = None
        weights: dict[int, torch.Tensor] = {}
        for r in residents:
            weights.update(r.slot.value)
        dev.memory.mark(f"compute {t}")
        try:
            start = flow.layers.start
            if start == 0:
                x = inputs.input_ids
            else:
                x = incoming[("act", start, t.microbatch)].value
            in_bytes = 0 if start == 0 else tensor_bytes(x)
            with torch.no_grad():
                for i in flow.layers_fwd:
                    layer_name = pipe.adapter.layers[i].name
                    x = self._run_layer(step, i, weights, x, ctx, t.microbatch)
                    key = ("act", i + 1, t.microbatch)
                    if key in produced:
                        dev.memory.reserve(tensor_bytes(x), f"act[{i + 1}].{t.microbatch}", "activations")
                        produced[key].value = x
            if flow.layers_bwd:
                layer_name = None
                self._backward(step, flow, weights, x, ctx, incoming, produced, param_grads, loss_slot)
            if in_bytes:
                dev.memory.release(in_bytes, f"act[{start}].{t.microbatch}", "activations")
            for key, s in incoming.items():
                if key[0] == "grad":
                    dev.memory.release(tensor_bytes(s.value), f"grad[{key[1]}].{key[2]}", "activations")
                s.value = None
        except StageError:
            raise
        except BaseException as e:
            stage = t.stage
            raise StageError(
                f"{type(e).__name__} in {t.kind} of stage {stage}: {e}",
                task=str(t) + (f"+{flow.fused_with}" if flow.fused_with else ""),
                stage=stage,
                layer=layer_name,
                microbatch=t.microbatch,
                device=dev.name,
            ) from e

    def _run_layer(self, step, i: int, weights, x, ctx, mb: int):
        layer = self.pipe.adapter.layers[i]
        module = self._bound_modules(i, weights)
        if i in self.pipe.random_layers:
            with self.device.seeded(_seed(self.pipe.config.seed, step.index, i, mb)):
                return layer.forward(module, x, ctx)
        return layer.forward(module, x, ctx)

    def _backward(self, step, flow, weights, x, ctx, incoming, produced, param_grads, loss_slot) -> None:
        pipe, dev = self.pipe, self.device
        t = flow.task
        mb = t.microbatch
        r = flow.layers_bwd
        grad_in = r.start > 0
        if grad_in:
            x = x.detach().requires_grad_(True)
        x0 = x
        pieces = pipe.store.trainable_pieces(r)
        params = [weights[p] for p in pieces]
        with torch.enable_grad():
            y = x
            for i in r:
                y = self._run_layer_named(step, i, weights, y, ctx, mb, t)
            if r.stop == pipe.store_num_layers:
                loss_slot.value = y.detach()
                seed = torch.tensor(step.grad_seed, dtype=y.dtype, device=y.device)
            else:
                seed = incoming[("grad", r.stop, mb)].value
            inputs = ([x0] if grad_in else []) + params
            grads = torch.autograd.grad([y], inputs, grad_outputs=[seed], allow_unused=True) if inputs else []
        if grad_in:
            gx = grads[0]
            dev.memory.reserve(tensor_bytes(gx), f"grad[{r.start}].{mb}", "activations")
            produced[("grad", r.start, mb)].value = gx
            grads = grads[1:]
        # The open accumulator of this stage's weight gradients (fp32), keyed by piece: a shard's
        # gradient covers only its rows.
        acc = param_grads.value
        for p, g in zip(pieces, grads):
            if g is None:
                continue
            if p in acc:
                acc[p].add_(g)
            else:
                acc[p] = g if g.dtype == torch.float32 else g.to(torch.float32)
                dev.memory.reserve(tensor_bytes(acc[p]), f"grads:{t.stage}", "grads")

    def _run_layer_named(self, step, i, weights, x, ctx, mb, t):
        try:
            return self._run_layer(step, i, weights, x, ctx, mb)
        except BaseException as e:
            if isinstance(e, StageError):
                raise
            raise StageError(
                f"{type(e).__name__} in {t.kind} of stage {t.stage}: {e}",
                task=str(t),
                stage=t.stage,
                layer=self.pipe.adapter.layers[i].name,
                microbatch=mb,
                device=self.device.name,
            ) from e


def _seed(base: int, step: int, layer: int, mb: int) -> int:
    digest = hashlib.blake2b(f"{base}/{step}/{layer}/{mb}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
