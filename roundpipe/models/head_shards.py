"""The LM head + loss cut into vocabulary shards that run as separate layers, with exact results.

Why: the LM head of a large-vocabulary model is often the most expensive layer; as one layer it
makes one pipeline stage much longer than the others. With ``head_shards=k`` the head becomes k
layers ``head.0 .. head.{k-1}``, shard ``j`` owning the contiguous vocabulary rows
``vocab_ranges(V, k)[j]``, so the partitioner can place them like any other layer.

The hand-off between shards (the one tensor the runtime moves) is a *packed* fp32 tensor
``[b, T, H + 2]``:

- ``[..., :H]``: the final-normed hidden states (values of the run-dtype tensor; exact in fp32),
- ``[..., H]`` (``LSE``): the log-sum-exp of the logits of the shards run so far,
- ``[..., H + 1]`` (``TARGET``): the label's logit if the label fell in a shard run so far, else 0.

``head.0`` takes the last block's hidden states ``[b, T, H]`` (run dtype), applies the final norm
and emits the packed tensor; a middle shard maps packed -> packed; the last shard returns the 0-dim
fp32 **sum** of ``LSE - TARGET`` over the label tokens, the same loss sum the single ``head``
layer returns (HF's ``ForCausalLMLoss`` times the label count). The logits of a shard are HF's:
``lm_head`` rows in the run dtype, softcapping (gemma2/3) in the run dtype, then fp32.

The math, per token with label ``y`` and fp32 logits ``z``. Forward: shard ``s`` computes
``lse_s = log sum_{v in s} exp(z_v)`` and ``t_s = z_y if y in s else 0`` (``_ShardStats``), and the
layer combines ``LSE <- logaddexp(LSE, lse_s)``, ``TARGET <- TARGET + t_s`` in plain autograd.
The loss is ``LSE_final - TARGET_final = log sum_v exp(z_v) - z_y``, exactly cross-entropy.
Backward: autograd through the combines gives ``dL/dlse_s = g * exp(lse_s - LSE_final)`` and
``dL/dt_s = -g`` (``g`` the loss's incoming gradient, 0 on ignored tokens); ``_ShardStats.backward``
then forms ``dL/dz_v = dL/dlse_s * exp(z_v - lse_s) + dL/dt_s * [v == y]``, i.e. ``g * (softmax(z)_v
- [v == y])`` with the *global* softmax, recomputing each chunk's logits from the saved hidden
states and backpropagating that chunk gradient through the head. What autograd keeps between
forward and backward is ``[tokens x H]`` and ``[tokens]``-sized (plus references to the weights),
never ``[tokens x vocab]``: at most one chunk's logits exist at a time, in forward and in backward.
Because backward recomputes, forward and backward need not run back to back.

Supported heads (``head_tensors``): ``nn.Linear`` (its weight may be the tied embedding weight),
peft LoRA ``Linear`` on ``lm_head`` (plain LoRA, no dropout, no DoRA or other variants), and peft's
``modules_to_save`` wrapper around a Linear. Every shard's module holds the whole, shared
Parameters; a shard computes from either the whole head (then it slices its rows at compute time and
the gradient of a row-sliced Parameter is zero outside them) or a head already cut to its rows (what
the runtime uploads: ``HeadShardLayer.row_slices`` names those tensors, so a device holds and sends
back only the shard's rows). ``shard_stats`` tells the two apart by the row count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from roundpipe.errors import ConfigError, InputError, UnsupportedModel
from roundpipe.models.head import gather_positions

IGNORE_INDEX = -100
STATS = 2  # fp32 statistics after the hidden states in the packed tensor: LSE, TARGET
LSE, TARGET = 0, 1  # their offsets after the hidden states


def vocab_ranges(vocab: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges of ``shards`` near-equal shards of ``vocab`` rows.

    The first ``vocab % shards`` shards get one extra row (as ``partition.cost`` assumes).

    Raises:
        ConfigError: ``shards`` is not an int in ``1..vocab``.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= vocab:
        raise ConfigError(
            f"head_shards must be an int in 1..{vocab} (the vocabulary size), got {shards!r}; "
            f"use head_shards=1 for a single head layer"
        )
    base, extra = divmod(vocab, shards)
    ranges, start = [], 0
    for j in range(shards):
        stop = start + base + (1 if j < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


# --- what an LM head computes, as explicit tensors --------------------------------------------------


@dataclass(frozen=True)
class _Lora:
    """One active peft LoRA adapter: ``delta = lora_B(lora_A(x)) * scaling``."""

    a_weight: torch.Tensor  # [r, H]
    a_bias: torch.Tensor | None
    b_weight: torch.Tensor  # [V, r]  (row-sliced per shard)
    b_bias: torch.Tensor | None  # [V]  (row-sliced per shard)
    scaling: float
    cast_input: bool  # peft casts the input to lora_A's dtype


@dataclass(frozen=True)
class HeadTensors:
    """The tensors an LM head computes its logits from, so a shard can use rows ``[v0, v1)``.

    ``logits(hidden) = hidden @ weight.T + bias + sum over LoRA adapters of ((hidden @ A.T + a_bias)
    @ B.T + b_bias) * scaling``, computed the way the HF / peft module computes it (same dtypes, same
    order), then softcapped and cast to fp32 as HF's loss does.
    """

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]
    loras: tuple[_Lora, ...] = ()

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    def flat(self) -> list[tuple[torch.Tensor | None, bool]]:
        """Every tensor (None where absent) with whether it is row-sliced per shard; fixed order."""
        out: list[tuple[torch.Tensor | None, bool]] = [(self.weight, True), (self.bias, True)]
        for lora in self.loras:
            out += [(lora.a_weight, False), (lora.a_bias, False), (lora.b_weight, True), (lora.b_bias, True)]
        return out

    def with_tensors(self, tensors: list[torch.Tensor | None]) -> HeadTensors:
        """The same head computed from ``tensors`` (in ``flat()`` order) instead."""
        weight, bias, *rest = tensors
        loras = tuple(
            _Lora(*rest[4 * i : 4 * i + 4], scaling=lora.scaling, cast_input=lora.cast_input)
            for i, lora in enumerate(self.loras)
        )
        return HeadTensors(weight, bias, loras)

    def rows(self, start: int, stop: int) -> HeadTensors:
        """The head restricted to vocabulary rows ``[start, stop)`` (views, no copies)."""
        return self.with_tensors(
            [None if t is None else (t[start:stop] if sliced else t) for t, sliced in self.flat()]
        )

    def logits(self, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
        """fp32 logits ``[n, rows]`` of ``hidden`` [n, H]: HF's head, softcap, then ``.float()``."""
        out = F.linear(hidden, self.weight, self.bias)
        if self.loras:
            out_dtype = out.dtype
            for lora in self.loras:
                x = hidden.to(lora.a_weight.dtype) if lora.cast_input else hidden
                delta = F.linear(F.linear(x, lora.a_weight, lora.a_bias), lora.b_weight, lora.b_bias)
                out = out + delta * lora.scaling
            out = out.to(out_dtype)
        if softcap is not None:
            out = torch.tanh(out / softcap) * softcap
        return out.float()


