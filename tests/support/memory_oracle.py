"""An oracle for device memory, independent of the runtime's own tracker: what one microbatch
needs in plain PyTorch, measured by a small dispatch mode that counts the storages made under it."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from roundpipe.models import adapt_model
from roundpipe.runtime.inputs import split_batch
from roundpipe.testing.faults import Fault


def microbatches_of(batch: dict, microbatches: int, vocab_size: int = 256) -> list:
    """``batch`` cut into ``microbatches``, as the pipeline cuts it."""
    return split_batch(
        batch["input_ids"],
        batch["labels"],
        batch.get("attention_mask"),
        None,
        vocab_size=vocab_size,
        microbatch_count=lambda _: microbatches,
    )[0]


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the storages made under it (an oracle independent of the runtime's tracker)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.known: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)
        }
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t):
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and ptr not in inputs and ptr not in self.known:
                    self.known.add(ptr)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, ptr, nbytes)
        return out

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.known.discard(ptr)
        self.live -= nbytes


def working_set(model, microbatches: list) -> int:
    """The most memory one microbatch needs in any one stage (one layer each here), measured in
    plain PyTorch: its inputs and context, the recomputed forward with grad, the backward with an
    output gradient, and the stage's fp32 gradient accumulator that each parameter's gradient is
    added into as soon as it exists; and the device's copy of the context module. The most over
    every microbatch (padding changes the attention path) and every stage."""
    adapter = adapt_model(model)
    worst = 0
    cases = [(microbatch, i, layer) for microbatch in microbatches for i, layer in enumerate(adapter.layers)]
    for microbatch, i, layer in cases:
        peak = PeakMemory()
        with peak:
            inputs = microbatch.to("cpu")
            inputs = type(inputs)(*(None if t is None else t.clone() for t in vars(inputs).values()))
            ctx = adapter.build_context(adapter.context_module, inputs, torch.float32)
            b, seq = inputs.input_ids.shape
            x = (
                inputs.input_ids
                if i == 0
                else torch.randn(b, seq, adapter.config.hidden_size, requires_grad=True)
            )
            params = [p for p in layer.module.parameters() if p.requires_grad]
            acc = [torch.zeros_like(p) for p in params]

            def into(a):
                def hook(param):
                    a.add_(param.grad)
                    param.grad = None

                return hook

            hooks = [p.register_post_accumulate_grad_hook(into(a)) for p, a in zip(params, acc)]
            with torch.enable_grad():
                y = layer.forward(layer.module, x, ctx)
                seed = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
                torch.autograd.backward([y], grad_tensors=[seed], inputs=([x] if i else []) + params)
            for h in hooks:
                h.remove()
            del y, seed, x, ctx, inputs, acc
        worst = max(worst, peak.peak)
    # The device also holds its copy of the context module (the rotary tables' buffers).
    context = sum(t.numel() * t.element_size() for t in adapter.context_module.buffers())
    return worst + context


def hand_offs_in_flight(model, microbatches: list) -> int:
    """Bytes of the hand-offs a device holds beside the running task's work: what the next task
    brings on while the current one computes (a hidden-state activation and its gradient, and the
    raw inputs of its microbatch) and what the previous task produced, kept until its download is
    done (an activation and a gradient: they are freed on the compute stream after it, as on CUDA)."""
    return max(
        4 * m.input_ids.numel() * model.config.hidden_size * 4  # fp32 [b, T, H]: 2 coming, 2 going
        + sum(t.numel() * t.element_size() for t in vars(m).values() if t is not None)
        for m in microbatches
    )


def device_of(need: int) -> int:
    """The capacity of a virtual device that holds a plan of ``need`` bytes: ``need`` plus what its
    caching allocator may reserve beyond them (``AllocatorRules.overhead``)."""
    from roundpipe.backend.cpu import ALLOCATING_STREAMS
    from roundpipe.backend.cpu_allocator import capacity_for

    return capacity_for(need, ALLOCATING_STREAMS)


def gradients_downloading(store) -> int:
    """Bytes an earlier stage (one layer) may leave on a device while its gradients go down: the
    runtime lets one download overlap the next stage. fp32 full fine-tuning: gradients = weights."""
    return max(store.layer_bytes)


def slow_gradient_downloads() -> Fault:
    """A fault that stalls every gradient download 50 ms, so that the previous stage's gradients
    are surely still on the device while the next stage's fill."""
    return Fault("grads", kind="stall", seconds=0.05, times=10_000)
