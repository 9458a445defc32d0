"""The MoE router's load-balancing (auxiliary) loss, added to the LM loss as HF adds it.

With ``config.output_router_logits=True`` a HF MoE causal LM returns ``loss = cross-entropy +
router_aux_loss_coef * aux``, where ``load_balancing_loss_func`` of its modeling file takes the
router logits of every MoE layer over the whole batch (padding masked out) and computes

    aux = E * sum_e (C_e / N) * (S_e / N)

with ``C_e`` the top-k choices of expert ``e`` (from ``softmax(logits)``), ``S_e`` the sum of its
routing probabilities, ``N`` the rows (valid tokens times MoE layers) and ``E`` the expert count.
``C`` is a count (no gradient flows through it) and the loss is linear in ``S``, so the loss splits
exactly into one term per layer and microbatch once the *batch's* ``C`` and ``N`` are known:

    term(layer, microbatch) = coef * E / N**2 * sum_e C_e * S_e(layer, microbatch)

which is how the runtime computes it. Every forward of the step contributes to ``C`` and ``N``,
so no backward may start before every forward has run (``schedule.check.runs_forwards_first``):
the planner keeps to schedules that allow that. The value and the gradient equal HF's to
round-off (``verify.verify_adapter`` checks the loss against the model's own forward at wrap time).

What the router emits is read from the model as HF's output capturing reads it: the
``_can_record_outputs["router_logits"]`` recorder names the router's module class (and which of its
outputs are the logits); the expert count, top-k and coefficient are the causal LM's own
``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.errors import UnsupportedModel


@dataclass(frozen=True)
class RouterLoss:
    """How one model's load-balancing loss is computed.

    ``routers[i]``: the names (inside decoder layer ``i``'s module) of its router modules, whose
    output ``index`` holds their logits; a layer without a router (a dense layer of a DeepSeek- or
    Qwen2-MoE-style model) has none.
    """

    num_experts: int
    top_k: int
    coef: float
    index: int
    routers: tuple[tuple[str, ...], ...]

    @property
    def width(self) -> int:
        """Length of a stats vector: ``C`` (E), ``S`` (E), ``N`` (1)."""
        return 2 * self.num_experts + 1

    def stats(self, logits: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """One layer's ``[C, S, N]`` (fp32, no gradient) for one microbatch, from its routers' logits."""
        out: torch.Tensor | None = None
        with torch.no_grad():
            for g in logits:
                probs = torch.softmax(g.reshape(-1, g.shape[-1]), dim=-1)
                _, chosen = torch.topk(probs, self.top_k, dim=-1)
                w = _row_weights(mask, probs)
                counts = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device)
                counts.scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(self.top_k))
                s = (probs.float() * w.unsqueeze(-1)).sum(dim=0)
                one = torch.cat([counts, s, w.sum().reshape(1)])
                out = one if out is None else out + one
        if out is None:
            raise ValueError("router statistics need the logits of at least one router")
        return out

    def weights(self, totals: torch.Tensor) -> torch.Tensor:
        """``coef * E * C / N**2`` from the batch's ``[C, S, N]``: each expert's weight on ``S``."""
        e = self.num_experts
        return self.coef * e * totals[:e] / totals[2 * e] ** 2

    def term(
        self, logits: list[torch.Tensor], mask: torch.Tensor | None, weights: torch.Tensor
    ) -> torch.Tensor:
        """One layer's differentiable share of ``coef * aux`` for one microbatch."""
        total: torch.Tensor | None = None
        for g in logits:
            probs = torch.softmax(g.reshape(-1, g.shape[-1]), dim=-1)
            s = (probs.float() * _row_weights(mask, probs).unsqueeze(-1)).sum(dim=0)
            t = (s * weights).sum()
            total = t if total is None else total + t
        if total is None:
            raise ValueError("a router loss term needs the logits of at least one router")
        return total

    def value(self, totals: torch.Tensor) -> float:
        """``coef * aux`` of the batch from its ``[C, S, N]`` (host tensor)."""
        e = self.num_experts
        n = totals[2 * e]
        return float(self.coef * e * ((totals[:e] / n) * (totals[e : 2 * e] / n)).sum())


def _row_weights(mask: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    return mask.reshape(-1).to(torch.float32)


class capture_router_logits:  # noqa: N801 (a context manager used like a function)
    """Within ``with capture_router_logits(module, names, index) as got:``, every output ``index``
    of the router modules ``names`` of ``module`` is appended to ``got`` (hooks removed on exit)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...], index: int):
        self.module, self.names, self.index = module, names, index
        self.got: list[torch.Tensor] = []
        self._hooks: list = []

    def __enter__(self) -> list[torch.Tensor]:
        def hook(_mod, _args, output):
            self.got.append(output[self.index] if isinstance(output, (tuple, list)) else output)

        self._hooks = [self.module.get_submodule(n).register_forward_hook(hook) for n in self.names]
        return self.got

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def find_router_loss(causal_lm: nn.Module, config: Any, blocks: list[nn.Module]) -> RouterLoss | None:
    """The model's load-balancing loss (None when ``config.output_router_logits`` is off).

    Raises:
        UnsupportedModel: the config asks for it but the model does not say how HF computes it
            (routing recorded from several kinds of module, no router found in any layer, or no
            expert count / top-k / coefficient on the causal LM); the message says to set
            ``output_router_logits=False``. A modeling file without ``load_balancing_loss_func``
            adds no such loss to its forward: None, and the wrap-time check holds us to that.
    """
    if not getattr(config, "output_router_logits", False):
        return None
    kind = type(causal_lm).__name__

    def refuse(why: str) -> UnsupportedModel:
        return UnsupportedModel(
            f"{kind}: config.output_router_logits=True adds a router load-balancing loss, but {why}; "
            "set model.config.output_router_logits = False to train without it"
        )

    module = sys.modules.get(type(causal_lm).__module__)
    if getattr(module, "load_balancing_loss_func", None) is None:
        return None  # its forward adds no such loss (DeepSeek-V3, GLM-4-MoE, Llama 4): nor do we
    recorder = (getattr(causal_lm, "_can_record_outputs", None) or {}).get("router_logits")
    if (
        recorder is None
        or isinstance(recorder, (list, tuple))
        or getattr(recorder, "target_class", None) is None
    ):
        raise refuse(
            "its router logits are not recorded from one kind of router module (HF's _can_record_outputs)"
        )
    target, layer_name = recorder.target_class, getattr(recorder, "layer_name", None)
    wanted = None if layer_name is None else "." + layer_name.strip(".") + "."
    routers = tuple(
        tuple(
            n
            for n, m in block.named_modules()
            if n and isinstance(m, target) and (wanted is None or wanted in "." + n + ".")
        )
        for block in blocks
    )
    if not any(routers):
        raise refuse(f"no decoder layer holds a {target.__name__}")
    facts: dict[str, Any] = {
        a: getattr(causal_lm, a, None) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    }
    missing = [a for a, v in facts.items() if v is None]
    if missing:
        raise refuse(f"the causal LM has no {', '.join(missing)}")
    return RouterLoss(
        num_experts=int(facts["num_experts"]),
        top_k=int(facts["num_experts_per_tok"]),
        coef=float(facts["router_aux_loss_coef"]),
        index=int(getattr(recorder, "index", 0) or 0),
        routers=routers,
    )