def _refuse(what: str, alternative: str = "") -> UnsupportedModel:
    return UnsupportedModel(
        f"the vocabulary-sharded LM head cannot compute row slices of {what}; it supports an "
        f"nn.Linear lm_head (tied or not), a peft LoRA Linear on lm_head (no dropout, no DoRA or "
        f"other LoRA variants) and peft modules_to_save around a Linear. Use head_shards=1 (one head "
        f"layer runs any lm_head module){alternative}"
    )


def head_tensors(lm_head: nn.Module) -> HeadTensors:
    """The tensors of ``lm_head`` as the sharded head uses them (see module docstring).

    Raises:
        UnsupportedModel: ``lm_head`` is none of the supported kinds; the message says to use
            ``head_shards=1``.
    """
    lora_linear, modules_to_save = _peft_classes()
    if type(lm_head) is nn.Linear:
        return HeadTensors(lm_head.weight, lm_head.bias)
    if modules_to_save is not None and isinstance(lm_head, modules_to_save):
        active = list(lm_head.active_adapters)
        adapters = getattr(lm_head, "_adapters", ())
        if lm_head.disable_adapters or not active or any(a not in adapters for a in active):
            return head_tensors(lm_head.original_module)
        return head_tensors(lm_head.modules_to_save[active[0]])
    if lora_linear is not None and isinstance(lm_head, lora_linear):
        base = lm_head.base_layer
        if type(base) is not nn.Linear:
            raise _refuse(f"a LoRA layer around {type(base).__name__}")
        if lm_head.disable_adapters and lm_head.merged:
            raise _refuse("a disabled but merged LoRA lm_head (peft would unmerge it in forward)")
        if lm_head.disable_adapters or lm_head.merged:
            return HeadTensors(base.weight, base.bias)
        loras = []
        for name in lm_head.active_adapters:
            if name not in lm_head.lora_A:
                continue
            if name in getattr(lm_head, "lora_variant", {}) or getattr(lm_head, "use_dora", {}).get(name):
                raise _refuse(f"a LoRA variant (e.g. DoRA) lm_head adapter {name!r}")
            dropout = lm_head.lora_dropout[name]
            if not isinstance(dropout, nn.Identity) and not (
                isinstance(dropout, nn.Dropout) and dropout.p == 0
            ):
                raise _refuse(
                    f"a LoRA lm_head with dropout (adapter {name!r})",
                    ", or train lm_head with lora_dropout=0.0",
                )
            lora_a, lora_b = lm_head.lora_A[name], lm_head.lora_B[name]
            if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
                raise _refuse(f"LoRA adapter {name!r} whose A/B are not nn.Linear")
            loras.append(
                _Lora(
                    lora_a.weight,
                    lora_a.bias,
                    lora_b.weight,
                    lora_b.bias,
                    scaling=float(lm_head.scaling[name]),
                    cast_input=bool(getattr(lm_head, "cast_input_dtype_enabled", True)),
                )
            )
        return HeadTensors(base.weight, base.bias, tuple(loras))
    raise _refuse(f"a {type(lm_head).__name__} lm_head")


