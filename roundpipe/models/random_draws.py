"""Which layers' forwards may draw random numbers, and the draws no replay can reproduce.

The pipeline runs each layer's forward twice in a step: once in the forward task, once when the
backward recomputes its stage. Every random draw must come out the same both times, and the same
whatever device or thread runs the layer, so the runtime issues each layer that may draw inside
``Device.seeded`` (device and host generators seeded by run seed, step, layer, microbatch and
data-parallel rank; ``runtime/compute.py``).

Which layers may draw is not knowable from the module types: ``nn.Dropout`` is one way, but
attention dropout is a float argument, a MoE router's jitter a ``torch.rand_like``, peft LoHa's
``module_dropout`` a ``torch.rand(1)`` on the host, LoHa/LoKr's ``rank_dropout`` a
``torch.rand(rank)``, GPT-2's ``embd_pdrop`` a dropout in the embedding. So every layer with a
module in training mode is seeded: a seeded block costs a hash and two small generator seeds per
layer and task, which is noise beside a layer's compute.

A seed replays draws made from torch's generators in the layer's forward. It cannot replay state
a module keeps between calls and advances on each one: such a method is refused at wrap time
(``refuse_unreplayable_draws``).
"""

from __future__ import annotations

from roundpipe.errors import UnsupportedModel
from roundpipe.models.base import ModelAdapter


def layers_that_draw(adapter: ModelAdapter) -> frozenset[int]:
    """Indices of the layers whose forward may draw random numbers: those with a module in
    training mode (a model in eval mode draws nothing). Refuses what no seed replays first."""
    refuse_unreplayable_draws(adapter)
    return frozenset(
        layer.index for layer in adapter.layers if any(m.training for m in layer.module.modules())
    )


def refuse_unreplayable_draws(adapter: ModelAdapter) -> None:
    """Raise ``UnsupportedModel`` for a training-mode module whose randomness lives in state it
    advances on every call.

    peft's MonteCLoRA (``LoraConfig(monteclora_config=...)``) hands each forward the next of a
    buffer of samples drawn ahead of time (and keeps the last on the module for its variational
    loss): the backward's recomputation would take the following sample, so the gradient would be
    of other weights than the loss.
    """
    for layer in adapter.layers:
        for name, module in layer.module.named_modules():
            if module.training and getattr(module, "lora_monteclora_sampler", None):
                raise UnsupportedModel(
                    f"{layer.name}: {name} is a peft MonteCLoRA adapter, whose sampler hands each "
                    f"forward the next pre-drawn sample; the pipeline recomputes every forward in "
                    f"the backward, which would take another sample than the forward did. Train "
                    f"without monteclora_config (plain LoRA)."
                )
