"""Views of a HF model's own forward code, for the steps between its parts that families differ in.

What a family does between ``embed_tokens`` and the first decoder layer (Gemma's normaliser,
Granite's embedding multiplier, a learned position table) and between the last layer's output and
the logits (Granite's and Cohere's logit scaling, MiniCPM's hidden-state scaling, softcapping) is
written in its base model's and causal LM's ``forward``. Instead of re-typing each formula, the
adapter runs that code itself, on a *view*: a new module object of the same class whose
sub-modules are the model's own, with the parts another layer runs replaced by stand-ins:

- the **embedding view** is the base model whose first decoder layer stops its forward (and a
  rotary module that returns nothing): it maps ``input_ids`` to exactly what the first decoder
  layer receives.
- the **context view** is the base model whose decoder layers only record what they are passed
  (and an identity final norm): given ``inputs_embeds`` of the right shape and dtype, it yields
  each layer's arguments exactly as the family's forward builds them (masks, rotary tables,
  alibi biases, ...), which the blocks are then called with.
- the **logits view** is the causal LM whose base model hands its ``inputs_embeds`` straight
  through: its forward maps final-normed hidden states to exactly the logits HF's loss sees.

Probes (:func:`embedding_is_plain`, :func:`logits_are_plain`) run these views with stand-in weights
(no real weight is read, so a model on the meta device can be probed) to find out whether a family
adds anything at all; only then does the adapter use a view, so families that add nothing keep the
direct path (and the vocabulary-sharded head).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def module_view(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A new module of ``module``'s class sharing its sub-modules, parameters, buffers and
    attributes, with the children named in ``replace`` swapped; ``module`` is not changed. Hooks
    registered on ``module`` are shared (a peft or user hook runs in the view too)."""
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    # A forward set on the instance (a hook library's wrapper, a patch) is bound to ``module``
    # and would run its children, not the view's: the view runs its class's forward.
    view.__dict__.pop("forward", None)
    for store in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        if store in module.__dict__:
            view.__dict__[store] = type(module.__dict__[store])(module.__dict__[store])
    # State-dict hooks are for loading the model, not running it, and some are bound methods of
    # the original module: a device copy of the view would copy the whole model with them.
    for hooks in (
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    ):
        if hooks in view.__dict__:
            view.__dict__[hooks] = type(view.__dict__[hooks])()
    for name, child in replace.items():
        if name not in view._modules:
            raise KeyError(f"{type(module).__name__} has no child module {name!r}")
        view._modules[name] = child
    return view


def plain_attributes(module: nn.Module | None) -> dict[str, Any]:
    """The plain (not module, not tensor) attributes of ``module``, its own and its class's
    properties: what a forward may read off a layer or a base model it calls."""
    if module is None:
        return {}
    out = {k: v for k, v in module.__dict__.items() if not k.startswith("_") and not _holds_tensors(v)}
    # Properties of the family's own classes only (not torch's or transformers' generic ones,
    # some of which warn, compute or print when read).
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("transformers.models."):
            continue
        for name, attr in vars(cls).items():
            if name.startswith("_") or name in out or not isinstance(attr, property):
                continue
            try:
                value = getattr(module, name)
            except Exception:
                continue
            if not _holds_tensors(value) and not callable(value):
                out[name] = value
    return out


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, (nn.Module, torch.Tensor)) or (
        isinstance(value, (list, tuple, dict))
        and any(isinstance(v, (nn.Module, torch.Tensor)) for v in value)
    )


class StandIn(nn.Module):
    """A module that takes another's place in a view and answers reads of its plain attributes
    (``layer.attention_type``, ``model.lm_head_multiplier``, ...) as that module would."""

    def __init__(self, like: nn.Module | None = None):
        super().__init__()
        self.__dict__["_like_attrs"] = plain_attributes(like)

    def __getattr__(self, name: str):
        attrs = self.__dict__.get("_like_attrs", {})
        if name in attrs:
            return attrs[name]
        return super().__getattr__(name)