def _peft_classes() -> tuple[type | None, type | None]:
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # peft is optional: without it no head can be a peft module
        return None, None
    return LoraLinear, ModulesToSaveWrapper


# --- per-shard statistics -------------------------------------------------------------------------


def _local_labels(labels: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as row indices of the shard ``[start, start + size)`` (clamped) and whether inside."""
    local = labels - start
    inside = (local >= 0) & (local < size)
    return local.clamp(0, size - 1), inside


def _stats(
    hidden: torch.Tensor, labels: torch.Tensor, rows: HeadTensors, start: int, softcap, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse_s, t_s)`` [n] fp32 of the shard ``rows`` (first row ``start``), one chunk at a time."""
    n, size = hidden.shape[0], rows.vocab
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    target = torch.empty(n, dtype=torch.float32, device=hidden.device)
    for lo in range(0, n, chunk_tokens):
        hi = min(lo + chunk_tokens, n)
        logits = rows.logits(hidden[lo:hi], softcap)
        lse[lo:hi] = torch.logsumexp(logits, dim=-1)
        local, inside = _local_labels(labels[lo:hi], start, size)
        picked = logits.gather(1, local[:, None]).squeeze(1)
        target[lo:hi] = torch.where(inside, picked, torch.zeros_like(picked))
        del logits
    return lse, target


class _ShardStats(torch.autograd.Function):
    """``(lse_s, t_s)`` of one vocabulary shard; backward recomputes chunk logits (see module doc).

    ``forward(hidden [n, H], labels [n], rows, start, softcap, chunk_tokens, *params)``: ``rows``
    is the head restricted to the shard's rows (first row ``start`` of the vocabulary); ``params``
    are its tensors that require grad (in ``rows.flat()`` order), inputs only so that autograd
    routes their gradients: each gets a gradient of its own shape (a row slice taken from a whole
    Parameter passes it on through autograd's slice backward).
    """

    @staticmethod
    def forward(ctx, hidden, labels, rows, start, softcap, chunk_tokens, *params):
        lse, target = _stats(hidden, labels, rows, start, softcap, chunk_tokens)
        ctx.rows = rows.with_tensors([None if t is None else t.detach() for t, _ in rows.flat()])
        ctx.trainable = [t is not None and t.requires_grad for t, _ in rows.flat()]
        ctx.start, ctx.softcap, ctx.chunk_tokens = start, softcap, chunk_tokens
        ctx.save_for_backward(hidden, labels, lse)
        return lse, target

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse, grad_target):
        hidden, labels, lse = ctx.saved_tensors
        start, softcap = ctx.start, ctx.softcap
        need_hidden = ctx.needs_input_grad[0]
        need_params = ctx.needs_input_grad[6:]
        leaves = [
            None if t is None else t.detach().requires_grad_(grad)
            for (t, _), grad in zip(ctx.rows.flat(), ctx.trainable)
        ]
        rows = ctx.rows.with_tensors(leaves)
        wanted = [leaf for leaf, grad in zip(leaves, ctx.trainable) if grad]
        grad_hidden = (
            torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        )
        grad_leaves = [torch.zeros_like(leaf, dtype=torch.float32) for leaf in wanted]
        n, size = hidden.shape[0], rows.vocab
        for lo in range(0, n, ctx.chunk_tokens):
            hi = min(lo + ctx.chunk_tokens, n)
            with torch.enable_grad():
                chunk = hidden[lo:hi].detach().requires_grad_(need_hidden)
                logits = rows.logits(chunk, softcap)
            with torch.no_grad():
                # dL/dz = dL/dlse_s * softmax_s(z) + dL/dt_s * onehot(y): the global softmax - onehot.
                grad_logits = torch.exp(logits - lse[lo:hi, None]) * grad_lse[lo:hi, None]
                local, inside = _local_labels(labels[lo:hi], start, size)
                on_target = torch.where(inside, grad_target[lo:hi], torch.zeros_like(grad_target[lo:hi]))
                grad_logits.scatter_add_(1, local[:, None], on_target[:, None])
            wrt = ([chunk] if need_hidden else []) + wanted
            grads = list(torch.autograd.grad(logits, wrt, grad_logits, allow_unused=True))
            del logits, grad_logits
            if need_hidden:
                grad_hidden[lo:hi] = grads.pop(0)
            for buffer, grad in zip(grad_leaves, grads):
                if grad is not None:
                    buffer += grad
        grad_params = [
            buffer.to(leaf.dtype) if need else None
            for buffer, leaf, need in zip(grad_leaves, wanted, need_params)
        ]
        grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype)
        return (grad_hidden, None, None, None, None, None, *grad_params)


