"""The LM head + cross-entropy, in token chunks, so full-vocabulary logits never exist at once.

For a 150k-token vocabulary, the logits of one 4k-token microbatch take 2.4 GB in fp32, and plain
autograd would keep them (plus their softmax) alive until backward. Here the head runs chunk by
chunk: for each chunk of ``chunk_tokens`` tokens it computes the logits, the summed cross-entropy
and, at once, the gradients of that sum with respect to the chunk's hidden states and the head's
trainable tensors; then the logits are dropped. Backward only scales those stored gradients by the
incoming gradient. Peak extra memory is one chunk's logits; what autograd saves is ``[tokens x H]``
(the hidden-state gradient) plus one fp32 buffer per trainable head tensor -- never ``[tokens x V]``.

This matches HF's ``ForCausalLMLoss`` token for token: logits from ``lm_head`` in the run dtype,
optional softcapping (``tanh(logits / cap) * cap``) in the run dtype, then ``logits.float()`` and
cross-entropy with ``ignore_index=-100``. The result is a *sum* (0-dim fp32); the caller divides.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from roundpipe.errors import ConfigError, InputError

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position of ``labels`` [b, T] (HF, unshifted): the next token's label;
    the last position of a row predicts nothing (-100)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()


def gather_positions(
    hidden: torch.Tensor, shift_labels: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [..., H] and ``shift_labels`` [...] flattened to the rows ``positions`` names.

    Differentiable: the gradient of the gathered rows lands back on those rows of ``hidden``, the
    other rows get zero.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    return flat_hidden, shift_labels.reshape(-1).index_select(0, positions)


def _chunk_loss_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None):
    """Summed fp32 cross-entropy of ``hidden`` [n, H] against ``labels`` [n]; exactly HF's math."""
    logits = lm_head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedHeadLoss(torch.autograd.Function):
    """Loss sum whose gradients are computed chunk by chunk during forward (see module docstring).

    ``forward(hidden, shift_labels, lm_head, softcap, chunk_tokens, *params)``: ``params`` are the
    trainable tensors of ``lm_head``; they are inputs only so that autograd routes their gradients.
    """

    @staticmethod
    def forward(ctx, hidden, shift_labels, lm_head, softcap, chunk_tokens, *params):
        hidden_needs_grad = hidden.requires_grad
        flat_hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        flat_labels = shift_labels.reshape(-1)
        n_tokens = flat_hidden.shape[0]
        grad_hidden = (
            torch.zeros(flat_hidden.shape, dtype=torch.float32, device=hidden.device)
            if hidden_needs_grad
            else None
        )
        # The first chunk's gradient becomes the accumulator (one vocabulary x hidden buffer per
        # parameter, as plain autograd makes, not a zeroed one plus a copy).
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_tokens, chunk_tokens):
            stop = min(start + chunk_tokens, n_tokens)
            with torch.enable_grad():
                chunk = flat_hidden[start:stop].detach().requires_grad_(hidden_needs_grad)
                chunk_loss = _chunk_loss_sum(lm_head, chunk, flat_labels[start:stop], softcap)
            wrt = ([chunk] if hidden_needs_grad else []) + list(params)
            grads = list(torch.autograd.grad(chunk_loss, wrt, allow_unused=True))
            if grad_hidden is not None:  # the hidden state needs its gradient
                grad_hidden[start:stop] = grads.pop(0)
            for i, grad in enumerate(grads):
                if grad is None:
                    continue
                acc = grad_params[i]
                if acc is None:
                    grad_params[i] = grad.float()  # no copy when already fp32
                else:
                    acc += grad
            loss_sum += chunk_loss.detach()
        ctx.hidden_shape, ctx.hidden_dtype = hidden.shape, hidden.dtype
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.hidden_needs_grad = hidden_needs_grad
        grad_params = [
            torch.zeros_like(p, dtype=torch.float32) if g is None else g for p, g in zip(params, grad_params)
        ]
        ctx.save_for_backward(*([grad_hidden] if hidden_needs_grad else []), *grad_params)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place: the saved gradients belong to this node alone and are used once (a
        # second backward through a retained graph fails autograd's saved-tensor version check
        # instead of returning a twice-scaled gradient).
        saved = list(ctx.saved_tensors)
        grad_hidden = None
        if ctx.hidden_needs_grad:
            grad_hidden = saved.pop(0).mul_(grad_loss).to(ctx.hidden_dtype).reshape(ctx.hidden_shape)
        grad_params = [g.mul_(grad_loss).to(dtype) for g, dtype in zip(saved, ctx.param_dtypes)]
        return (grad_hidden, None, None, None, None, *grad_params)


def chunked_lm_loss(
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    lm_head: nn.Module,
    *,
    chunk_tokens: int,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``lm_head(hidden)`` against ``shift_labels``.

    Args:
        hidden: [b, T, H] (or [n, H]) final-normed hidden states in the run dtype.
        shift_labels: [b, T] (or [n]) int64 targets already shifted left; -100 is ignored.
        lm_head: any module mapping [n, H] -> [n, V] (a Linear, a peft LoRA Linear, a
            ``modules_to_save`` wrapper, ...); called as a black box, once per chunk.
        chunk_tokens: tokens per chunk (> 0); at most ``chunk_tokens x V`` logits exist at a time.
        softcap: ``final_logit_softcapping`` (gemma2/3), or None.
        positions: int64 flat indices of the tokens whose label is not -100
            (``base.loss_positions``); only they get logits. The others add nothing to the sum and
            get a zero gradient either way. None: every token is computed.

    Returns:
        0-dim fp32 loss sum, differentiable w.r.t. ``hidden`` and the trainable tensors of
        ``lm_head``. The gradient work runs inside this call only when grad mode is on and something
        requires grad; otherwise the loss is computed chunk by chunk without a graph.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ConfigError(f"head_chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if shift_labels.shape != hidden.shape[:-1]:
        raise InputError(
            f"labels of shape {tuple(shift_labels.shape)} do not match hidden states of shape "
            f"{tuple(hidden.shape)}; labels must be [batch, seq] like input_ids"
        )
    if positions is not None:
        hidden, shift_labels = gather_positions(hidden, shift_labels, positions)
    params = [p for p in lm_head.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (hidden.requires_grad or params):
        return _ChunkedHeadLoss.apply(hidden, shift_labels, lm_head, softcap, chunk_tokens, *params)
    with torch.no_grad():
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = shift_labels.reshape(-1)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat_hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            loss_sum += _chunk_loss_sum(lm_head, flat_hidden[start:stop], flat_labels[start:stop], softcap)
        return loss_sum
