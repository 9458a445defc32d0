"""Views of a HF model's own forward code, for the steps between its parts that families differ in.

What a family does between ``embed_tokens`` and the first decoder layer (Gemma's normaliser,
Granite's embedding multiplier, a learned position table) and between the last layer's output and
the logits (Granite's and Cohere's logit scaling, MiniCPM's hidden-state scaling, softcapping) is
written in its base model's and causal LM's ``forward``. Instead of re-typing each formula, the
adapter runs that code itself, on a *view*: a new module object of the same class whose
sub-modules are the model's own, with the parts another layer runs replaced by stand-ins:

- the **embedding view** is the base model with no decoder layers, an identity final norm and a
  rotary module that returns nothing: its forward maps ``input_ids`` to exactly what the first
  decoder layer receives.
- the **logits view** is the causal LM whose base model hands its ``inputs_embeds`` straight
  through: its forward maps final-normed hidden states to exactly the logits HF's loss sees.

Probes (:func:`embedding_is_plain`, :func:`logits_are_plain`) run these views with stand-in weights
(no real weight is read, so a model on the meta device can be probed) to find out whether a family
adds anything at all; only then does the adapter use a view, so families that add nothing keep the
direct path (and the vocabulary-sharded head).
"""

from __future__ import annotations

import functools
import math
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
    for name, child in replace.items():
        if name not in view._modules:
            raise KeyError(f"{type(module).__name__} has no child module {name!r}")
        view._modules[name] = child
    return view


class Silent(nn.Module):
    """Stands in for a rotary module whose tables no layer of the view uses: returns None."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class PassHidden(nn.Module):
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


def embedding_view(base: nn.Module, layers: str, norm: str, rotary: str | None) -> nn.Module:
    """The base model without its decoder layers, final norm or rotary tables (module docstring)."""
    replace = {layers: nn.ModuleList(), norm: nn.Identity()}
    if rotary is not None:
        replace[rotary] = Silent()
    return module_view(base, replace)


def logits_view(causal_lm: nn.Module, base_name: str) -> nn.Module:
    """The causal LM whose base model passes the given hidden states through (module docstring)."""
    return module_view(causal_lm, {base_name: PassHidden()})


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
    view = module_view(
        embedding_view(base, names["layers"], names["norm"], names["rotary"]), {names["embed"]: probe}
    )
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    try:
        out = view(input_ids=ids, use_cache=False).last_hidden_state
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


def same_within(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(whether ``a`` matches ``b`` beyond round-off of ``dtype``, max abs difference, tolerance):
    the tolerance scales with ``b``'s magnitude and the dtype's epsilon."""
    if a.shape != b.shape:
        return False, math.inf, 0.0
    a, b = a.double(), b.double()
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    tol = 64 * eps * (float(b.abs().max()) + 1.0)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff <= tol, diff, tol
