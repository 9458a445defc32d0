"""The wrap-time proof: the adapter's layers against the HF model's own forward, on a short probe.

:func:`verify_adapter` runs two sequences of eight tokens (one left-padded, some labels -100)
through the model's own ``forward`` (LoRA and other injected adapters included) with every decoder
layer's input and output recorded, then runs each of the adapter's layers on the same input:
the embedding on the token ids, decoder layer ``i`` on what HF gave layer ``i``, the head on the
last layer's output. The first layer whose output differs beyond round-off of the model's dtype
(at the tokens that are not padding) is named in an :class:`UnsupportedModel`; so is a loss that
differs. Dropout is off for the probe (eval mode, restored after) and no gradient is taken.

:func:`verify_model` decides what is probed: the model itself, or, when it is large (more than
:data:`VERIFY_MAX_PARAMS` parameters), still on the meta device, or ``RunConfig(verify_model=False)``
asks, a tiny model of the same config class (``tiny.tiny_config``) with the same peft adapter
attached: the same code path at a small size.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from roundpipe.errors import UnsupportedModel
from roundpipe.models.base import MicrobatchInputs, ModelAdapter, loss_positions
from roundpipe.models.probe import PROBE_TOKENS, param_dtype, probe_batch, same_within
from roundpipe.models.training_proof import prove_training

VERIFY_MAX_PARAMS = 1_000_000_000  # above this the probe runs on a tiny model of the same class


def _record(blocks: list[nn.Module]) -> tuple[list, list, list]:
    """Hooks recording each block's hidden input and output; returns (inputs, outputs, handles)."""
    inputs: list = [None] * len(blocks)
    outputs: list = [None] * len(blocks)
    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, kwargs, i=i):
            inputs[i] = args[0] if args else kwargs.get("hidden_states")

        def post(module, args, kwargs, out, i=i):
            outputs[i] = out[0] if isinstance(out, tuple) else out

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return inputs, outputs, handles


def verify_adapter(adapter: ModelAdapter, *, what: str = "the model") -> None:
    """Raise UnsupportedModel when ``adapter``'s layers do not reproduce its model's forward
    (module docstring). ``what`` names the probed model in the message."""
    model = adapter.model
    config = adapter.config
    batch = probe_batch(int(config.vocab_size))
    blocks = [layer.module for layer in adapter.layers if layer.kind == "block"]
    dtype = param_dtype(model)
    # Views (the embedding, context and logits views) are modules of their own, not children of
    # the model: each gets eval mode for the probe too, and every flag is put back after.
    modules = [model, adapter.context_module, *(layer.module for layer in adapter.layers)]
    flags = [(m, m.training) for top in modules for m in top.modules()]
    for top in modules:
        top.eval()
    inputs, outputs, handles = _record(blocks)
    try:
        with torch.no_grad():
            try:
                ref = model(**batch, use_cache=False)
            except Exception as err:
                raise UnsupportedModel(
                    f"{type(model).__name__}: its own forward failed on the wrap-time probe "
                    f"({type(err).__name__}: {err}), so roundpipe cannot check its layers against it"
                ) from err
            _compare(adapter, batch, inputs, outputs, ref.loss, dtype, what)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag


def _compare(adapter, batch, inputs, outputs, ref_loss, dtype, what) -> None:
    ids, labels = batch["input_ids"], batch["labels"]
    keep = batch["attention_mask"].bool()
    micro = MicrobatchInputs(ids, batch["attention_mask"], None, labels, loss_positions(labels))
    try:
        ctx = adapter.build_context(adapter.context_module, micro, dtype)
    except Exception as err:
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: building the layers' arguments failed on the wrap-time probe "
            f"({type(err).__name__}: {err})"
        ) from err
    layers = adapter.layers
    blocks = [layer for layer in layers if layer.kind == "block"]
    if any(t is None for t in (*inputs, *outputs)):
        missing = [b.name for b, t in zip(blocks, inputs) if t is None]
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: its forward did not run decoder layers {missing} on the "
            f"probe; roundpipe runs every layer once, in order"
        )
    got = _run(adapter, layers[0], ids, ctx)
    _check(adapter, layers[0], got, inputs[0], keep, dtype, what, "")
    for i, block in enumerate(blocks):
        got = _run(adapter, block, inputs[i], ctx)
        _check(adapter, block, got, outputs[i], keep, dtype, what, "")
        if i + 1 < len(blocks):  # what the forward does between two layers, the layers must not miss
            _check(
                adapter,
                block,
                outputs[i],
                inputs[i + 1],
                keep,
                dtype,
                what,
                f" (what {blocks[i + 1].name} receives)",
            )
    if ref_loss is None:
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: its forward returned no loss for labels; roundpipe trains causal LMs"
        )
    x = outputs[-1]
    for layer in layers[len(blocks) + 1 :]:
        x = _run(adapter, layer, x, ctx)
    loss = x / (ctx.shift_labels != -100).sum()
    rl = getattr(adapter, "router_loss", None)
    if rl is not None:  # HF adds coef * aux to its loss; ours from the routers the blocks ran
        stats = [rl.stats(g, batch["attention_mask"]) for g in ctx.router_logits.values() if g]
        loss = loss + rl.value(torch.stack(stats).sum(0))
    ok, diff, tol = same_within(
        loss.reshape(1), ref_loss.float().reshape(1), torch.float32 if dtype == torch.float64 else dtype
    )
    if not ok:
        raise UnsupportedModel(_diverged(adapter, layers[-1], diff, tol, what, (), (), loss=True))


