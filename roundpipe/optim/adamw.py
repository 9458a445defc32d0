"""Layer-wise AdamW on the CPU master weights.

One ``torch.optim.AdamW(fused=True)`` per *step group*: the trainable parameters whose gradient
becomes final with the backward of one layer (a parameter belongs to the lowest layer that uses it,
so a tied embedding steps after the embedding's backward, not the head's). Stepping group by group
lets the optimizer run while lower layers are still in backward; the semantics per parameter are
exactly ``torch.optim.AdamW``'s.

That includes a parameter that got no gradient: autograd leaves its ``.grad`` None when it is not
in the step's graph (a LoRA on a module whose weight the model reads directly, a parameter some
batches do not use), and ``torch.optim.AdamW`` then skips it: no weight decay, no moment update, no
step count. The store's fp32 gradient buffer is zero in that case, which is not the same (a zero
gradient still decays the weight and the moments), so each entry says whether a backward produced
a gradient for it (``has_grad``) and only those reach the optimizer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from roundpipe.errors import ConfigError
from roundpipe.optim.low_precision_state import STATE_DTYPES, LowPrecisionStateAdamW, fused_adamw, stepped


class SteppedEntry(Protocol):
    """One tensor as the optimizer sees it (``runtime.store.Entry`` is one): an fp32 ``master``
    stepped in place with its accumulated fp32 ``grad``, grouped by ``owner``. A frozen entry has
    neither; :func:`master_of` and :func:`grad_of` read a trainable one's. ``has_grad``: a backward
    produced a gradient for it since the last step (else ``grad`` is zero and AdamW skips the entry,
    as ``torch.optim.AdamW`` skips a parameter whose ``.grad`` is None)."""

    has_grad: bool

    def discard_grad(self) -> None:
        """The gradient is spent: ``has_grad`` false, ``grad`` reads as zero from now on."""
        ...

    @property
    def key(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def trainable(self) -> bool: ...
    @property
    def master(self) -> torch.Tensor | None: ...
    @property
    def grad(self) -> torch.Tensor | None: ...
    @property
    def owner(self) -> int:
        """The layer whose backward makes the gradient final: the step group."""
        ...


def master_of(e: SteppedEntry) -> torch.Tensor:
    """A trainable entry's fp32 master (the store gives every trainable entry one, and the
    optimizer and the gradient reduction read no other entries)."""
    if e.master is None:
        raise TypeError(f"{e.name} is not trainable: it has no fp32 master")
    return e.master


def grad_of(e: SteppedEntry) -> torch.Tensor:
    """A trainable entry's fp32 gradient accumulator (as :func:`master_of`)."""
    if e.grad is None:
        raise TypeError(f"{e.name} is not trainable: it has no fp32 gradient")
    return e.grad


class MasterStore(Protocol):
    """What the optimizer (and the data-parallel reduction) steps through
    (``runtime.store.ParameterStore`` is one): ``entries[key]``, and a refresh of the copies the
    devices read after the masters changed."""

    @property
    def entries(self) -> Sequence[SteppedEntry]: ...

    def refresh_compute(self, keys, into: int | None = None) -> None: ...


@dataclass(frozen=True)
class OptimizerConfig:
    """``torch.optim.AdamW``'s options that roundpipe takes (one parameter group, ``amsgrad`` and
    ``maximize`` off), plus ``clip_grad_norm_``'s ``max_norm``. Weight decay applies to every
    trainable parameter, as in ``torch.optim.AdamW(model.parameters(), weight_decay=...)``.

    Raises:
        ConfigError: a value torch would reject, or one that is not finite (a NaN or infinite
            setting would not train as the same setting does in torch, or not at all).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None
    state_dtype: str = "fp32"  # the moments' storage (optim/low_precision_state.py)

    def __post_init__(self):
        if not (_finite(self.lr) and self.lr >= 0):
            raise ConfigError(f"lr must be a finite non-negative number, got {self.lr!r}")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(
                f"weight_decay must be a finite number >= 0 (0: no decay), got {self.weight_decay!r}"
            )
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(_finite(b) and 0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), e.g. (0.9, 0.999), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        if not (_finite(self.eps) and self.eps > 0):
            raise ConfigError(f"eps must be a finite number > 0, got {self.eps!r}")
        if self.max_grad_norm is not None and not (_finite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(
                f"max_grad_norm must be a finite number > 0, or None not to clip, got {self.max_grad_norm!r}"
            )
        if self.state_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"state_dtype must be one of {', '.join(STATE_DTYPES)} (AdamW's moments on the host), "
                f"got {self.state_dtype!r}"
            )


def _finite(x) -> bool:
    """A real number (not a bool, a string or a tensor) that is finite."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


