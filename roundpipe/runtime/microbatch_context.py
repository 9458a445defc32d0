"""A device's layer context: a microbatch's inputs and what every layer is handed (masks, rotary
tables), built on the device by the model's context view (``models/views.py``).

The context module (the rotary tables' module, buffers only) is uploaded once per step; each
microbatch's inputs are staged into pinned host buffers, uploaded, and its context built on the
compute stream. Consecutive tasks of one microbatch reuse it, and so does a microbatch whose shape,
mask and positions equal those of the context built last (only its own ids and labels go up). Everything is reserved in the
device's ledger when it is made and released, in compute order, when the device moves on or the
step ends (docs/design.md §5). Only the device's worker thread calls ``MicrobatchContext``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from roundpipe.backend import Device
from roundpipe.models.base import MicrobatchInputs
from roundpipe.models.mask_facts import host_facts
from roundpipe.runtime.exchange import Slot
from roundpipe.runtime.shells import device_tensors, make_shell
from roundpipe.runtime.transfers import upload
from roundpipe.runtime.worker_setup import WorkerSetup

if TYPE_CHECKING:
    from roundpipe.runtime.step import StepRun


_ALL_INPUTS = tuple(f.name for f in dataclasses.fields(MicrobatchInputs))
_OWN_INPUTS = ("input_ids", "labels", "loss_positions")  # what a reused context does not share


class MicrobatchContext:
    """The context module and the current microbatch's inputs and context on one device.

    Building a context runs the base model's forward through the context view, which reads a
    microbatch's shape, attention mask and position ids and nothing else (it is handed zero
    embeddings). The device keeps the last context it built (its *base*) until a microbatch differs
    from it in one of those: a microbatch like it reuses the base's layer arguments and uploads only
    its own ids, labels and loss positions (``ModelAdapter.reuse_context``). At most the base and one
    microbatch's own inputs are held, as before at most one context was."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.module: Slot | None = None  # the context module on this device, once uploaded this step
        # (microbatch, inputs slot, context slot, slot of what the ledger books for that microbatch
        # alone: None when the context is the base itself)
        self._current: tuple | None = None
        self._base: tuple | None = None  # (host inputs, inputs, context, ledger slots) of the last build
        self._made: list[Slot] = []  # every slot this step's contexts fill (emptied by reset)
        # this device's shell of the context module and, by (module path, table, name), the meta
        # tensors the step's device tensors replace in it while bound
        self._shell: tuple[nn.Module, dict] | None = None

    def start(self) -> None:
        """A new step (the last one released everything it made)."""
        self._made = []

    def get(self, step: StepRun, mb: int) -> tuple[Slot, Slot]:
        """Microbatch ``mb``'s inputs and layer context on this device: uploaded and built unless
        the previous task left them for the same microbatch, or its context reuses the base's;
        returns the slots of both."""
        if self._current is not None and self._current[0] == mb:
            return self._current[1], self._current[2]
        self.drop()
        host = step.microbatches[mb]
        base = self._base
        if base is not None and same_layer_arguments(base[0], host):
            self._current = (mb, *self._build(mb, host, base[2]))
        else:
            self._release_base()
            inputs, ctx, held = self._build(mb, host)
            self._base = (host, inputs, ctx, held)
            self._current = (mb, inputs, ctx, None)
        return self._current[1], self._current[2]

    def _staged_upload(self, mb: int, tensors: list) -> Slot:
        """``tensors`` (host; None skipped) staged into (pinned) host buffers, so that their copies
        are asynchronous on CUDA, and uploaded."""
        backend = self.setup.backend
        staged = [None if t is None else backend.host_empty(t.shape, t.dtype).copy_(t) for t in tensors]
        uploaded = upload(self.device, staged, f"inputs.{mb}", "context")
        copied = self.streams["h2d"].record_event()
        for t in staged:
            if t is not None:
                backend.host_release(t, copied)
        return uploaded

    def _build(self, mb: int, host: MicrobatchInputs, base: Slot | None = None) -> tuple[Slot, Slot, Slot]:
        """Upload ``host`` and make its context on the compute stream: built by the context view,
        or, given the ``base`` context's slot, its own ids, labels and loss positions only, with the
        base's layer arguments (``ModelAdapter.reuse_context``)."""
        dev, adapter, dtype = self.device, self.setup.adapter, self.setup.store.dtype
        names = _ALL_INPUTS if base is None else _OWN_INPUTS
        module = self._ensure_module() if base is None else None
        uploaded = self._staged_upload(mb, [getattr(host, n) for n in names])
        # the host knows the mask's facts: building reads no device value
        facts = host_facts(host.attention_mask, host.position_ids) if base is None else None
        inputs, ctx, held = Slot(), Slot(), Slot([])  # held: (what, tensors) the ledger books
        self._made += [inputs, ctx, held]

        def build():
            values, uploaded.value = dict(zip(names, uploaded.value)), None
            own = [t for t in values.values() if t is not None]
            held.value.append((f"inputs.{mb}", own))
            seen = {t.untyped_storage().data_ptr() for t in own}
            if module is not None:  # a build (no base)
                inputs.value = MicrobatchInputs(**values)
                c = adapter.build_context(module.value, inputs.value, dtype, mask_facts=facts)
                c.head_chunk_tokens = self.setup.config.head_chunk_tokens
                c.labels_checked = True  # inputs.split_batch checked them on the host
                seen.update(t.untyped_storage().data_ptr() for t in device_tensors(module.value))
                made = device_tensors(c, seen)  # only what the build made: not the inputs or tables
            else:
                assert base is not None
                inputs.value = dataclasses.replace(base.value.inputs, **values)
                c = adapter.reuse_context(base.value, inputs.value)
                made = device_tensors(c.shift_labels, seen)  # the layer arguments are the base's
            dev.ledger.reserve(made, f"ctx.{mb}", "context")
            held.value.append((f"ctx.{mb}", made))
            ctx.value = c

        self.streams["compute"].submit(build, (f"ctx.{mb}", "context"))
        return inputs, ctx, held

    def _free(self, slots: tuple[Slot, ...], held: Slot, name: str) -> None:
        """Empty ``slots`` and give back what ``held`` booked, in compute order."""
        dev = self.device

        def free():
            for slot in slots:
                slot.value = None
            for what, tensors in held.value:
                dev.ledger.release(tensors, what, "context")
            held.value = None

        self.streams["compute"].submit(free, name=name)

    def drop(self) -> None:
        """Release the current microbatch's own inputs and context (in compute order); the base
        stays for the microbatches after it."""
        if self._current is not None:
            mb, inputs, ctx, held = self._current
            if held is not None:
                self._free((inputs, ctx), held, f"release ctx.{mb}")
            self._current = None

    def _release_base(self) -> None:
        if self._base is not None:
            _, inputs, ctx, held = self._base
            self._free((inputs, ctx), held, "release the base context")
            self._base = None

    def release(self) -> None:
        """End of a step: release the microbatch contexts and the context module, so the device
        holds nothing of them until the next step."""
        self.drop()
        self._release_base()
        if self.module is not None:
            slot, dev = self.module, self.device

            def free():
                tensors = device_tensors(slot.value)
                slot.value = None
                self._unbind_module()
                dev.ledger.release(tensors, "context module", "context")

            self.streams["compute"].submit(free, name="release context module")
            self.module = None

    def reset(self) -> None:
        """Forget everything after a failed step, emptying the slots (see ``Worker.reset``)."""
        for slot in self._made:
            slot.value = None
        self._made = []
        for entry in (self._current, self._base):
            for slot in (entry or ())[1:]:
                if slot is not None:
                    slot.value = None
        self._current = self._base = None
        if self.module is not None:
            self.module.value = None
        self.module = None
        self._unbind_module()

    def _ensure_module(self) -> Slot:
        """The rotary tables' module on this device (buffers only), uploaded once per step and
        bound into this device's shell of it, made once (a deep copy of the module's structure)."""
        if self.module is None:
            module = self.setup.adapter.context_module
            if self._shell is None:
                shell = make_shell(module)
                self._shell = (shell, {})
            shell, placeholders = self._shell
            slot = Slot()
            sources = [
                (sub_name, table, n, t.detach())
                for sub_name, sub in module.named_modules()
                for table in ("_buffers", "_parameters")
                for n, t in getattr(sub, table).items()
                if t is not None
            ]
            copied = upload(self.device, [t for *_, t in sources], "context module", "context")

            def assemble():  # compute stream, after the copies
                for (target, table, n, _), t in zip(sources, copied.value):
                    owner = getattr(shell.get_submodule(target), table)
                    placeholders.setdefault((target, table, n), owner[n])
                    owner[n] = nn.Parameter(t, requires_grad=False) if table == "_parameters" else t
                copied.value = None
                slot.value = shell

            self.streams["compute"].submit(assemble, name="context module")
            self.module = slot
        return self.module

    def _unbind_module(self) -> None:
        """Put the shell's meta tensors back in place of the device's (host side)."""
        if self._shell is not None:
            shell, placeholders = self._shell
            for (target, table, n), meta in placeholders.items():
                getattr(shell.get_submodule(target), table)[n] = meta


def same_layer_arguments(a: MicrobatchInputs, b: MicrobatchInputs) -> bool:
    """Whether the context view gives host microbatches ``a`` and ``b`` the same layer arguments:
    it reads their shape, attention mask and position ids (compared here, on the host: no sync)."""
    return a.input_ids.shape == b.input_ids.shape and all(
        x is y or (x is not None and y is not None and x.shape == y.shape and torch.equal(x, y))
        for x, y in ((a.attention_mask, b.attention_mask), (a.position_ids, b.position_ids))
    )
