"""One worker per device: walks its task list and issues uploads, compute and downloads.

The worker thread only *issues* work: closures on the device's streams, ordered by events
(docs/design.md §4). Weights come and go through the device's ``WeightResidency`` (current stage
plus, with prefetch, the next one). Forward runs without autograd and leaves stage inputs on the
CPU; backward recomputes from the saved input; the head's forward and backward run back to back.

CUDA's rules (docs/design.md §5) shape every closure here: a tensor made on one stream and used on
another is handed over to it (``Device.hand_over``); whatever a closure leaves on the device is
reserved in the device's ledger and released, in stream order, after its last use; module shells
are unbound after each compute so they keep no weights alive; and the worker waits on the host for
the compute ``ISSUE_AHEAD`` tasks back before it issues another task, so that on CUDA, where a closure runs at
issue time, the memory allocated ahead of the GPU stays bounded.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from roundpipe.backend import Device
from roundpipe.backend.base import as_device_error
from roundpipe.errors import DeviceOutOfMemory, RoundpipeError, StageError
from roundpipe.models.base import MicrobatchInputs
from roundpipe.models.mask_facts import host_all_ones
from roundpipe.runtime.exchange import AbortedWait, HandOff, Slot
from roundpipe.runtime.numerics import TaskChecks
from roundpipe.runtime.plan import TaskFlow
from roundpipe.runtime.residency import Resident, WeightResidency
from roundpipe.runtime.worker_setup import WorkerSetup
from roundpipe.testing import faults

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun

# How many tasks back the compute must have finished before a worker issues the next task. The
# streams already keep two tasks in flight; one more issued ahead lets a consumer on another device
# find its hand-offs issued in time (with 2 the cpu:2 scaling benchmark lost ~10%).
ISSUE_AHEAD = 3


def task_error(e: BaseException, device: Device, message: str, **where) -> BaseException:
    """What a failure inside a closure becomes for the caller (the one place this is decided): the
    allocator running out (CUDA's or the cpu backend's model) is ``DeviceOutOfMemory`` naming the
    device and the task; a roundpipe error stays as it is; anything else is a ``StageError`` with
    ``message`` and ``where`` it happened (task, stage, layer, microbatch, step), caused by ``e``."""
    e = as_device_error(e, device, str(where.get("task", "?")))
    if isinstance(e, DeviceOutOfMemory):
        if getattr(e, "task", None) is None:
            e.task, e.layer = where.get("task"), where.get("layer")
            e.microbatch, e.step = where.get("microbatch"), where.get("step")
        return e
    if isinstance(e, RoundpipeError):
        return e
    err = StageError(message, device=device.name, **where)
    err.__cause__ = e
    return err


def make_shell(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` with every parameter and buffer on the meta device."""
    memo: dict[int, object] = {}
    for p in module.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def device_tensors(value, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The distinct-storage tensors inside ``value`` (dataclasses, dicts, lists, tuples, modules'
    parameters and buffers), skipping storages in ``seen`` (which it extends)."""
    out: list[torch.Tensor] = []
    _collect(value, set() if seen is None else seen, out)
    return out


def _collect(v, seen: set[int], out: list[torch.Tensor]) -> None:
    # A plain recursive function: a nested closure that calls itself is a reference cycle, which
    # would keep the tensors it collected alive until the cycle collector runs.
    if isinstance(v, torch.Tensor):
        ptr = v.untyped_storage().data_ptr()
        if v.device.type != "meta" and v.numel() and ptr not in seen:
            seen.add(ptr)
            out.append(v)
    elif isinstance(v, nn.Module):
        for t in (*v.parameters(), *v.buffers()):
            _collect(t, seen, out)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        for f in dataclasses.fields(v):
            _collect(getattr(v, f.name), seen, out)
    elif isinstance(v, dict):
        for x in v.values():
            _collect(x, seen, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _collect(x, seen, out)


class Worker:
    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.weights = WeightResidency(setup, device)
        self._shells: dict[int, list[tuple[nn.Module, nn.Module, str, bool, int]]] = {}
        self._context_module: Slot | None = None
        self._ctx: tuple | None = None  # (microbatch, inputs slot, context slot, ledger-held slot)
        self._slots: list[Slot] = []  # what the current step's tasks fill
        self.status = "idle"
        self.tasks_done = 0
        self._computed: list = []  # compute-done event of each issued task, in issue order

    def progress(self) -> int:
        """Tasks whose compute the device has finished (the watchdog's measure of GPU progress)."""
        return sum(1 for ev in self._computed if ev.query())

    def reset(self) -> None:
        """Forget all device state after a failed step (the backend has been drained and reset).

        Every slot the step's tasks filled is emptied as well: the error's traceback keeps the
        failed closures' frames, and through them what the closures captured, for as long as the
        caller keeps the error; emptied slots hold no device tensor.
        """
        self.weights.reset()
        for slot in self._slots:
            slot.value = None
        self._slots = []
        if self._ctx is not None:
            for slot in self._ctx[1:]:
                slot.value = None
        self._ctx = None
        if self._context_module is not None:
            self._context_module.value = None
        self._context_module = None
        self._acc = None
        self.status = "idle"

    def release_all(self) -> None:
        """End of a step: release every weight, the microbatch context and the context module, so
        the device holds nothing until the next step (stateless workers)."""
        self.weights.release_all()
        self._drop_context()
        if self._context_module is not None:
            slot, dev = self._context_module, self.device

            def free():
                tensors = device_tensors(slot.value)
                slot.value = None
                dev.ledger.release(tensors, "context module", "context")

            self.streams["compute"].submit(free, name="release context module")
            self._context_module = None

    def _bound_modules(self, layer: int, weights: dict[int, torch.Tensor]) -> nn.Module:
        """This device's shell of ``layer`` with ``weights`` bound in. Runs on the compute stream;
        ``_unbind`` must follow once the layer's work (and its autograd graph) is done."""
        if layer not in self._shells:
            shell = make_shell(self.setup.adapter.layers[layer].module)
            self._shells[layer] = [
                (shell, shell.get_submodule(b.module_path), b.attr, b.is_buffer, b.piece)
                for b in self.setup.store.bindings[layer]
            ]
        bound = self._shells[layer]
        for _, mod, attr, is_buffer, piece in bound:
            (mod._buffers if is_buffer else mod._parameters)[attr] = weights[piece]
        return bound[0][0] if bound else self.setup.adapter.layers[layer].module

    def _unbind(self, layers: range) -> None:
        """Take the device tensors out of the cached shells: a shell that kept them would keep every
        layer the device has ever run alive on it."""
        for layer in layers:
            for _, mod, attr, is_buffer, _piece in self._shells.get(layer, ()):
                (mod._buffers if is_buffer else mod._parameters)[attr] = None

    # ----------------------------------------------------------------- context
    def _ensure_context_module(self) -> Slot:
        """The rotary tables' module on this device (buffers only), uploaded once per step."""
        if self._context_module is None:
            module = self.setup.adapter.context_module
            slot = Slot()
            sources = [
                (target, n, t.detach(), is_param)
                for sub_name, sub in module.named_modules()
                for target in (sub_name,)
                for table, is_param in ((sub._buffers, False), (sub._parameters, True))
                for n, t in table.items()
                if t is not None
            ]
            copied = self._upload([t for _, _, t, _ in sources], "context module", "context")

            def assemble():  # compute stream, after the copies
                m = make_shell(module)
                for (target, n, _, is_param), t in zip(sources, copied.value):
                    owner = m.get_submodule(target)
                    if is_param:
                        owner._parameters[n] = nn.Parameter(t, requires_grad=False)
                    else:
                        owner._buffers[n] = t
                copied.value = None
                slot.value = m

            self.streams["compute"].submit(assemble, name="context module")
            self._context_module = slot
        return self._context_module

    def _upload(
        self, sources: list, what: str, tag: str, *, after=None, label=None, task=None, single=False
    ) -> Slot:
        """Copy host tensors (None: skipped) onto this device; returns the slot of the device tensors
        (a list in order, or the one tensor when ``single``) that compute may read from here on.

        Every device allocation is made on the compute stream, so that a device's memory is one
        caching-allocator pool, freed and reused in compute order: the copies run on ``h2d`` after
        compute has reached the allocation (and after ``after``, the event of the download that
        fills the host tensors), and compute waits for them before it goes on. ``task``: the step
        and task of a hand-off upload (its ``upload`` fault point; a failure names the task)."""
        dev, streams = self.device, self.streams
        compute, h2d = streams["compute"], streams["h2d"]
        slot = Slot()

        def allocate():
            made = [None if t is None else dev.empty(t.shape, t.dtype) for t in sources]
            dev.ledger.reserve(made, what, tag)
            slot.value = made[0] if single else made

        compute.submit(allocate, name=f"allocate {what}")
        h2d.wait_event(compute.record_event())
        if after is not None:
            h2d.wait_event(after)

        def copy():
            if task is not None:
                step, name, mb = task
                try:
                    faults.point("upload", step=step, device=dev.name)
                except BaseException as e:
                    raise task_error(
                        e,
                        dev,
                        f"upload of {what} for {name} failed: {e}",
                        task=name,
                        microbatch=mb,
                        step=step,
                    ) from e
            for dst, src in zip((slot.value,) if single else slot.value, sources):
                if src is not None:
                    dev.copy_in(dst, src)

        h2d.submit(copy, label, name=what)
        compute.wait_event(h2d.record_event())
        return slot

    def _context(self, step: StepRun, mb: int) -> tuple[Slot, Slot]:
        """Upload microbatch ``mb``'s inputs and build its layer context (masks, rotary tables) on
        this device, unless the previous task left them for the same microbatch."""
        if self._ctx is not None and self._ctx[0] == mb:
            return self._ctx[1], self._ctx[2]
        self._drop_context()
        module = self._ensure_context_module()
        dev, adapter, dtype = self.device, self.setup.adapter, self.setup.store.dtype
        backend = self.setup.backend
        # Staged into (pinned) host buffers first, so that their copies are asynchronous on CUDA.
        staged = [
            None if t is None else backend.host_empty(t.shape, t.dtype).copy_(t)
            for t in (getattr(step.microbatches[mb], f.name) for f in dataclasses.fields(MicrobatchInputs))
        ]
        inputs, ctx, held = Slot(), Slot(), Slot([])  # held: what the ledger books for them
        self._slots += [inputs, ctx, held]
        compute, h2d = self.streams["compute"], self.streams["h2d"]
        uploaded = self._upload(staged, f"inputs.{mb}", "context")
        copied = h2d.record_event()
        for t in staged:
            if t is not None:
                backend.host_release(t, copied)

        all_ones = host_all_ones(step.microbatches[mb].attention_mask)  # the host knows: no sync

        def build():
            inputs.value = MicrobatchInputs(*uploaded.value)
            held.value.append([t for t in uploaded.value if t is not None])
            uploaded.value = None
            c = adapter.build_context(module.value, inputs.value, dtype, mask_all_ones=all_ones)
            c.head_chunk_tokens = self.setup.config.head_chunk_tokens
            c.labels_checked = True  # inputs.split_batch checked them on the host
            seen = {t.untyped_storage().data_ptr() for t in (*held.value[0], *device_tensors(module.value))}
            tensors = device_tensors(c, seen)  # only what the build made: not the inputs or tables
            dev.ledger.reserve(tensors, f"ctx.{mb}", "context")
            held.value.append(tensors)
            ctx.value = c

        compute.submit(build, (f"ctx.{mb}", "context"))
        self._ctx = (mb, inputs, ctx, held)
        return inputs, ctx

    def _drop_context(self) -> None:
        if self._ctx is not None:
            mb, inputs, ctx, held = self._ctx
            dev = self.device

            def free():
                inputs.value = ctx.value = None
                for what, tensors in zip((f"inputs.{mb}", f"ctx.{mb}"), held.value):
                    dev.ledger.release(tensors, what, "context")
                held.value = None

            self.streams["compute"].submit(free, name=f"release ctx.{mb}")
            self._ctx = None

    # ----------------------------------------------------------------- tasks
    def run(self, step: StepRun, flows: list[TaskFlow]) -> None:
        """Issue every task of this device for one step (worker thread).

        ``order="strict"`` issues the table's order; ``order="ready"`` issues the first task in
        table order whose incoming hand-offs have all been issued by their producers (the table is
        a hint, readiness decides), so an order that would deadlock strictly still completes.
        """
        remaining = list(flows)
        self._slots: list[Slot] = []  # what this step's tasks fill (emptied by reset after a failure)
        self._computed = []
        self._downloaded: list = []  # downloads-done event of each issued task
        self._outputs: list = []  # (downloaded, [(slot, what)]) of the tasks whose outputs are kept
        self._draining: list = []  # (downloaded, slot, what) of each flushed gradient accumulator
        self._acc: Slot | None = None  # open weight-gradient accumulator (see _accumulator)
        self._acc_range, self._acc_count = range(0), 0
        ready = self.setup.config.order == "ready"
        while remaining:
            flow = remaining.pop(self._pick_ready(step, remaining) if ready else 0)
            upcoming = None
            if self.setup.config.prefetch:
                upcoming = next((f.layers for f in remaining if f.layers != flow.layers), None)
            self._issue(step, flow, upcoming, remaining)
            self.tasks_done += 1
        self.flush_grads(step)
        self._drop_outputs(keep=0)
        self._drop_gradients(keep=0)
        self.release_all()
        self.status = "done"

    def _pick_ready(self, step: StepRun, remaining: list[TaskFlow]) -> int:
        while True:
            for n, f in enumerate(remaining):
                if all(step.exchange.has(k) for k in f.consumes) and self._totals_ready(step, f):
                    return n
            self.status = "ready order: no task ready; waiting for " + ", ".join(
                f"{f.task}" for f in remaining[:4]
            )
            step.exchange.wait_for_change()

    # ----------------------------------------------------------------- router statistics
    def _router_layers(self, layers: range) -> list[int]:
        return [i for i in layers if getattr(self.setup.adapter.layers[i], "routers", ())]

    def _router_pairs(self, flow: TaskFlow) -> list[tuple[int, int]]:
        """The (router layer, microbatch) pairs whose statistics this op computes: the forwards it
        runs first (router_totals.py), in the order it runs them."""
        first = list(flow.layers_fwd) + (list(flow.layers_bwd) if flow.first_forward else [])
        return [(i, flow.task.microbatch) for i in self._router_layers(first)]

    def _totals_ready(self, step: StepRun, flow: TaskFlow) -> bool:
        """A backward over router layers is ready once every other op's statistics are put."""
        if step.router is None or not self._router_layers(flow.layers_bwd):
            return True
        return step.router.ready(set(self._router_pairs(flow)))

    def _wait_for_the_device(self, label: str) -> None:
        """Block the host until the compute ``ISSUE_AHEAD`` tasks back has finished.

        On CUDA a closure runs when it is issued, so what it allocates is allocated then: without
        this wait a worker could issue, and allocate for, any number of tasks ahead of the GPU.
        """
        if len(self._computed) >= ISSUE_AHEAD:
            self.status = f"{label}: waiting for the device to finish task -{ISSUE_AHEAD}"
            self._computed[-ISSUE_AHEAD].synchronize()

    def _issue(
        self, step: StepRun, flow: TaskFlow, upcoming: range | None, remaining: list[TaskFlow]
    ) -> None:
        streams = self.streams
        t, mb = flow.task, flow.task.microbatch
        label = f"{t}" + (f"+{flow.fused_with}" if flow.fused_with else "")
        self.status = f"{label}: preparing"
        needs_grad = len(flow.layers_bwd) > 0 and self._backward_needed(flow)
        layers_all = flow.layers
        if len(layers_all) == 0 or (flow.task.kind == "B" and not needs_grad):
            self._issue_empty(step, flow)
            return
        self._wait_for_the_device(label)
        residents = self.weights.ensure(layers_all, upcoming, remaining, step.weight_bound)

        # At most two tasks in flight per device on the streams too: this compute starts once the
        # downloads two tasks back are done, and frees those outputs first (so the device holds the
        # outputs of two tasks at most); its inputs (hand-offs and the microbatch's) are allocated on
        # compute after that, so their copies start once compute has reached them.
        self._drop_outputs(keep=1)
        inputs, ctx = self._context(step, mb)

        incoming = self._issue_incoming(step, flow, label)
        streams["compute"].wait_event(streams["h2d"].record_event())
        for r in residents:
            streams["compute"].wait_event(r.event)
        if upcoming is not None:
            self.weights.prefetch(upcoming)

        produced = {key: Slot() for key in flow.produces}
        param_grads = self._accumulator(step, flow) if flow.layers_bwd else Slot()
        loss_slot = Slot()
        stats_slot = Slot()  # the router statistics this op computes (router_totals.py)
        checks, checks_slot = TaskChecks(mb, self.device.name), Slot()  # numerics.py: finite or not
        self._slots += [
            *incoming.values(),
            *produced.values(),
            param_grads,
            loss_slot,
            stats_slot,
            checks_slot,
        ]
        self._slots += [r.slot for r in residents]
        self.status = f"{label}: issued"

        def compute():
            self._compute(
                step, flow, residents, inputs.value, ctx.value, incoming, produced, param_grads, loss_slot,
                stats_slot, checks, checks_slot,
            )  # fmt: skip

        kind = "FB" if flow.fused_with else t.kind
        streams["compute"].submit(compute, (label, kind))
        computed = streams["compute"].record_event()
        self._computed.append(computed)
        streams["d2h"].wait_event(computed)
        done = self._issue_downloads(
            step, flow, label, produced, loss_slot, stats_slot, (checks, checks_slot)
        )
        self._downloaded.append(done)
        if flow.layers_bwd:
            self._acc_count += 1
            # Keep summing while this device's next backward is over the same layers (forwards in
            # between, as in 1F1B rows, do not touch the accumulator).
            nxt = next((f for f in remaining if f.layers_bwd), None)
            if nxt is None or nxt.layers_bwd != flow.layers_bwd:
                self.flush_grads(step)

    def _issue_incoming(self, step: StepRun, flow: TaskFlow, label: str) -> dict[tuple, Slot]:
        """Upload the task's incoming hand-offs (activation and/or gradient), in that order, each
        reserved until the compute releases it (``_upload``)."""
        h2d = self.streams["h2d"]
        incoming: dict[tuple, Slot] = {}
        for key in flow.consumes:
            self.status = f"{label}: waiting for {key[0]}[{key[1]}] of microbatch {key[2]}"
            host_slot, event = step.exchange.get(key)
            what = f"{key[0]}[{key[1]}].{key[2]}"
            incoming[key] = self._upload(
                [host_slot.value], what, "activations", after=event, label=(what, "upload"),
                task=(step.index, label, key[2]), single=True,
            )  # fmt: skip
            host_slot.take(after=h2d.record_event())  # the copy's end frees the host buffer
        return incoming

    def _issue_downloads(
        self, step: StepRun, flow: TaskFlow, label: str, produced, loss_slot, stats_slot, checked
    ):
        """Download what the compute produced (on ``d2h``, after it) into host hand-offs and put
        them in the exchange, and its finiteness flags (``checked``: the task's ``TaskChecks`` and
        the slot of their packed flags) for the host to read; returns the event that fires when
        the downloads are done."""
        dev, streams = self.device, self.streams
        backend = self.setup.backend
        host_out = {
            key: HandOff(
                step.flow_plan.consumers[key],
                self.setup.host_memory,
                f"{key[0]}[{key[1]}].{key[2]}",
                backend.host_release,
            )
            for key in produced
        }
        host_loss, host_stats, host_checks = Slot(), Slot(), Slot()  # filled by the download
        checks, checks_slot = checked

        mb = flow.task.microbatch
        # (device slot, what the ledger books it as, where its host copy goes)
        outputs = [(stats_slot, f"router.{mb}", host_stats.fill)]
        outputs += [(s, f"{key[0]}[{key[1]}].{key[2]}", host_out[key].fill) for key, s in produced.items()]
        outputs += [
            (loss_slot, f"loss.{mb}", host_loss.fill),
            (checks_slot, f"checks.{mb}", host_checks.fill),
        ]

        def download():
            try:
                faults.point("download", step=step.index, device=dev.name)
                for slot, _, fill in outputs:
                    if slot.value is not None:
                        fill(dev.to_host(slot.value))
            except BaseException as e:
                raise task_error(
                    e, dev, f"download after {label} failed: {e}", task=label,
                    microbatch=flow.task.microbatch, step=step.index,
                ) from e  # fmt: skip

        streams["d2h"].submit(download, (f"out:{label}", "download"))
        done = streams["d2h"].record_event()
        # The device outputs stay until compute has waited for this download (``_drop_outputs``):
        # freed in compute order, their memory is reused by compute with no record_stream.
        self._outputs.append((done, [(slot, what) for slot, what, _ in outputs]))
        # The host reads the task's flags (and adds its loss) in queue order, before any update
        # that could carry a non-finite value: queued before the outputs reach another device.
        if flow.layers_bwd and flow.layers_bwd.stop == self.setup.num_layers:
            step.on_loss(host_loss, done)
        step.on_checks(checks, host_checks, done)
        pairs = self._router_pairs(flow) if step.router is not None else []
        if pairs:
            step.router.put(pairs, host_stats, done)
        for key, s in host_out.items():
            step.exchange.put(key, s, done, step.flow_plan.consumers[key])
        return done

    def _drop_outputs(self, keep: int) -> None:
        """Free the device outputs of every downloaded task but the last ``keep``, on compute after
        their downloads (a compute-stream free: reusable by compute's next allocation at once)."""
        compute, dev = self.streams["compute"], self.device
        while len(self._outputs) > keep:
            done, slots = self._outputs.pop(0)
            compute.wait_event(done)

            def free(slots=slots):
                for slot, what in slots:
                    if slot.value is not None:
                        v, slot.value = slot.value, None
                        dev.ledger.release(v, what, "activations")
                        del v

            compute.submit(free, name="release outputs")

    def _accumulator(self, step: StepRun, flow: TaskFlow) -> Slot:
        """The device-side fp32 sum of this backward stage's weight gradients.

        Consecutive backward tasks of one stage on a device (roundpipe runs a stage for every
        microbatch in a row) add into it, and it goes down to the CPU once, when the device moves
        on: M times fewer gradient downloads and host additions than one per microbatch.
        """
        if self._acc is not None and self._acc_range != flow.layers_bwd:
            self.flush_grads(step)
        if self._acc is None:
            # At most one earlier accumulator may still be on its way down while this one fills: the
            # host waits for the one before it and frees it on compute (on CUDA the new one is
            # allocated when this task is issued, in compute's pool).
            self.status = f"{flow.task}: waiting for the gradients of two stages back to download"
            self._drop_gradients(keep=1)
            self._acc, self._acc_range, self._acc_count = Slot({}), flow.layers_bwd, 0
        return self._acc

    def flush_grads(self, step: StepRun) -> None:
        """Download the open accumulator and hand it to the host thread (worker thread): a dict
        ``{(entry key, rows or None): fp32 gradient of those rows}``. The device accumulator stays
        until ``_drop_gradients`` frees it on compute, after its download."""
        if self._acc is None:
            return
        acc, layers, count = self._acc, self._acc_range, self._acc_count
        self._acc = None
        dev, streams = self.device, self.streams
        host_grads = Slot()

        first = self.setup.adapter.layers[layers.start].name

        def download():
            try:
                faults.point("grads", step=step.index, device=dev.name, layer=first)
                host_grads.value = {k: dev.to_host(g) for k, g in acc.value.items()}
            except BaseException as e:
                raise task_error(
                    e, dev, f"downloading the gradients of {first}.. failed: {e}", layer=first,
                    task=f"grads:{first}", step=step.index,
                ) from e  # fmt: skip

        grads_stream = streams["d2h_grads"]
        grads_stream.wait_event(streams["compute"].record_event())
        grads_stream.submit(download, (f"grads:{first}", "download"))
        downloaded = grads_stream.record_event()
        added = step.on_grads(layers, host_grads, count, downloaded)
        self._draining.append((downloaded, added, acc, f"grads:{layers}"))

    def _drop_gradients(self, keep: int) -> None:
        """Free the device accumulators of every flushed stage but the last ``keep``: the host waits
        for each download (so compute does not), then compute frees it. With ``keep`` 1 the host
        also waits until the host thread has added it (back-pressure: a slow optimizer thread holds
        at most two stages' downloaded gradients per device, not every one the device makes)."""
        compute, dev = self.streams["compute"], self.device
        while len(self._draining) > keep:
            downloaded, added, acc, what = self._draining.pop(0)
            downloaded.synchronize()
            if keep and added is not None:
                while not added.wait(0.05):
                    if self.setup.backend.aborted:
                        raise AbortedWait(f"abandoned waiting for the host to add {what}")
            compute.wait_event(downloaded)

            def free(acc=acc, what=what):
                grads, acc.value = acc.value, None
                dev.ledger.release(list(grads.values()), what, "grads")
                del grads

            compute.submit(free, name=f"release {what}")

    def _issue_empty(self, step: StepRun, flow: TaskFlow) -> None:
        """A task with nothing to compute (a forward whose outputs nobody needs, a backward the flow
        left empty): take its hand-offs so they are freed, and account a backward. A hand-off's host
        buffer goes back to the pool with an event after the download that fills it (the h2d stream
        waits for it): on CUDA the download may still be writing it when this is issued."""
        h2d = self.streams["h2d"]
        for key in flow.consumes:
            host_slot, event = step.exchange.get(key)
            if event is not None:
                h2d.wait_event(event)
            host_slot.take(after=h2d.record_event())
        if flow.task.kind == "B":
            step.on_grads(flow.layers_bwd, Slot(), 1, None)

    def _backward_needed(self, flow: TaskFlow) -> bool:
        r = flow.layers_bwd
        return bool(flow.produces) or bool(self.setup.store.trainable_keys(r)) or flow.fused_with is not None

    # ----------------------------------------------------------------- compute (compute stream)
    def _compute(
        self, step, flow, residents: list[Resident], inputs, ctx, incoming, produced, param_grads, loss_slot,
        stats_slot, checks: TaskChecks, checks_slot: Slot,
    ) -> None:  # fmt: skip
        dev = self.device
        t = flow.task
        layer_name = None
        weights: dict[int, torch.Tensor] = {}
        for r in residents:
            weights.update(r.slot.value)
        dev.ledger.mark(f"compute {t}")
        try:
            start = flow.layers.start
            x = inputs.input_ids if start == 0 else incoming[("act", start, t.microbatch)].value
            stats: list[torch.Tensor] = []  # router statistics, in _router_pairs order
            with torch.no_grad():
                for i in flow.layers_fwd:
                    layer_name = self.setup.adapter.layers[i].name
                    x = self._run_layer(step, i, weights, x, ctx, t.microbatch, checks)
                    got = ctx.router_logits.pop(i, None)
                    if got:
                        stats.append(step.router.loss.stats(got, ctx.inputs.attention_mask))
                    del got
                    key = ("act", i + 1, t.microbatch)
                    if key in produced:
                        self._produce(produced[key], x, f"act[{i + 1}].{t.microbatch}")
            if flow.layers_bwd:
                layer_name = None
                self._backward(
                    step, flow, weights, x, ctx, incoming, produced, param_grads, loss_slot, stats, checks
                )
            del x
            if stats:
                packed = torch.stack(stats)
                stats.clear()
                self._produce(stats_slot, packed, f"router.{t.microbatch}")
                del packed
            packed = checks.packed()
            if packed is not None:
                self._produce(checks_slot, packed, f"checks.{t.microbatch}")
            del packed
            for key, s in incoming.items():
                v, s.value = s.value, None
                dev.ledger.release(v, f"{key[0]}[{key[1]}].{key[2]}", "activations")
                del v
        except BaseException as e:
            placed = getattr(e, "task", None) is not None  # an inner handler said where already
            err = task_error(
                e, dev, f"{type(e).__name__} in {t.kind} of stage {t.stage}: {e}",
                task=str(t) + (f"+{flow.fused_with}" if flow.fused_with else ""), stage=t.stage,
                layer=layer_name, microbatch=t.microbatch, step=step.index,
            )  # fmt: skip
            if isinstance(err, DeviceOutOfMemory) and not placed:
                err.add_note(
                    f"while running {t} (layer {layer_name}, microbatch {t.microbatch}) of step "
                    f"{step.index} under the {step.flow_plan.table.policy} plan of "
                    f"{step.flow_plan.table.num_microbatches} microbatches; see pipe.plan"
                )
            if err is e:
                raise
            raise err from e
        finally:
            checks.flags.clear()  # a failed task's flags are device tensors too (packed() clears them otherwise)
            self._unbind(flow.layers)

    def _produce(self, slot: Slot, t: torch.Tensor, what: str) -> None:
        """Leave ``t`` for a download: reserve it (compute stream); ``_drop_outputs`` frees it on
        compute once the download is done."""
        self.device.ledger.reserve(t, what, "activations")
        slot.value = t

    def _run_layer(self, step, i: int, weights, x, ctx, mb: int, checks: TaskChecks | None):
        """Layer ``i``'s forward; ``checks``: where to note whether its output is finite (None for a
        recompute: the first forward noted it)."""
        layer = self.setup.adapter.layers[i]
        poison = faults.point(
            "forward", step=step.index, layer=layer.name, microbatch=mb, device=self.device.name
        )
        module = self._bound_modules(i, weights)
        if i in self.setup.random_layers:  # data-parallel ranks draw their own masks
            with self.device.seeded(_seed(self.setup.config.seed, step.index, i, mb, self.setup.rank)):
                y = layer.forward(module, x, ctx)
        else:
            y = layer.forward(module, x, ctx)
        if poison:
            y = y * float("nan")
        if checks is not None:
            checks.output(i, y)
        return y

    def _backward(
        self, step, flow, weights, x, ctx, incoming, produced, param_grads, loss_slot, stats, checks
    ) -> None:
        setup, dev = self.setup, self.device
        t = flow.task
        mb = t.microbatch
        r = flow.layers_bwd
        grad_in = ("grad", r.start, mb) in produced  # someone below needs the input's gradient
        if grad_in:
            x = x.detach().requires_grad_(True)
        x0 = x
        pieces = setup.store.trainable_pieces(r)
        params = [weights[p] for p in pieces]
        acc = param_grads.value  # this stage's open fp32 accumulator, keyed by piece
        made: list = []
        # Each parameter's gradient goes into the accumulator as soon as autograd has it (and is then
        # dropped), instead of all of a stage's fresh gradients living at once beside the accumulator.
        entries = setup.store.entries
        hooks = [
            param.register_post_accumulate_grad_hook(
                self._into(
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
                    y = self._run_layer_named(step, i, weights, y, ctx, mb, t, first)
                    got = ctx.router_logits.pop(i, None)
                    if got:
                        routed.append(got)
                        if flow.first_forward:
                            stats.append(step.router.loss.stats(got, ctx.inputs.attention_mask))
                    del got
                if r.stop == setup.num_layers:
                    self._produce(loss_slot, y.detach(), f"loss.{mb}")
                    seed = y.new_full(y.shape, step.grad_seed)  # a fill kernel: no host-to-device copy
                else:
                    seed = incoming[("grad", r.stop, mb)].value
                outputs, seeds = [y], [seed]
                if routed:  # this stage's share of the load-balancing loss, on the batch's totals
                    term = self._router_term(step, flow, routed, stats, ctx)
                    outputs.append(term)
                    seeds.append(term.new_full((), step.router.seed))
                    del term
                routed.clear()
                wrt = ([x0] if grad_in else []) + params
                if faults.point(
                    "backward", step=step.index, layer=setup.adapter.layers[r.start].name, microbatch=mb,
                    device=dev.name,
                ):  # fmt: skip
                    seeds = [s * float("nan") for s in seeds]
                if wrt:
                    torch.autograd.backward(outputs, grad_tensors=seeds, inputs=wrt)
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

    def _router_term(self, step, flow, routed, stats, ctx) -> torch.Tensor:
        """The differentiable ``coef * aux`` share of the routers in ``routed`` (compute stream):
        the batch's totals are every other op's statistics (waited for on the host, then uploaded)
        plus this op's own."""
        rl = step.router.loss
        own = set(self._router_pairs(flow))
        self.status = f"{flow.task}: waiting for the router statistics of the batch"
        with self.device.waiting():
            others = step.router.totals(own, lambda: self.setup.backend.aborted)
        totals = self.device.to_device(others)
        if stats:
            totals = totals + torch.stack(stats).sum(0)
        weights = rl.weights(totals)
        mask = ctx.inputs.attention_mask
        terms = [rl.term(got, mask, weights) for got in routed]
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum()

    @staticmethod
    def _into(acc: dict, piece, made: list, checks: TaskChecks, layer: int, name: str):
        """A post-accumulate hook that moves ``param.grad`` into ``acc[piece]`` (fp32, summed over the
        stage's microbatches; a shard's gradient covers only its rows), noting in ``checks``
        whether this microbatch's gradient is finite (``layer``: its highest layer in the stage)."""

        def hook(param: torch.Tensor) -> None:
            g, param.grad = param.grad, None
            checks.gradient(layer, name, g)
            if piece in acc:
                acc[piece].add_(g)
            else:
                acc[piece] = g if g.dtype == torch.float32 else g.to(torch.float32)
                made.append(piece)

        return hook

    def _run_layer_named(self, step, i, weights, x, ctx, mb, t, checks):
        try:
            return self._run_layer(step, i, weights, x, ctx, mb, checks)
        except BaseException as e:
            err = task_error(
                e, self.device, f"{type(e).__name__} in {t.kind} of stage {t.stage}: {e}", task=str(t),
                stage=t.stage, layer=self.setup.adapter.layers[i].name, microbatch=mb, step=step.index,
            )  # fmt: skip
            if err is e:
                raise
            raise err from e


def _seed(base: int, step: int, layer: int, mb: int, rank: int | None = None) -> int:
    key = f"{base}/{step}/{layer}/{mb}" + ("" if rank is None else f"/rank{rank}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
