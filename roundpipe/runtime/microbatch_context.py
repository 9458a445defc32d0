"""A device's layer context: a microbatch's inputs and what every layer is handed (masks, rotary
tables), built on the device by the model's context view (``models/views.py``).

The context module (the rotary tables' module, buffers only) is uploaded once per step; each
microbatch's inputs are staged into pinned host buffers, uploaded, and its context built on the
compute stream. Consecutive tasks of one microbatch reuse it. Everything is reserved in the
device's ledger when it is made and released, in compute order, when the device moves on or the
step ends (docs/design.md §5). Only the device's worker thread calls ``MicrobatchContext``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

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


class MicrobatchContext:
    """The context module and the current microbatch's inputs and context on one device."""

    def __init__(self, setup: WorkerSetup, device: Device):
        self.setup = setup
        self.device = device
        self.streams = device.streams
        self.module: Slot | None = None  # the context module on this device, once uploaded this step
        self._current: tuple | None = None  # (microbatch, inputs slot, context slot, ledger-held slot)
        self._made: list[Slot] = []  # every slot this step's contexts fill (emptied by reset)

    def start(self) -> None:
        """A new step (the last one released everything it made)."""
        self._made = []

    def get(self, step: StepRun, mb: int) -> tuple[Slot, Slot]:
        """Upload microbatch ``mb``'s inputs and build its layer context on this device, unless the
        previous task left them for the same microbatch; returns the slots of both."""
        if self._current is not None and self._current[0] == mb:
            return self._current[1], self._current[2]
        self.drop()
        module = self._ensure_module()
        dev, adapter, dtype = self.device, self.setup.adapter, self.setup.store.dtype
        backend = self.setup.backend
        # Staged into (pinned) host buffers first, so that their copies are asynchronous on CUDA.
        staged = [
            None if t is None else backend.host_empty(t.shape, t.dtype).copy_(t)
            for t in (getattr(step.microbatches[mb], f.name) for f in dataclasses.fields(MicrobatchInputs))
        ]
        inputs, ctx, held = Slot(), Slot(), Slot([])  # held: what the ledger books for them
        self._made += [inputs, ctx, held]
        compute, h2d = self.streams["compute"], self.streams["h2d"]
        uploaded = upload(dev, staged, f"inputs.{mb}", "context")
        copied = h2d.record_event()
        for t in staged:
            if t is not None:
                backend.host_release(t, copied)

        host = step.microbatches[mb]
        facts = host_facts(host.attention_mask, host.position_ids)  # the host knows: no sync

        def build():
            inputs.value = MicrobatchInputs(*uploaded.value)
            held.value.append([t for t in uploaded.value if t is not None])
            uploaded.value = None
            c = adapter.build_context(module.value, inputs.value, dtype, mask_facts=facts)
            c.head_chunk_tokens = self.setup.config.head_chunk_tokens
            c.labels_checked = True  # inputs.split_batch checked them on the host
            seen = {t.untyped_storage().data_ptr() for t in (*held.value[0], *device_tensors(module.value))}
            tensors = device_tensors(c, seen)  # only what the build made: not the inputs or tables
            dev.ledger.reserve(tensors, f"ctx.{mb}", "context")
            held.value.append(tensors)
            ctx.value = c

        compute.submit(build, (f"ctx.{mb}", "context"))
        self._current = (mb, inputs, ctx, held)
        return inputs, ctx

    def drop(self) -> None:
        """Release the current microbatch's inputs and context (in compute order)."""
        if self._current is not None:
            mb, inputs, ctx, held = self._current
            dev = self.device

            def free():
                inputs.value = ctx.value = None
                for what, tensors in zip((f"inputs.{mb}", f"ctx.{mb}"), held.value):
                    dev.ledger.release(tensors, what, "context")
                held.value = None

            self.streams["compute"].submit(free, name=f"release ctx.{mb}")
            self._current = None

    def release(self) -> None:
        """End of a step: release the microbatch context and the context module, so the device
        holds nothing of them until the next step."""
        self.drop()
        if self.module is not None:
            slot, dev = self.module, self.device

            def free():
                tensors = device_tensors(slot.value)
                slot.value = None
                dev.ledger.release(tensors, "context module", "context")

            self.streams["compute"].submit(free, name="release context module")
            self.module = None

    def reset(self) -> None:
        """Forget everything after a failed step, emptying the slots (see ``Worker.reset``)."""
        for slot in self._made:
            slot.value = None
        self._made = []
        if self._current is not None:
            for slot in self._current[1:]:
                slot.value = None
        self._current = None
        if self.module is not None:
            self.module.value = None
        self.module = None

    def _ensure_module(self) -> Slot:
        """The rotary tables' module on this device (buffers only), uploaded once per step."""
        if self.module is None:
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
            copied = upload(self.device, [t for _, _, t, _ in sources], "context module", "context")

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
            self.module = slot
        return self.module