class Silent(StandIn):
    """Stands in for a rotary module whose tables no layer of the view uses: returns None."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class PassHidden(StandIn):
    """Stands in for a base model inside the logits view: its output is the ``inputs_embeds`` it is
    given (the final-normed hidden states), as a ``BaseModelOutputWithPast``."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor | None = None, **kwargs: Any):
        return _passed_output(inputs_embeds)


@functools.cache
def _passed_class() -> type:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class Passed(BaseModelOutputWithPast):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return Passed


def _passed_output(hidden: torch.Tensor):
    """A base-model output holding ``hidden``; any other field a causal LM reads (router logits,
    caches, hidden states of every layer) is None."""
    return _passed_class()(last_hidden_state=hidden)


class ViewLogits(nn.Module):
    """``hidden`` [n, H] -> logits [n, V] through the causal LM's own forward (``logits_view``):
    what ``chunked_lm_loss`` calls as its ``lm_head`` for a family that transforms its logits."""

    def __init__(self, view: nn.Module):
        super().__init__()
        self.view = view

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.view(inputs_embeds=hidden.unsqueeze(0), use_cache=False)
        return out.logits.squeeze(0)


class _Reached(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by :class:`StopAtFirstLayer` to carry what the first decoder layer would receive."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("first decoder layer reached")
        self.hidden = hidden


class StopAtFirstLayer(StandIn):
    """Stands in for the decoder layers of the embedding view: the base forward runs up to its
    first layer call, and the hidden states it hands that layer come back as the view's output."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        raise _Reached(hidden_states)


def run_to_first_layer(view: nn.Module, **kwargs: Any) -> torch.Tensor:
    """Run an embedding view; the hidden states its forward hands the first decoder layer."""
    try:
        view(**kwargs)
    except _Reached as reached:
        return reached.hidden
    raise RuntimeError("the base model's forward never called its first decoder layer")


def embedding_view(base: nn.Module, layers: str, rotary: str | None) -> nn.Module:
    """The base model whose decoder layers stop it at the first (module docstring); the rotary
    module, whose tables no layer of the view uses, returns nothing."""
    first = getattr(base, layers)[0]
    replace: dict[str, nn.Module] = {layers: nn.ModuleList([StopAtFirstLayer(first)])}
    if rotary is not None:
        replace[rotary] = Silent(getattr(base, rotary))
    return without_checkpointing(module_view(base, replace))


def without_checkpointing(view: nn.Module) -> nn.Module:
    """HF's gradient checkpointing calls layers through a wrapper with positional arguments; the
    pipeline recomputes on its own, so a view never checkpoints."""
    if "gradient_checkpointing" in view.__dict__:
        view.__dict__["gradient_checkpointing"] = False
    return view


class LayerRecorder(StandIn):
    """Stands in for decoder layer ``i`` in the context view: records the arguments the base
    forward passes it (besides the hidden states) into the current capture, and returns the hidden
    states unchanged."""

    def __init__(self, layer: nn.Module, index: int):
        super().__init__(layer)
        self.index = index
        self.__dict__["sink"] = None

    def forward(self, hidden_states, *args, **kwargs):
        self.sink[self.index] = (args, kwargs)
        return hidden_states


class ContextView(nn.Module):
    """``(inputs_embeds, attention_mask, position_ids)`` -> per decoder layer the ``(args,
    kwargs)`` the base model's own forward passes it: masks, rotary tables, position ids, alibi
    biases, whatever the family computes once per forward. ``view`` is the base model with
    :class:`LayerRecorder` layers and an identity final norm (``context_view``)."""

    def __init__(self, view: nn.Module, layers: str):
        super().__init__()
        self.view = view
        self.layers_name = layers

    def forward(self, inputs_embeds, attention_mask=None, position_ids=None) -> list[tuple[tuple, dict]]:
        recorders = getattr(self.view, self.layers_name)
        sink: list = [None] * len(recorders)
        for r in recorders:
            r.__dict__["sink"] = sink
        try:
            self.view(
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        finally:
            for r in recorders:
                r.__dict__["sink"] = None
        return sink


def context_view(base: nn.Module, names: dict[str, str | None]) -> ContextView:
    """The base model run for its per-layer arguments only (``ContextView``). Its embedding is
    never called (the view gets ``inputs_embeds``)."""
    layers = getattr(base, names["layers"])
    replace = {
        names["layers"]: nn.ModuleList([LayerRecorder(layer, i) for i, layer in enumerate(layers)]),
        names["embed"]: _Unused(),
    }
    if names["norm"] is not None:
        replace[names["norm"]] = nn.Identity()
    return ContextView(without_checkpointing(module_view(base, replace)), names["layers"])


class _Unused(nn.Module):
    def forward(self, *args: Any, **kwargs: Any):
        raise RuntimeError("the context view's embedding was called; it is given inputs_embeds")


def logits_view(causal_lm: nn.Module, base_name: str) -> nn.Module:
    """The causal LM whose base model passes the given hidden states through (module docstring);
    ``base_name`` may be a dotted path (a wrapped decoder, which the causal LM calls through)."""
    return replace_at(causal_lm, base_name, PassHidden(causal_lm.get_submodule(base_name)))


def replace_at(module: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """A view of ``module`` whose sub-module at dotted ``path`` is ``new`` (views all the way down,
    so ``module`` and the modules on the path are unchanged)."""
    head, _, rest = path.partition(".")
    child = new if not rest else replace_at(getattr(module, head), rest, new)
    return module_view(module, {head: child})


class _ProbeEmbedding(nn.Module):
    """A deterministic stand-in embedding of width ``hidden`` (no vocabulary-sized table)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        freq = torch.arange(1, self.hidden + 1, dtype=torch.float32) / self.hidden
        return torch.sin(ids.to(torch.float32).unsqueeze(-1) * freq * 3.7 + 0.3)


def _no_grad_eval(fn):
    def run(module: nn.Module, *args):
        was = module.training
        module.eval()
        try:
            with torch.no_grad():
                return fn(module, *args)
        finally:
            module.train(was)

    return run


@_no_grad_eval
def embedding_is_plain(base: nn.Module, names: dict[str, str | None], hidden: int) -> bool:
    """Whether the base model feeds its first layer exactly ``embed_tokens(input_ids)``."""
    probe = _ProbeEmbedding(hidden)
    view = module_view(embedding_view(base, names["layers"], names["rotary"]), {names["embed"]: probe})
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    try:
        out = run_to_first_layer(view, input_ids=ids, use_cache=False)
    except Exception:  # the view cannot run with a stand-in: take the exact (view) path
        return False
    return out.shape == (1, 8, hidden) and torch.equal(out, probe(ids))


@_no_grad_eval
def logits_are_plain(causal_lm: nn.Module, base_name: str, head_name: str, hidden: int) -> str:
    """``"plain"`` when the causal LM's logits are exactly ``lm_head(hidden)``, ``"softcap"`` when
    they are HF's ``tanh(logits / cap) * cap`` with ``config.final_logit_softcapping``, else
    ``"custom"`` (the logits view must run)."""
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden, 8, bias=False)
    head.weight.copy_(torch.randn(8, hidden, generator=gen))
    view = module_view(logits_view(causal_lm, base_name), {head_name: head})
    h = torch.randn(5, hidden, generator=gen)
    try:
        got = ViewLogits(view)(h)
    except Exception:
        return "custom"
    want = head(h)
    if got.shape == want.shape and torch.equal(got, want):
        return "plain"
    cap = getattr(causal_lm.config, "final_logit_softcapping", None)
    if cap and got.shape == want.shape and torch.equal(got, torch.tanh(want / cap) * cap):
        return "softcap"
    return "custom"
