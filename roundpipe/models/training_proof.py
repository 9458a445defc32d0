"""The wrap-time training proof: one training step of the layers against the model as a user trains it.

The forward proof (``verify.py``) runs the unwrapped HF model in eval mode and no gradient, so it
cannot see what the model or peft does around the layers in training: a term added to the loss
(AdaLoRA's orthogonal regularizer), arguments computed per batch outside the layers (aLoRA's
activation offsets), a custom autograd function or backward hook between the layers. This proof
trains on the same short probe (2 x 8 tokens with labels, ``probe.probe_batch``), in train mode:

1. *Exactness.* With every dropout probability forced to 0 (``nn.Dropout`` modules and every
   float, or dict of floats, named ``*dropout*``, ``*pdrop*`` or ``*layerdrop*`` on a module or
   the config), the model called as a user calls it (``PeftModel(...)(input_ids=...,
   attention_mask=..., labels=...)``, or the HF model's own forward) and the layer-by-layer run (embed -> blocks ->
   head, as the runtime chains them, loss = head sum / label tokens + the MoE router loss) must
   give the same loss and the same gradient of every trainable parameter, and of the hidden state
   handed from layer to layer, to round-off of the model's dtype. Compared from the loss backward,
   the first difference is named: the loss (an extra loss term outside the layers), the gradient
   reaching a layer's output (the backward changed between two layers), or a parameter's gradient
   (its layer's backward differs, or it belongs to no layer).
2. *Replay.* With the user's dropout, the layer-by-layer run twice from one seed of torch's default
   generator must give the same outputs, loss and gradients: the pipeline recomputes each layer in
   its backward and replays torch's draws, so a layer that draws from anything else (a generator
   of its own, Python's ``random``, numpy) is named.

A difference raises :class:`UnsupportedModel`. The proof leaves the model as it found it: training
flags, dropout settings, ``.grad`` of every parameter and torch's CPU generator are put back.
Cost: four forward + backward passes of the probe (a tenth of a second on the test suite's tiny
Llama), and host memory for two copies of the trainable parameters' gradients besides ``.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from roundpipe.errors import UnsupportedModel
from roundpipe.models.base import Layer, MicrobatchInputs, ModelAdapter, loss_positions
from roundpipe.models.probe import PROBE_TOKENS, param_dtype, probe_batch, same_within

SEED = 4321  # the seed both runs of a comparison start from (torch's generator is put back after)


@dataclass
class TrainingRun:
    """What one forward + backward of the probe gave.

    ``loss``: the 0-dim loss (detached). ``grads``: ``id(param) -> gradient`` (None: no gradient)
    of every trainable parameter. ``hidden_grads``: ``block position -> gradient`` of the hidden
    state that block hands on (-1: the hidden state block 0 receives); absent where the run had
    none. ``outputs``: each layer's output (detached), layer-by-layer runs only.
    """

    loss: torch.Tensor
    grads: dict[int, torch.Tensor | None]
    hidden_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)


def prove_training(wrapped: nn.Module, adapter: ModelAdapter, *, what: str = "the model") -> None:
    """Raise UnsupportedModel when one training step of ``adapter``'s layers differs from one of
    ``wrapped`` (the model as the user calls it: a ``peft.PeftModel`` or the HF model whose layers
    ``adapter`` holds); see the module docstring. ``what`` names the probed model in the message."""
    batch = probe_batch(int(adapter.config.vocab_size))
    _place_invocation(wrapped, batch["input_ids"])
    dtype = param_dtype(adapter.model)
    tops = [wrapped, adapter.context_module, *(layer.module for layer in adapter.layers)]
    modules = list({id(m): m for top in tops for m in top.modules()}.values())
    params = list({id(p): p for m in modules for p in m.parameters(recurse=False)}.values())
    trainable = [(name, p) for name, p in wrapped.named_parameters() if p.requires_grad]
    before = {id(p): (p._version, _fingerprint(p)) for p in params}  # the version: bumped by a write
    with _train_mode(modules), _grads_put_back(params), torch.random.fork_rng(devices=[]):
        with _dropout_off(modules, [adapter.config, getattr(adapter.model, "config", None)]):
            torch.manual_seed(SEED)
            want = _model_run(wrapped, adapter, batch, trainable)
            _refuse_written(wrapped, adapter, params, before)
            torch.manual_seed(SEED)
            got = _layers_run(adapter, batch, dtype, trainable)
        _compare(wrapped, adapter, trainable, got, want, dtype, what)
        del want, got  # at most two runs' gradients held at once
        torch.manual_seed(SEED)
        first = _layers_run(adapter, batch, dtype, trainable)
        torch.manual_seed(SEED)
        second = _layers_run(adapter, batch, dtype, trainable)
        _compare_replay(adapter, trainable, first, second, dtype)


def _fingerprint(p: torch.Tensor) -> tuple[float, float]:
    """Two float64 sums of ``p``'s values: what tells a write that changed them from one that put
    them back (peft's ``target_parameters`` registers and removes a parametrization per forward)."""
    with torch.no_grad():
        return float(p.sum(dtype=torch.float64)), float(p.abs().sum(dtype=torch.float64))


def _refuse_written(wrapped: nn.Module, adapter: ModelAdapter, params: list[nn.Parameter], before) -> None:
    """Refuse a model whose training forward changes one of its parameters in place (peft OFT's
    ``coft`` projection of ``oft_R``, a statistic kept as a parameter): the pipeline's workers run
    each step on copies of the weights, so the change would be lost where plain PyTorch keeps it."""
    written = {
        id(p) for p in params if p._version != before[id(p)][0] and _fingerprint(p) != before[id(p)][1]
    }
    if not written:
        return
    names = {id(p): n for n, p in wrapped.named_parameters(remove_duplicate=False)}
    name = next((names[i] for i in names if i in written), "a parameter outside the model's names")
    raise UnsupportedModel(
        f"{type(adapter.model).__name__}: its forward in training writes parameter {name} in place "
        f"(seen on the wrap-time probe); the pipeline's workers run each step on copies of the "
        f"weights, so that change would be lost where plain PyTorch keeps it. Stop the forward "
        f"writing it (peft OFT: coft=False), or report the model or peft method"
    )


def _place_invocation(wrapped: nn.Module, ids: torch.Tensor) -> None:
    """Write an activated LoRA's invocation tokens into the probe's second row, so that the probe
    exercises the adapter (peft applies an aLoRA only after them)."""
    config = getattr(wrapped, "peft_config", {}).get(getattr(wrapped, "active_adapter", None))
    tokens = getattr(config, "alora_invocation_tokens", None)
    if tokens and len(tokens) <= PROBE_TOKENS - 3:
        ids[1, 2 : 2 + len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)


@contextlib.contextmanager
def _train_mode(modules: list[nn.Module]) -> Iterator[None]:
    flags = [(m, m.training) for m in modules]
    for m in modules:
        m.training = True
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def _grads_put_back(params: list[nn.Parameter]) -> Iterator[None]:
    saved = [(p, p.grad) for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or "pdrop" in name or "layerdrop" in name


@contextlib.contextmanager
def _dropout_off(modules: list[nn.Module], configs: list[Any]) -> Iterator[None]:
    """Every dropout probability 0 while inside: ``p`` of dropout modules, and floats (or dicts of
    floats, as peft's LoHa/LoKr keep per adapter) named ``*dropout*``/``*pdrop*``/``*layerdrop*`` on a
    module or a config (some attention modules read their dropout from a float or from the config)."""
    saved: list[tuple[Any, str, Any]] = []

    def zero(obj: Any, name: str, value: Any) -> None:
        if isinstance(value, float) and value != 0.0:
            saved.append((obj, name, value))
            setattr(obj, name, 0.0)
        elif isinstance(value, dict) and value and all(type(v) is float for v in value.values()):
            saved.append((obj, name, value))
            setattr(obj, name, dict.fromkeys(value, 0.0))

    for m in modules:
        if isinstance(m, nn.modules.dropout._DropoutNd):
            zero(m, "p", float(m.p))
        for name, value in list(vars(m).items()):
            if _is_dropout_name(name):
                zero(m, name, value)
    for config in {id(c): c for c in configs if c is not None}.values():
        for name, value in list(vars(config).items()):
            if _is_dropout_name(name):
                zero(config, name, value)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _take_grads(trainable: list[tuple[str, nn.Parameter]]) -> dict[int, torch.Tensor | None]:
    grads = {}
    for _, p in trainable:
        grads[id(p)] = None if p.grad is None else p.grad.detach().clone()
        p.grad = None
    return grads


def _keep_grad(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.requires_grad:
        t.retain_grad()
    return t


def _model_run(wrapped, adapter, batch, trainable) -> TrainingRun:
    """The model called as a user calls it, with each block's hidden input and output kept."""
    blocks = [layer.module for layer in adapter.layers if layer.kind == "block"]
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, kwargs, i=i):
            if i == 0:
                seen[-1] = _keep_grad(args[0] if args else kwargs.get("hidden_states"))

        def post(module, args, kwargs, out, i=i):
            seen[i] = _keep_grad(out[0] if isinstance(out, tuple) else out)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        try:
            out = wrapped(**batch, use_cache=False)
            loss = out.loss
            if loss is None:
                raise ValueError("it returned no loss for labels")
            loss.backward()
        except Exception as err:
            raise UnsupportedModel(
                f"{type(adapter.model).__name__}: a training step of the model as a user calls it "
                f"failed on the wrap-time probe ({type(err).__name__}: {err}), so roundpipe cannot check "
                f"its layers' training against it"
            ) from err
    finally:
        for h in handles:
            h.remove()
    hidden = {i: t.grad for i, t in seen.items() if isinstance(t, torch.Tensor) and t.grad is not None}
    return TrainingRun(loss.detach(), _take_grads(trainable), hidden)


def _layers_run(adapter, batch, dtype, trainable) -> TrainingRun:
    """The layers chained as the runtime chains them: embed on the ids, each block on what the one
    before gave, the head layers to the loss sum; loss = sum / label tokens (+ router loss)."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    micro = MicrobatchInputs(ids, mask, None, labels, loss_positions(labels))
    ctx = adapter.build_context(adapter.context_module, micro, dtype)
    outputs: list[torch.Tensor] = []
    block_outputs: dict[int, torch.Tensor] = {}
    x: Any = ids
    block = -1
    for layer in adapter.layers:
        x = _keep_grad(_run(adapter, layer, x, ctx))
        outputs.append(x.detach().clone())
        if layer.kind in ("embed", "block"):
            block_outputs[block] = x
            block += 1
    loss = x / (ctx.shift_labels != -100).sum()
    rl = getattr(adapter, "router_loss", None)
    if rl is not None:  # the batch's counts, then each layer's differentiable share, as the runtime
        routed = [g for g in ctx.router_logits.values() if g]
        weights = rl.weights(torch.stack([rl.stats(g, mask) for g in routed]).sum(0))
        loss = loss + sum(rl.term(g, mask, weights) for g in routed)
    try:
        loss.backward()
    except Exception as err:
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: the backward of the layer-by-layer run failed on the "
            f"wrap-time probe ({type(err).__name__}: {err})"
        ) from err
    hidden = {i: t.grad for i, t in block_outputs.items() if t.grad is not None}
    return TrainingRun(loss.detach(), _take_grads(trainable), hidden, outputs)


def _run(adapter: ModelAdapter, layer: Layer, x, ctx):
    try:
        return layer.forward(layer.module, x, ctx)
    except Exception as err:
        raise UnsupportedModel(
            f"{type(adapter.model).__name__}: layer {layer.name} ({type(layer.module).__name__}) failed "
            f"in train mode on the wrap-time probe ({type(err).__name__}: {err}); the layer-by-layer run "
            f"cannot train this model"
        ) from err


def _backward_order(adapter: ModelAdapter, trainable) -> list[tuple[str, Any]]:
    """What a gradient reaches, from the loss back: per layer (last first) its trainable
    parameters, then the hidden state it received; then the parameters in no layer. Items:
    ``("param", (name, param, layer or None))`` or ``("hidden", (block position, layer))``."""
    names = {id(p): n for n, p in trainable}
    num_blocks = sum(layer.kind == "block" for layer in adapter.layers)
    first_head = next(layer for layer in adapter.layers if layer.kind == "head")
    placed: set[int] = set()
    order: list[tuple[str, Any]] = []
    for layer in reversed(adapter.layers):
        for p in layer.module.parameters():
            if id(p) in names and id(p) not in placed:
                placed.add(id(p))
                order.append(("param", (names[id(p)], p, layer)))
        if layer is first_head:
            order.append(("hidden", (num_blocks - 1, layer)))
        elif layer.kind == "block":
            order.append(("hidden", (layer.index - 2, layer)))
    order.extend(("param", (n, p, None)) for n, p in trainable if id(p) not in placed)
    return order


def _zeros_if_none(grad, param) -> torch.Tensor:
    return torch.zeros_like(param) if grad is None else grad


def _first_difference(adapter, trainable, got: TrainingRun, want: TrainingRun, dtype):
    """The first item of :func:`_backward_order` whose gradient differs, with (diff, tol), or None."""
    for kind, item in _backward_order(adapter, trainable):
        if kind == "param":
            _, p, _ = item
            a, b = _zeros_if_none(got.grads[id(p)], p), _zeros_if_none(want.grads[id(p)], p)
        else:
            position, _ = item
            if position not in got.hidden_grads or position not in want.hidden_grads:
                continue
            a, b = got.hidden_grads[position], want.hidden_grads[position]
        ok, diff, tol = same_within(a, b, dtype)
        if not ok:
            return kind, item, diff, tol
    return None


def _call(wrapped: nn.Module) -> str:
    name = "PeftModel" if hasattr(wrapped, "peft_config") else type(wrapped).__name__
    return f"{name}(...)(input_ids=..., attention_mask=..., labels=...)"


def _block_name(adapter: ModelAdapter, position: int) -> str:
    blocks = [layer for layer in adapter.layers if layer.kind == "block"]
    return adapter.layers[0].name if position < 0 else blocks[position].name


def _compare(wrapped, adapter, trainable, got: TrainingRun, want: TrainingRun, dtype, what) -> None:
    kind = type(adapter.model).__name__
    where = (
        f"{kind}: one training step on a probe of 2 x {PROBE_TOKENS} tokens (train mode, dropout off), "
        f"{what} called as a user calls it ({_call(wrapped)}) against its layers run one by one:"
    )
    loss_dtype = torch.float32 if dtype == torch.float64 else dtype
    ok, diff, tol = same_within(got.loss.reshape(1), want.loss.float().reshape(1), loss_dtype)
    if not ok:
        raise UnsupportedModel(
            f"{where} the model's loss ({float(want.loss):.6g}) differs from the layers' loss "
            f"({float(got.loss):.6g}) by {diff:.3g} (round-off allows {tol:.3g}). Its forward changes "
            f"the loss outside the layers: it adds a term to the loss (a regularizer, an auxiliary "
            f"loss), or hands the layers arguments computed per batch that the pipeline does not "
            f"give them (as aLoRA's activation offsets); the pipeline would train neither. Train a "
            f"model whose loss is the LM loss of its layers (and the MoE router loss), or report "
            f"the model or peft method"
        )
    found = _first_difference(adapter, trainable, got, want, dtype)
    if found is None:
        return
    what_kind, item, diff, tol = found
    if what_kind == "hidden":
        position, _ = item
        name = _block_name(adapter, position)
        raise UnsupportedModel(
            f"{where} the gradient reaching the output of layer {name} is the first that differs, by "
            f"{diff:.3g} (max abs; round-off allows {tol:.3g}): the model changes the backward after "
            f"{name} outside the layers (a custom autograd function, a backward hook or a tensor "
            f"hook in its forward between or around the layers), which the pipeline would not "
            f"reproduce. Remove it, or move it inside a layer's module, or report the model"
        )
    name, _, layer = item
    if layer is None:
        raise UnsupportedModel(
            f"{where} trainable parameter {name} belongs to none of the layers, and its gradient in "
            f"the model differs by {diff:.3g} from the layers' (none): the model uses it outside the "
            f"layers, which the pipeline would not train. Freeze it (requires_grad=False), or report "
            f"the model"
        )
    raise UnsupportedModel(
        f"{where} the first trainable parameter whose gradient differs is {name} (layer "
        f"{layer.name}, {type(layer.module).__name__}), by {diff:.3g} (max abs; round-off allows "
        f"{tol:.3g}): the layer's backward differs from the model's (arguments the model computes per "
        f"batch outside the layers, a backward hook or custom autograd function outside them). "
        f"Remove what changes the backward outside the layers, or report the model or peft method"
    )


def _compare_replay(adapter, trainable, first: TrainingRun, second: TrainingRun, dtype) -> None:
    kind = type(adapter.model).__name__
    where = (
        f"{kind}: the layer-by-layer run on the wrap-time probe in train mode, twice from one seed of "
        f"torch's generator,"
    )
    advice = (
        "The pipeline recomputes each layer in its backward and replays torch's random draws only: "
        "draw from torch's default generator (as nn.Dropout does), or make the draw deterministic"
    )
    for layer, a, b in zip(adapter.layers, first.outputs, second.outputs):
        ok, diff, _ = same_within(a, b, dtype)
        if not ok:
            raise UnsupportedModel(
                f"{where} gives two different outputs of layer {layer.name} ({type(layer.module).__name__}), "
                f"by {diff:.3g}: it draws random numbers a second run from the same seed does not repeat "
                f"(a torch.Generator of its own, Python's random, numpy). {advice}"
            )
    found = _first_difference(adapter, trainable, first, second, dtype)
    if found is not None:
        what_kind, item, diff, _ = found
        name = _block_name(adapter, item[0]) if what_kind == "hidden" else item[0]
        raise UnsupportedModel(
            f"{where} gives two different gradients of {name}, by {diff:.3g}: its backward draws "
            f"random numbers a second run does not repeat. {advice}"
        )