def _run(adapter, layer, x, ctx):
    """``layer`` on ``x``; an exception becomes the UnsupportedModel that names the layer."""
    try:
        return layer.forward(layer.module, x, ctx)
    except UnsupportedModel:
        raise
    except Exception as err:
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: layer {layer.name} ({type(layer.module).__name__}) failed on the "
            f"wrap-time probe ({type(err).__name__}: {err}); the layer-by-layer run cannot reproduce this "
            f"family's forward. Register what differs with roundpipe.models.register_family, or report the family"
        ) from err


def _check(adapter, layer, got, want, keep, dtype, what, where) -> None:
    ok, diff, tol = same_within(got[keep], want[keep], dtype) if got.shape == want.shape else (False, 0, 0)
    if not ok:
        raise UnsupportedModel(_diverged(adapter, layer, diff, tol, what, got.shape, want.shape, where=where))


def _diverged(adapter, layer, diff, tol, what, got_shape, want_shape, loss=False, where="") -> str:
    kind = type(adapter.model).__name__
    module = type(layer.module).__name__
    if loss:
        found = f"the loss of the head ({layer.name}) differs from the model's own loss by {diff:.3g} (round-off allows {tol:.3g})"
    elif got_shape != want_shape:
        found = f"layer {layer.name} ({module}) gives shape {tuple(got_shape)} where the model's forward has {tuple(want_shape)}"
    else:
        found = (
            f"layer {layer.name} ({module}) is the first whose output differs from the model's own forward{where}: by "
            f"{diff:.3g} (max abs; round-off allows {tol:.3g})"
        )
    return (
        f"{kind}: checked against {what} on a probe of 2 x {PROBE_TOKENS} tokens, {found}. The "
        f"layer-by-layer run does not reproduce this family's forward; register what differs with "
        f"roundpipe.models.register_family (roundpipe/models/families.py), or report the family"
    )


def _has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _tiny_twin(wrapped: Any, causal_lm: nn.Module) -> nn.Module:
    """A tiny model of ``causal_lm``'s config class, with the same peft adapter as ``wrapped``."""
    from roundpipe.models.tiny import tiny_config

    tiny = tiny_config(causal_lm.config)
    torch.manual_seed(0)
    model = type(causal_lm)(tiny).to(torch.float32)
    peft_config = getattr(wrapped, "peft_config", None)
    if peft_config:
        import peft

        name = getattr(wrapped, "active_adapter", "default")
        model = peft.get_peft_model(model, copy.deepcopy(peft_config[name]))
    return model


def verify_model(wrapped: Any, adapter: ModelAdapter, *, full: bool = True, head_shards: int = 1) -> str:
    """Check ``adapter`` (of ``wrapped``, the user's model, peft or not) at wrap time; returns what
    was probed (``"model"`` or ``"tiny model"``). ``full=False`` (``RunConfig(verify_model=False)``)
    probes the tiny model only. Raises UnsupportedModel as :func:`verify_adapter`."""
    model = adapter.model
    big = sum(p.numel() for p in model.parameters()) > VERIFY_MAX_PARAMS
    if full and not big and not _has_meta(model):
        verify_adapter(adapter)
        prove_training(wrapped, adapter)
        return "model"
    from roundpipe.models.adapter import adapt_model

    twin = _tiny_twin(wrapped, model)
    twin_adapter = adapt_model(twin, head_shards=head_shards)
    what = f"a tiny {type(model).__name__} of the same config class"
    verify_adapter(twin_adapter, what=what)
    prove_training(twin, twin_adapter, what=what)
    return "tiny model"
