"""A decoder block's MLP run over its tokens in chunks (``RunConfig.mlp_chunk_tokens``).

At long sequences the MLP's intermediates dominate a block's memory: ``[tokens, I]`` four times
for a dense SwiGLU, each token's ``k`` experts' and its dispatched copies in an MoE block, all
kept by autograd while the stage recomputes and alive with their gradients while it
backpropagates. The MLP treats every token alone, so the block's MLP module is called on chunks of
at most ``mlp_chunk_tokens`` of the microbatch's tokens (rows flattened) and the chunks'
outputs are joined. With autograd on, each chunk runs under a non-reentrant checkpoint: autograd
keeps only the chunk's input, a view of a tensor it keeps anyway, and the backward recomputes one
chunk's intermediates at a time. The cost model counts the same (``partition/cost.py``
``activation_parts``, and the MLP's forward kernels once more in the backward).

The numbers are those of the MLP in one piece up to the order of a weight gradient's sum over
tokens (a sum per chunk, then over chunks). Refused at wrap time (:func:`check_chunkable`), with
what to change, for a block whose MLP this cannot run alike: one that draws random numbers (its
dropout masks would be drawn per chunk), reads torch parametrizations (peft's LoRA on fused
experts), reports router logits for the load-balancing loss, or has no MLP module this knows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.errors import UnsupportedModel
from roundpipe.models.base import ModelAdapter

# The attribute of a decoder layer that holds its MLP or MoE block, by family naming.
MLP_MODULE_NAMES = ("mlp", "block_sparse_moe", "feed_forward")


def mlp_module(block: nn.Module) -> nn.Module | None:
    for name in MLP_MODULE_NAMES:
        found = getattr(block, name, None)
        if isinstance(found, nn.Module):
            return found
    return None


def _draws(mlp: nn.Module) -> bool:
    """A dropout with a non-zero rate in training mode inside ``mlp`` (peft's lora_dropout is one)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in mlp.modules())


def check_chunkable(adapter: ModelAdapter, chunk_tokens: int | None, parametrized: frozenset[int]) -> None:
    """Raise UnsupportedModel when ``chunk_tokens`` is set and some block's MLP cannot be chunked."""
    if chunk_tokens is None:
        return
    for i, layer in enumerate(adapter.layers):
        if layer.kind != "block":
            continue
        why = None
        mlp = mlp_module(layer.module)
        if mlp is None:
            why = f"it has no MLP module named {' or '.join(MLP_MODULE_NAMES)}"
        elif _draws(mlp):
            why = "its MLP draws random numbers (a dropout, or peft's lora_dropout): set them to 0"
        elif i in parametrized:
            why = "it reads torch parametrizations (peft's LoRA on fused experts): leave the experts out of target_parameters"
        elif getattr(layer, "routers", ()):
            why = "its routers feed the load-balancing loss: set output_router_logits=False in the model's config"
        if why is not None:
            raise UnsupportedModel(
                f"mlp_chunk_tokens={chunk_tokens}: layer {layer.name} cannot run its MLP in token chunks "
                f"alike, as {why}; or leave mlp_chunk_tokens unset"
            )


@contextmanager
def chunked_mlp(block: nn.Module, chunk_tokens: int | None) -> Iterator[None]:
    """Within the block, ``block``'s MLP runs in chunks of at most ``chunk_tokens`` tokens (module
    docstring); ``block`` is one worker's device shell of the layer, so no other thread calls it."""
    mlp = None if chunk_tokens is None else mlp_module(block)
    if mlp is None or chunk_tokens is None:
        yield
        return
    size = chunk_tokens
    whole, own = mlp.forward, mlp.__dict__.get("forward")  # own: a forward set on the instance

    def in_chunks(h: torch.Tensor, *args, **kwargs):
        if args or kwargs or h.dim() != 3:  # running it whole would break the plan's memory silently
            raise UnsupportedModel(
                f"mlp_chunk_tokens={size}: {type(mlp).__name__} is called with other arguments than "
                f"one [rows, tokens, hidden] tensor, which token chunks cannot split; leave "
                f"mlp_chunk_tokens unset for this model"
            )
        if h.shape[0] * h.shape[1] <= size:
            return whole(h)
        rows, seq, width = h.shape
        pieces = h.reshape(1, rows * seq, width).split(size, dim=1)
        if torch.is_grad_enabled():
            outs = [checkpoint(whole, p, use_reentrant=False, preserve_rng_state=False) for p in pieces]
        else:
            outs = [whole(p) for p in pieces]
        return torch.cat(outs, dim=1).reshape(rows, seq, -1)

    mlp.forward = in_chunks
    try:
        yield
    finally:
        if own is None:
            del mlp.forward  # the class's forward again
        else:
            mlp.forward = own