def _shard_rows(head: HeadTensors, vocab_range: tuple[int, int]) -> HeadTensors:
    """``head`` restricted to the rows ``vocab_range``: sliced from a whole head (views), or ``head``
    itself when it already holds exactly that many rows (a shard's upload; see module docstring).

    Raises:
        UnsupportedModel: a row-sliced tensor has neither the shard's row count nor room for it.
    """
    start, stop = vocab_range
    size = stop - start
    if head.vocab == size:
        rows = head
    elif head.vocab >= stop:
        rows = head.rows(start, stop)
    else:
        rows = None
    if rows is None or any(t is not None and t.shape[0] != size for t, sliced in rows.flat() if sliced):
        shapes = [tuple(t.shape) for t, sliced in head.flat() if sliced and t is not None]
        raise UnsupportedModel(
            f"the vocabulary shard of rows [{start}, {stop}) needs an LM head whose row-sliced tensors "
            f"all have either the whole vocabulary (>= {stop} rows) or exactly its {size} rows, got "
            f"{shapes}; was the head resized after adapt_model / wrap? Wrap the model again"
        )
    return rows


def shard_stats(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: HeadTensors,
    vocab_range: tuple[int, int],
    *,
    chunk_tokens: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-sum-exp and target logit of the vocabulary rows ``vocab_range`` of ``head``.

    Args:
        hidden: [n, H] final-normed hidden states in the dtype the head's weight expects.
        labels: [n] int64 targets (already shifted, vocabulary ids); -100 or a label outside the
            range gives 0.
        head: ``head_tensors(lm_head)`` of the whole head, or of a head whose row-sliced tensors
            hold only the ``stop - start`` rows of this shard.
        vocab_range: ``(start, stop)`` rows of this shard.
        chunk_tokens: tokens per chunk; at most ``chunk_tokens x (stop - start)`` logits exist.
        softcap: ``final_logit_softcapping`` or None.

    Returns:
        ``(lse, target)``, each [n] fp32, differentiable w.r.t. ``hidden`` and the head's trainable
        tensors (the gradient work happens in backward, chunk by chunk).
    """
    start = vocab_range[0]
    rows = _shard_rows(head, vocab_range)  # with grad on, slices of whole Parameters stay in the graph
    params = [t for t, _ in rows.flat() if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and (hidden.requires_grad or params):
        return _ShardStats.apply(hidden, labels, rows, start, softcap, chunk_tokens, *params)
    with torch.no_grad():
        return _stats(hidden, labels, rows, start, softcap, chunk_tokens)


# --- one shard as a layer -------------------------------------------------------------------------


def vocab_shard_forward(
    x: torch.Tensor,
    shift_labels: torch.Tensor | None,
    lm_head: nn.Module,
    *,
    vocab_range: tuple[int, int],
    vocab: int,
    first: bool,
    last: bool,
    chunk_tokens: int,
    softcap: float | None = None,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    positions: torch.Tensor | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Run one vocabulary shard of the head + loss (see the module docstring for the format).

    Args:
        x: ``first``: hidden [b, T, H] of the last block in the run dtype (``norm`` is applied);
            otherwise the packed fp32 [b, T, H + 2] of the previous shard.
        shift_labels: [b, T] targets shifted left (-100 ignored).
        lm_head: the head module, or a device shell of it whose row-sliced tensors may hold only
            this shard's rows (see ``head_tensors`` and ``shard_stats``).
        vocab_range: ``(start, stop)`` rows of the vocabulary this shard owns.
        vocab: the whole vocabulary's size (labels must lie in ``[0, vocab)``).
        first, last: whether this is ``head.0`` / ``head.{k-1}``.
        chunk_tokens: tokens per chunk (> 0).
        softcap: ``final_logit_softcapping`` (gemma2/3), or None.
        norm: the final norm (only with ``first``).
        positions: int64 flat indices of the tokens whose label is not -100
            (``base.loss_positions``): only they get logits; the others keep ``LSE = TARGET = 0``,
            which the last shard masks out. The packed tensor keeps every token, so the hand-off
            between shards does not depend on the labels. None: every token is computed.
        check_labels: the first shard checks that the labels lie in the vocabulary (reading them);
            the pipeline, which checked them on the host already, passes False: on a device that
            read would be a host sync.

    Returns:
        ``last``: the 0-dim fp32 loss sum over the label tokens; else the packed fp32 [b, T, H + 2].
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ConfigError(f"head_chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if shift_labels is None:
        raise InputError("the head computes the loss and needs labels; pass labels with the batch")
    head = head_tensors(lm_head)
    if first:
        hidden = norm(x) if norm is not None else x
        size = hidden.shape[-1]
        lse_prev = target_prev = None
    else:
        size = x.shape[-1] - STATS
        if x.dtype != torch.float32 or size != head.weight.shape[-1]:
            raise InputError(
                f"a vocabulary shard after the first expects the packed fp32 [b, T, H + {STATS}] tensor "
                f"of the previous shard (H = {head.weight.shape[-1]}), got {tuple(x.shape)} {x.dtype}"
            )
        hidden = x[..., :size].to(head.weight.dtype)
        lse_prev, target_prev = x[..., size + LSE], x[..., size + TARGET]
    if shift_labels.shape != hidden.shape[:-1]:
        raise InputError(
            f"labels of shape {tuple(shift_labels.shape)} do not match hidden states of shape "
            f"{tuple(hidden.shape)}; labels must be [batch, seq] like input_ids"
        )
    if first and check_labels:
        bad = (shift_labels != IGNORE_INDEX) & ((shift_labels < 0) | (shift_labels >= vocab))
        if bool(bad.any()):
            raise InputError(f"labels must be -100 or lie in [0, {vocab}) (the LM head's rows)")
    if positions is None:
        flat_hidden, flat_labels = hidden.reshape(-1, size), shift_labels.reshape(-1)
    else:
        flat_hidden, flat_labels = gather_positions(hidden, shift_labels, positions)
    lse, target = shard_stats(
        flat_hidden, flat_labels, head, vocab_range, chunk_tokens=chunk_tokens, softcap=softcap
    )
    if positions is not None:  # back to every token: zeros where the label is ignored
        every = torch.zeros(shift_labels.numel(), dtype=lse.dtype, device=lse.device)
        lse, target = every.index_copy(0, positions, lse), every.index_copy(0, positions, target)
    lse, target = lse.view(shift_labels.shape), target.view(shift_labels.shape)
    if not first:
        lse = torch.logaddexp(lse_prev, lse)
        target = target_prev + target
    if last:
        per_token = lse - target
        return torch.where(shift_labels != IGNORE_INDEX, per_token, torch.zeros_like(per_token)).sum()
    carried = hidden.float() if first else x[..., :size]
    return torch.cat([carried, lse.unsqueeze(-1), target.unsqueeze(-1)], dim=-1)