class LayerwiseAdamW:
    """Per-layer AdamW steps over a ``MasterStore``. Runs on the host (optimizer) thread."""

    def __init__(self, store: MasterStore, config: OptimizerConfig):
        self.store = store
        self.config = config
        groups: dict[int, list[int]] = {}
        for e in store.entries:
            if e.trainable:
                groups.setdefault(e.owner, []).append(e.key)
        self.groups = groups  # owner layer -> entry keys
        self.optimizers = {
            layer: self._adamw([master_of(store.entries[k]) for k in keys]) for layer, keys in groups.items()
        }

    def _adamw(self, params: list) -> torch.optim.AdamW:
        c = self.config
        options: dict[str, Any] = dict(
            lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=True
        )
        if c.state_dtype != "fp32":
            return LowPrecisionStateAdamW(params, state_dtype=c.state_dtype, **options)
        kind = MetaFusedAdamW if any(p.is_meta for p in params) else torch.optim.AdamW
        return kind(params, **options)

    def step_group(
        self,
        layer: int,
        grad_factor: float = 1.0,
        publish_to: int | None = None,
        part: list[int] | None = None,
    ) -> None:
        """Step the parameters owned by ``layer`` (only the entries ``part``, when given) with their
        accumulated gradients times ``grad_factor``.

        A parameter without a gradient (``has_grad`` false) is handed to ``torch.optim.AdamW`` with
        ``.grad`` None, which leaves it and its state untouched. ``grad_factor`` is applied inside
        the fused kernel (its ``grad_scale``, which divides the gradients as it reads them), not by
        a pass of its own over the gradients. Discards the gradients afterwards (``discard_grad``: read
        as zero, overwritten by the next) and copies the masters
        into compute copy ``publish_to`` (all copies when None) for the uploads that read it next
        (also the untouched ones: in async mode that copy may still hold the weights from before
        the previous update). AdamW steps each parameter on its own, so stepping a group in parts
        is stepping it whole.
        """
        keys = self.groups[layer] if part is None else part
        for k in keys:
            e = self.store.entries[k]
            if e.has_grad:
                master_of(e).grad = grad_of(e)
        optimizer = self.optimizers[layer]
        if grad_factor != 1.0:  # torch's optimizers read the attribute AMP's loss scaler sets
            masters = optimizer.param_groups[0]["params"]
            scale = torch.full((), 1.0 / grad_factor, device=masters[0].device)
            setattr(optimizer, "grad_scale", scale)  # noqa: B010
        try:
            optimizer.step()
        finally:
            setattr(optimizer, "grad_scale", None)  # noqa: B010
        for k in keys:
            e = self.store.entries[k]
            master_of(e).grad = None
            e.discard_grad()
        self.store.refresh_compute(keys, publish_to)

    def grad_norm_sq(self, groups=None) -> float:
        """Squared norm of the gradients of ``groups`` (default: all)."""
        total = 0.0
        for layer in self.groups if groups is None else groups:
            for k in self.groups[layer]:
                g = grad_of(self.store.entries[k])
                total += float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
        return total

    def grads_finite(self, groups=None) -> bool:
        """Whether the gradients of ``groups`` (default: all) are finite (a virtual run's meta
        gradients, without values, are modelled as finite: docs/virtual.md)."""
        return all(
            all_finite(grad_of(self.store.entries[k]))
            for layer in (self.groups if groups is None else groups)
            for k in self.groups[layer]
        )

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers.values():
            for g in opt.param_groups:
                g["lr"] = lr

    def state_dict(self) -> dict:
        """Optimizer state keyed by parameter name (independent of how layers are grouped)."""
        state = {}
        for layer, keys in self.groups.items():
            opt_state = self.optimizers[layer].state
            for k in keys:
                e = self.store.entries[k]
                st = opt_state.get(master_of(e))
                if st:
                    state[e.name] = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()}
        return {"state": state, "config": self.config.__dict__.copy()}

    def load_state_dict(self, sd: dict, groups=None) -> None:
        """Load the state of the parameters of ``groups`` (default: all) found in ``sd``; ``sd`` may
        hold more (a merged sharded checkpoint)."""
        for layer, keys in self.groups.items():
            if groups is not None and layer not in groups:
                continue
            opt = self.optimizers[layer]
            for k in keys:
                e = self.store.entries[k]
                st = sd["state"].get(e.name)
                if st is not None:
                    opt.state[master_of(e)] = {
                        n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()
                    }


def clip_factor(total_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of host tensor ``t`` is finite, in one pass that reads it once:
    ``aminmax`` propagates NaN, and an infinity is an extreme. (``torch.isfinite`` is
    ``(t == t) & (t.abs() != inf)``: four passes and three temporaries, three times the memory
    traffic of the fused AdamW step that follows, measured on the virtual server.) A meta tensor
    (a virtual run) has no values and is modelled finite; its pass still costs its bytes."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return True if t.is_meta else math.isfinite(float(lo)) and math.isfinite(float(hi))


class MetaFusedAdamW(torch.optim.AdamW):
    """The fused AdamW kernel on a virtual run's meta masters (shapes, no data: docs/virtual.md):
    ``torch.optim.AdamW(fused=True)`` refuses the meta device, yet the kernel itself runs there, so
    the virtual server's host work is the same one pass over master, gradient and moments as on a
    real host. Same state as ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq``)."""

    def __init__(self, params, **kwargs):
        kwargs.pop("fused", None)
        super().__init__(params, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        def zero_moments(p):
            return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

        for group in self.param_groups:  # one fused call per group, as torch's
            items = [(p, st) for g, p, st in stepped(self, zero_moments) if g is group]
            if items:
                steps = [st["step"] for _, st in items]
                torch._foreach_add_(steps, 1)
                fused_adamw(
                    [p for p, _ in items], [p.grad for p, _ in items], [st["exp_avg"] for _, st in items],
                    [st["exp_avg_sq"] for _, st in items], steps, group, getattr(self, "grad_scale", None),
                )  # fmt: skip
