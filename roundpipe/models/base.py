"""The contract between a Hugging Face model and the runtime: a list of layers.

A model is cut into layers: ``embed``, one ``block`` per decoder layer, and ``head`` (final norm +
LM head + loss) -- or, with ``adapt_model(model, head_shards=k)``, ``head.0 .. head.{k-1}``: the
head + loss cut into vocabulary shards (kind ``"head"`` too; see ``head_shards.py``). The runtime never calls the HF model's own ``forward``; it calls
``Layer.forward(module, x, ctx)`` on a *device shell* of ``layer.module`` whose parameters are the
copies it uploaded to a worker. ``layer.module`` itself is the model's own module (CPU, never moved).

Shapes: ``input_ids`` [b, T] int64; hidden [b, T, H] in the run dtype; the head returns the
**sum** of token cross-entropies of the microbatch as a 0-dim fp32 tensor (the runtime divides by
the label-token count of the whole batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
from torch import nn

from roundpipe.models.head import IGNORE_INDEX, shift_labels
from roundpipe.models.mask_facts import MaskFacts
from roundpipe.models.router_loss import RouterLoss

LayerKind = Literal["embed", "block", "head"]


@dataclass
class MicrobatchInputs:
    """The raw inputs of one microbatch. Labels are *unshifted* (HF convention, -100 ignored).

    ``loss_positions``: int64 flat indices into ``[b * T]`` of the tokens whose *shifted* label is
    not -100 (:func:`loss_positions`). The head computes logits for those tokens only; they are
    found on the host, where the labels already are, so the device never waits to learn how many
    there are. None: the head computes every token (same result, more work).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_positions: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicrobatchInputs:
        def move(t):
            return None if t is None else t.to(device)

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)})

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the tokens of ``labels`` [b, T] (unshifted) whose next-token target counts.

    Position ``t`` of a row predicts label ``t + 1``; the last position of every row predicts
    nothing. Run on the host: ``nonzero`` on a device would wait for it.
    """
    return (shift_labels(labels).reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


@dataclass
class LayerContext:
    """Per-(device, microbatch) tensors every layer may need, built on the worker's device.

    ``layer_inputs[i]`` is ``(args, kwargs)`` decoder layer ``i`` is called with besides its hidden
    states (masks, rotary tables, position ids, ... as the model's own forward builds them; shared
    between layers where HF shares them); ``shift_labels`` [b, T] are the targets already shifted
    left (last position -100), so the head needs no cross-position work.
    """

    inputs: MicrobatchInputs
    position_ids: torch.Tensor
    layer_inputs: list[tuple[tuple, dict[str, Any]]] = field(default_factory=list)
    shift_labels: torch.Tensor | None = None
    head_chunk_tokens: int = 1024
    # The labels were checked against the vocabulary where that reads no device value (the runtime
    # checks the whole batch on the host, ``inputs.split_batch``); False: the head checks them.
    labels_checked: bool = False
    # Router logits a block left for the load-balancing loss (``router_loss.py``), by layer index;
    # whoever runs the layer takes them out (the runtime right after each layer).
    router_logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class Layer(ABC):
    """One unit of the model: embedding, a decoder block, or the head (+ loss)."""

    def __init__(self, name: str, index: int, kind: LayerKind, module: nn.Module):
        self.name = name
        self.index = index
        self.kind = kind
        self.module = module

    @abstractmethod
    def forward(self, module: nn.Module, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """Run this layer with ``module`` (``self.module`` or a device shell of it).

        embed: ``x`` is input_ids -> hidden. block: hidden -> hidden. head: hidden -> 0-dim fp32
        loss sum over the microbatch's label tokens, computed in token chunks of
        ``ctx.head_chunk_tokens`` so that [tokens x vocab] logits never exist for the whole
        microbatch; differentiable w.r.t. ``x`` and the module's trainable parameters.
        Head shards: ``head.0`` hidden -> packed fp32 [b, T, H + 2]; a middle shard packed ->
        packed; the last shard packed -> the same 0-dim fp32 loss sum (format in ``head_shards.py``).
        """

    def row_slices(self) -> dict[str, tuple[int, int]]:
        """Tensors (``module``-relative names) this layer reads only rows ``[start, stop)`` of.

        The runtime uploads and returns just those rows (a vocabulary shard of the LM head); every
        other tensor moves whole. Most layers read whole tensors: ``{}``.
        """
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ModelAdapter(ABC):
    """A HF causal LM (optionally inside a peft wrapper) seen as a list of layers."""

    model: nn.Module  # the HF *ForCausalLM module (unwrapped from peft); owns all parameters
    config: Any  # the HF config that sizes the decoder (``vocab_size``, ``num_hidden_layers``, ...)
    layers: list[Layer]
    router_loss: RouterLoss | None  # the MoE load-balancing loss the config asks for, or None
    context_module: (
        nn.Module
    )  # what builds each layer's arguments (rotary tables: buffers only), on every worker

    @abstractmethod
    def build_context(
        self,
        context_module: nn.Module,
        inputs: MicrobatchInputs,
        dtype: torch.dtype,
        mask_facts: MaskFacts | None = None,
    ) -> LayerContext:
        """Build masks and position embeddings for ``inputs`` (already on the worker's device).

        ``context_module`` is a device copy of ``self.context_module``; ``dtype`` is the dtype of
        the hidden states the blocks will see (masks and rotary tables follow it, as in HF);
        ``mask_facts``: padding and packing as the host copies of the mask and the position ids
        say (``models.mask_facts.MaskFacts``; None: unknown).
        """

    @abstractmethod
    def reuse_context(self, ctx: LayerContext, inputs: MicrobatchInputs) -> LayerContext:
        """The context of ``inputs`` (on the device), a microbatch whose shape, attention mask and
        position ids equal those of the microbatch ``ctx`` was built for: the layer arguments and
        position ids are ``ctx``'s (``build_context`` reads nothing else of a microbatch), the
        inputs and shifted labels ``inputs``'s own; ``ctx`` is not changed."""
