"""Tiny Hugging Face causal LMs and batches, built from configs (no downloads), for tests.

Every supported family gets a model small enough to run forward + backward in milliseconds, yet
shaped so that the interesting code paths are exercised: grouped-query attention (4 heads, 2 kv
heads), sliding windows shorter than the test sequences (mistral, qwen2, gemma2, gemma3), mixed
``layer_types``, per-layer-type rotary tables (gemma3), logit softcapping (gemma2, gemma3), a mixture
of experts (qwen3_moe) and fused projections (phi3). Other test files import ``FAMILIES``,
``make_model`` and ``make_batch``; keep their signatures stable.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

FAMILIES: list[str] = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "gemma2", "gemma3_text"]

VOCAB = 256
SLIDING_WINDOW = 4

# The attention implementation HF picks for each family by default on CPU (gemma2 prefers eager because
# of its attention softcapping). Pinning it keeps the tests independent of HF's defaults and covers
# both mask formats: boolean (sdpa) and additive float (eager).
_ATTN_IMPLEMENTATION = {family: "sdpa" for family in FAMILIES} | {"gemma2": "eager"}

# peft has no default LoRA targets for these model types.
_DEFAULT_LORA_TARGETS = {"phi3": ["qkv_proj", "o_proj"], "qwen3_moe": ["q_proj", "v_proj"]}


def _layer_types(num_layers: int) -> list[str]:
    """Alternating sliding / full attention, starting with sliding (as Gemma does)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _config(family: str, *, tied: bool, num_layers: int) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        common.pop("head_dim")  # qwen2 derives it: 64 / 4 = 16
        # Layers from max_window_layers on use the sliding window: layer 0 full, layer 1 sliding.
        return transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    if family == "phi3":
        common.pop("head_dim")
        return transformers.Phi3Config(**common)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **common,
            sliding_window=SLIDING_WINDOW,
            layer_types=_layer_types(num_layers),
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(
            **common,
            sliding_window=SLIDING_WINDOW,
            layer_types=_layer_types(num_layers),
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
        )
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def make_model(
    family: str,
    *,
    tied: bool = False,
    lora: None | str | list[str] = None,
    seed: int = 0,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A tiny randomly initialised causal LM of ``family``, optionally wrapped by peft LoRA.

    Args:
        family: one of ``FAMILIES``.
        tied: tie the LM head to the input embedding (one shared Parameter).
        lora: ``None`` for full fine-tuning; ``"default"`` for peft's default targets of the family;
            ``"all-linear"``; or a list of module names (e.g. ``["q_proj", "lm_head"]``). LoRA uses
            r=4, alpha=8, no dropout, and ``init_lora_weights=False`` so that B is non-zero and the
            gradients of A are informative.
        seed: seeds the weight initialisation (the same seed gives the same model).
        num_layers: decoder layers.
        dtype: parameter dtype.

    Returns:
        The HF ``*ForCausalLM`` (or a ``peft.PeftModel`` around it) in train mode.
    """
    import transformers

    config = _config(family, tied=tied, num_layers=num_layers)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=_ATTN_IMPLEMENTATION[family], dtype=dtype
    )
    # HF initialises norms to a constant; perturb them so their gradients test something.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.train()
    if lora is None:
        return model

    import peft

    if lora == "default":
        targets: Any = _DEFAULT_LORA_TARGETS.get(family)
    elif lora == "all-linear":
        targets = "all-linear"
    else:
        targets = list(lora)
    lora_config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=targets,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, lora_config)


def make_batch(
    batch: int = 6,
    seq: int = 12,
    vocab: int = VOCAB,
    padding: str | None = "left",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A batch of random token ids with ragged lengths, a padding mask and labels.

    Sample ``i`` keeps ``seq - (i % 4)`` real tokens (so at least one sample is unpadded), padded on
    the ``padding`` side (``None``: no padding, all samples full length). Labels copy the ids, with
    -100 on padding and on the first two real tokens of every sample (a "prompt").

    Returns:
        ``{"input_ids": [b, T] int64, "attention_mask": [b, T] int64, "labels": [b, T] int64}``.
    """
    if padding not in ("left", "right", None):
        raise ValueError(f"padding must be 'left', 'right' or None, not {padding!r}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    labels = input_ids.clone()
    for i in range(batch):
        pad = 0 if padding is None else i % 4
        real = torch.arange(seq) >= pad if padding == "left" else torch.arange(seq) < seq - pad
        attention_mask[i] = real.long()
        input_ids[i, ~real] = 0
        labels[i, ~real] = -100
        first_real = int(real.nonzero()[0])
        labels[i, first_real : first_real + 2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def variable_length_batch(
    generator: torch.Generator, rows: int = 8, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """A batch of ``rows`` samples whose longest one is drawn per call (4 to 23 tokens, right
    padding): microbatches are cut to their own longest sample, so every hand-off's size changes
    from step to step, as with real variable-length data."""
    length = int(torch.randint(4, 24, (1,), generator=generator))
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    lengths = torch.randint(2, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}


class ScaledWhereFlagged(nn.Module):
    """A norm whose output a trainable per-channel ``scale`` multiplies at the positions whose input
    has channel 0 above ``threshold``, and only when some position does: a batch (or microbatch, or
    data-parallel rank's rows) without such a position leaves ``scale`` out of the graph, and
    autograd leaves its ``.grad`` None, as an expert no token is routed to. Each position's output
    does not depend on the other rows. (Reading ``any()`` is a host sync: a test model only.)"""

    def __init__(self, norm: nn.Module, hidden: int, threshold: float):
        super().__init__()
        self.norm = norm
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.threshold = threshold

    def forward(self, x):
        y = self.norm(x)
        flagged = x[..., 0] > self.threshold
        if not bool(flagged.any()):
            return y
        return torch.where(flagged[..., None], y * self.scale, y)


def with_flag_token(model: nn.Module) -> int:
    """Put a ``ScaledWhereFlagged`` around layer 0's input norm of a tiny Llama (or a peft model
    of one) whose embedding stays frozen (LoRA), so that layer 0's input is the embedding itself;
    returns the one token id whose positions it scales (a token >= 3: not padding or bos/eos)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    column = base.model.embed_tokens.weight.detach()[:, 0]
    token = 3 + int(column[3:].argmax())
    others = torch.cat([column[:token], column[token + 1 :]])
    threshold = float(column[token] + others.max()) / 2
    layer = base.model.layers[0]
    torch.manual_seed(1)
    layer.input_layernorm = ScaledWhereFlagged(layer.input_layernorm, base.config.hidden_size, threshold)
    return token


def place_flag_token(batch: dict, token: int, rows) -> dict:
    """``batch`` with ``token`` removed everywhere and put at the last position of each of ``rows``."""
    ids = batch["input_ids"].clone()
    ids[ids == token] = token + 1 if token + 1 < VOCAB else token - 1
    for r in rows:
        ids[r, -1] = token
    labels = torch.where(batch["labels"] == -100, batch["labels"], ids)
    return {**batch, "input_ids": ids, "labels": labels}


def make_timing_llama(*, vocab: int, num_layers: int, hidden: int = 256, seed: int = 0) -> nn.Module:
    """A Llama big enough that a layer's compute outweighs Python and timer noise (hidden 256,
    MLP 4x), for tests that compare measured times."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def saved_vocab_shapes(fn, vocab_sizes: set[int]) -> list[tuple[int, ...]]:
    """Shapes of tensors saved for backward during ``fn()`` that are still alive after it returns
    and whose last dimension is one of ``vocab_sizes`` (the vocabulary or a shard of it: logits)."""
    saved: list[tuple[weakref.ref, tuple[int, ...]]] = []

    def pack(t):
        saved.append((weakref.ref(t), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    alive = [shape for ref, shape in saved if ref() is not None and shape and shape[-1] in vocab_sizes]
    del out
    return alive
