"""Analytic cost model: FLOPs, bytes and times per layer, from a model's config numbers alone.

The model is the layer list the runtime runs: ``embed``, ``layers.0`` .. ``layers.{L-1}`` (decoder
blocks) and the head + loss, either one layer ``head`` or ``head_shards`` vocabulary shards
``head.0`` .. ``head.{k-1}`` of (nearly) equal size; the final norm goes with the first shard.
Every :class:`LayerCost` is for one microbatch of ``micro_batch_size`` sequences of ``seq_len``
tokens (``tokens = micro_batch_size * seq_len``).

FLOPs (per token, forward; ``H`` hidden, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``,
``I`` intermediate, ``V`` vocab, ``T`` sequence length):

- linear ``in -> out``: ``2 * in * out``. Attention projections ``2H(q + 2kv) + 2qH``; dense SwiGLU
  MLP ``6HI``; MoE router ``2HE`` plus only the ``k`` active experts ``6 H I_moe k``.
- attention core (scores and weighted values, each ``2 * head_dim`` per query-key pair and head):
  a causal query at position ``t`` sees ``t + 1`` keys, ``(T + 1) / 2`` on average, so
  ``4 * heads * head_dim * (T + 1) / 2``; a sliding-window layer (gpt-oss) sees at most ``w``.
  Softmax, norms, rotary and activations are memory traffic, not FLOPs (they are timed as such).
- LoRA rank ``r`` on a linear: ``2 r (in + out)`` more.
- head shard of ``Vs`` rows: ``2 H Vs``; the embedding is a gather (0 FLOPs).

Backward: every matmul needs its input gradient (as many FLOPs as its forward) and, when its
weight is trainable, its weight gradient (as many again): 2x forward under full fine-tuning. Under
LoRA the frozen base weights need only input gradients, so a block's backward is ~1x forward
plus the adapters' 2x. The attention core's backward is 2.5x its forward (four matmuls instead
of two, plus FlashAttention's recomputation of the scores). Blocks backpropagate with recompute
(the stage forward runs again first: ``bwd_recompute_flops = fwd + bwd``, ~3x under full
fine-tuning); the head runs forward and backward back to back and never recomputes.

Bytes (``b`` = bytes of the compute dtype):

- ``param_bytes``: the layer's weights on the device (``params * b``, LoRA adapters included).
- ``trainable_params``: parameters this layer produces gradients for; ``grad_device_bytes`` =
  ``trainable * 4``: the runtime sums a stage's weight gradients on the device in fp32 over its
  consecutive microbatches before one download. ``grad_host_bytes`` = fp32 accumulation buffers and
  ``optimizer_bytes`` = AdamW fp32 master + two moments (12 bytes) per trainable parameter, both
  on the CPU and counted once for tied weights (the embedding owns them).
- ``act_in_bytes``: the layer's input kept on the CPU if a stage starts here (``tokens * H * b``;
  ``tokens * 8`` int64 ids for the embedding; vocabulary shards after the first pass a packed fp32 tensor: the hidden state and two
  fp32 running loss statistics per token).
- ``saved_bytes``: what autograd keeps for this layer while its stage recomputes (attention via
  SDPA/FlashAttention: O(T), never a ``T x T`` matrix). Per token, elements of dtype ``b``:
  ``4H`` (block input, normed input, mid-residual, normed mid-residual) + ``q + 2kv`` (projections)
  + ``q + kv`` (Qwen3 q/k norms) + ``q + kv`` (rotary outputs) + ``q`` (attention output) + MLP:
  dense ``4I`` (gate, up, silu(gate), product), MoE ``4 k I_moe + 2 k H`` (each token's
  intermediates in ``k`` experts plus its dispatched copies and expert outputs); fp32 per token:
  ``heads`` (attention log-sum-exp) + ``2`` (norm statistics) + MoE ``2E`` (router logits, probs).
- ``work_bytes``: the device working set of the layer's forward + backward with recompute, alone:
  ``saved_bytes`` + a transient of ``tokens * b * (2H + max(2(q + 2kv), 3 I_act [+ 2kH for MoE]))``
  (gradients of the block's input/output and of its widest part, alive while it backpropagates;
  ``I_act`` = ``I`` or ``k I_moe``). A backward stage of several layers keeps every layer's
  ``saved_bytes`` at once and one layer's transient (see ``memory.stage_bytes``).
- ``fwd_work_bytes``: forward without autograd (forward stages save only their input, on the CPU):
  ``tokens * b * (2H + max(2q + 2kv, 3 I_act [+ 2kH]))``.
- head shard: working set ``2 * chunk * Vs * 4`` (one token chunk's fp32 logits and their gradient;
  logits never exist for the whole microbatch) + ``tokens * H * b`` (gradient of the hidden input);
  saved: its hidden input (shard 0 also the final norm's output).

Times: every :class:`LayerCost` carries the kernels its forward and backward run
(``fwd_kernels``, ``bwd_kernels``; ``partition/kernels.py``): each GEMM with its shape, the
attention core, the elementwise and MoE routing traffic. :func:`layer_time` sums a roofline over
them with the GPU's fitted parameters (``presets/hardware.json``; calibrated on the RoundPipe
paper's measured RTX 4090 layers, ``roundpipe costs``); :func:`layer_times` accepts measured times
per layer name that replace the analytic ones.

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.partition.cost_checks import (
    check_fp16_accumulation,
    check_label_fraction,
    check_mlp_chunk_tokens,
    check_quantized_lora,
)
from roundpipe.partition.kernels import (
    ATTENTION_BWD_FACTOR,
    Kernel,
    block_kernels,
    embed_kernels,
    head_kernels,
    kernels_seconds,
    keys_per_query,
    memory,
    rates,
)
from roundpipe.partition.quant_layout import moment_bytes_per_param, packed_weights
from roundpipe.partition.shape import ModelShape, model_shape
from roundpipe.presets import GPU, Server, normalize_dtype

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32 = 4
OPTIMIZER_BYTES_PER_PARAM = 12  # AdamW: fp32 master weight + exp_avg + exp_avg_sq
GRAD_HOST_BYTES_PER_PARAM = 4  # fp32 gradient accumulation on the CPU
DEVICE_GRAD_BYTES_PER_PARAM = 4  # fp32 accumulator on the device (runtime/gradients.py GradientAccumulators)
HEAD_LOGIT_BUFFERS = 2  # a chunk's fp32 logits and their gradient are alive together
HEAD_STATS_PER_TOKEN = 2  # running log-sum-exp and target logit (fp32) between vocabulary shards
DEFAULT_HEAD_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer for one microbatch. FLOPs are totals for the microbatch, bytes are bytes.

    The first seven fields are what the partitioner needs most; the rest refine the memory and
    host accounting (see the module docstring for every formula).
    """

    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    trainable_params: int
    act_in_bytes: int
    work_bytes: int
    kind: str = "block"  # "embed" | "block" | "head"
    params: int = 0  # parameters on the device (LoRA adapters included)
    tied_params: int = 0  # of ``params``, shared with another layer (tied embeddings)
    recompute: bool = True  # backward re-runs this layer's forward first
    saved_bytes: int = 0
    fwd_work_bytes: int = 0
    grad_device_bytes: int = 0
    grad_host_bytes: int = 0
    optimizer_bytes: int = 0
    tokens: int = 0
    dtype: str = "bf16"
    fp16_accumulate: bool = False  # fp16 matmuls accumulate in fp16 (the GeForce 2x rate)
    # What the layer runs (partition/kernels.py): forward, and backward without the recompute forward.
    fwd_kernels: tuple[Kernel, ...] = field(default=(), repr=False)
    bwd_kernels: tuple[Kernel, ...] = field(default=(), repr=False)

    @property
    def fwd_flops_per_token(self) -> float:
        """Forward FLOPs per token at this cost's sequence length (the attention term depends on it)."""
        return self.fwd_flops / self.tokens if self.tokens else 0.0

    @property
    def bwd_recompute_flops(self) -> float:
        """Backward FLOPs as a backward stage spends them: recompute forward (if any) + backward."""
        return self.bwd_flops + (self.fwd_flops if self.recompute else 0.0)

    @property
    def transient_bytes(self) -> int:
        """The part of ``work_bytes`` only alive while this one layer runs its backward."""
        return self.work_bytes - self.saved_bytes


@dataclass(frozen=True)
class _Linear:
    """A linear (in -> out) used by ``active`` copies per token, of which the layer holds ``total``."""

    fan_in: int
    fan_out: int
    active: float = 1
    total: int = 1
    bias: bool = False
    lora: bool = True

    @property
    def params(self) -> int:
        return self.total * (self.fan_in * self.fan_out + (self.fan_out if self.bias else 0))

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.active * self.fan_in * self.fan_out

    def lora_params(self, rank: int) -> int:
        return self.total * rank * (self.fan_in + self.fan_out) if self.lora else 0

    def lora_flops_per_token(self, rank: int) -> float:
        return 2.0 * self.active * rank * (self.fan_in + self.fan_out) if self.lora else 0.0


ATTENTION_LINEARS = 4  # a block's first linears (q, k, v, o); the MLP's (router, experts) follow


def _block_linears(shape: ModelShape, layer: int, lora_experts: bool) -> list[_Linear]:
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    ab = shape.attention_bias
    out = [_Linear(h, q, bias=ab), _Linear(h, kv, bias=ab), _Linear(h, kv, bias=ab), _Linear(q, h, bias=ab)]
    assert len(out) == ATTENTION_LINEARS
    if shape.is_moe(layer):
        e, k, im = shape.num_experts, shape.experts_per_tok, shape.expert_width
        out.append(_Linear(h, e, bias=shape.router_bias))  # router
        for fan_in, fan_out in ((h, im), (h, im), (im, h)):  # gate, up (fused in gpt-oss), down
            out.append(_Linear(fan_in, fan_out, active=k, total=e, bias=shape.expert_bias, lora=lora_experts))
    else:
        i, mb = shape.dense_width, shape.mlp_bias
        out += [_Linear(h, i, bias=mb), _Linear(h, i, bias=mb), _Linear(i, h, bias=mb)]
    return out


SAVED = "saved"  # the prefix of the parts autograd keeps (the others are "transient: ...")
TRANSIENT_GRADS = "transient: gradients of the block's input and output"
TRANSIENT_ATTENTION = "transient: attention projections' gradients"
TRANSIENT_MLP = "transient: MLP (or experts') widest part and its gradient"


def _mlp_widths(shape: ModelShape, layer: int) -> tuple[int, int, int]:
    """``(I_act, dispatch, extra fp32)`` per token: the MLP's active width (``I`` or ``k I_moe``),
    an MoE's dispatched copies and expert outputs (``2kH``) and its router's fp32 values (``2E``)."""
    if shape.is_moe(layer):
        k, im, e = shape.experts_per_tok, shape.expert_width, shape.num_experts
        return k * im, 2 * k * shape.hidden, 2 * e
    return shape.dense_width, 0, 0


def mlp_chunk(tokens: int, mlp_chunk_tokens: int | None) -> int:
    """The tokens of the largest chunk a microbatch of ``tokens`` tokens runs its MLP in
    (``RunConfig.mlp_chunk_tokens``, ``runtime/mlp_chunks.py``); ``tokens`` when it is not chunked."""
    return tokens if mlp_chunk_tokens is None or tokens <= mlp_chunk_tokens else mlp_chunk_tokens


def activation_parts(
    shape: ModelShape, layer: int, tokens: int, b: int, mlp_chunk_tokens: int | None = None
) -> dict[str, int]:
    """A block's activation bytes at ``tokens`` tokens by part (module docstring): the ``saved``
    parts autograd keeps while its stage recomputes, the ``transient`` ones alive while it
    backpropagates (a layer takes its gradients' and the larger of the other two).

    ``mlp_chunk_tokens``: the MLP runs in token chunks of at most this many tokens, each under a
    checkpoint (``runtime/mlp_chunks.py``): autograd keeps no MLP intermediate for the stage, and
    the backward recomputes one chunk's, which live with their gradients while it backpropagates."""
    h, q, kv, heads = shape.hidden, shape.q_dim, shape.kv_dim, shape.heads
    i_act, dispatch, extra_fp32 = _mlp_widths(shape, layer)
    chunk = mlp_chunk(tokens, mlp_chunk_tokens)
    chunked = chunk < tokens
    return {
        "saved: block input, norms and mid-residual": tokens * b * 4 * h,
        "saved: attention (projections, q/k norms, rotary, output)": tokens
        * b
        * ((q + 2 * kv) + (q + kv if shape.qk_norm else 0) + (q + kv) + q),
        "saved: MLP intermediates (gate, up, activation, product)": 0 if chunked else tokens * b * 4 * i_act,
        "saved: MoE dispatched copies and expert outputs": 0 if chunked else tokens * b * dispatch,
        "saved: fp32 statistics (attention log-sum-exp, norms, router)": tokens
        * FP32
        * (heads + 2 + extra_fp32),
        TRANSIENT_GRADS: tokens * b * 2 * h,
        TRANSIENT_ATTENTION: tokens * b * 2 * (q + 2 * kv),
        # chunked: one chunk's recomputed intermediates and output beside their widest gradients
        # and its input's, and the gradient of the MLP's input gathered over the chunks
        TRANSIENT_MLP: (
            tokens * b * h + chunk * b * ((4 * i_act + dispatch) + (3 * i_act + dispatch) + 2 * h)
            if chunked
            else tokens * b * (3 * i_act + dispatch)
        ),
    }


def _block_cost(
    shape: ModelShape,
    layer: int,
    seq_len: int,
    tokens: int,
    b: int,
    lora_rank: int | None,
    lora_experts: bool,
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    h, q, kv, heads = shape.hidden, shape.q_dim, shape.kv_dim, shape.heads
    linears = _block_linears(shape, layer, lora_experts)
    norm_params = (
        2 * h + (2 * shape.head_dim if shape.qk_norm else 0) + (heads if shape.attention_sinks else 0)
    )
    base_params = sum(lin.params for lin in linears) + norm_params
    lora = lora_rank or 0
    lora_params = sum(lin.lora_params(lora) for lin in linears)
    full = lora_rank is None

    matmul = sum(lin.flops_per_token for lin in linears)
    lora_flops = sum(lin.lora_flops_per_token(lora) for lin in linears)
    attn_core = 4.0 * heads * shape.head_dim * keys_per_query(seq_len, shape.window(layer))
    fwd = matmul + lora_flops + attn_core
    bwd = matmul * (2.0 if full else 1.0) + 2.0 * lora_flops + ATTENTION_BWD_FACTOR * attn_core
    chunk = mlp_chunk(tokens, mlp_chunk_tokens)
    if chunk < tokens:  # the backward runs the MLP's forward once more, a chunk at a time
        mlp = linears[ATTENTION_LINEARS:]
        bwd += sum(lin.flops_per_token for lin in mlp) + sum(lin.lora_flops_per_token(lora) for lin in mlp)

    parts = activation_parts(shape, layer, tokens, b, mlp_chunk_tokens)
    saved = sum(v for k, v in parts.items() if k.startswith(SAVED))
    transient = parts[TRANSIENT_GRADS] + max(parts[TRANSIENT_ATTENTION], parts[TRANSIENT_MLP])
    i_act, dispatch, extra_fp32 = _mlp_widths(shape, layer)
    # chunked: a chunk's widest part beside the chunks' outputs and their join
    if chunk < tokens:
        mlp_work = tokens * b * h + chunk * b * (3 * i_act + dispatch)
    else:
        mlp_work = tokens * b * (3 * i_act + dispatch)
    fwd_work = tokens * b * 2 * h + max(tokens * b * (2 * q + 2 * kv), mlp_work) + tokens * FP32 * extra_fp32

    params = base_params + lora_params
    trainable = base_params if full else lora_params
    fwd_kernels, bwd_kernels = block_kernels(
        shape, layer, seq_len, tokens // seq_len, b, lora_rank, lora_experts, trainable, chunk < tokens
    )
    param_bytes = params * b
    if quantization is not None:  # every linear's weight but a router's, unpacked as the layer runs
        router = ATTENTION_LINEARS if shape.is_moe(layer) else -1
        packed = packed_weights(
            quantization,
            [
                (lin.total * lin.fan_in * lin.fan_out, lin.fan_in)
                for j, lin in enumerate(linears)
                if j != router
            ],
            b,
        )
        param_bytes += packed.packed_bytes - packed.values * b
        saved += packed.unpacked_bytes  # bound until the stage's backward is done
        transient = max(transient, parts[TRANSIENT_GRADS] + packed.transient_bytes)
        fwd_work += packed.unpacked_bytes + packed.transient_bytes
        fwd_kernels += (memory("unpack weights", packed.traffic_bytes, packed.launches),)
    return dict(
        param_bytes=param_bytes,
        fwd_kernels=fwd_kernels,
        bwd_kernels=bwd_kernels,
        fwd_flops=fwd * tokens,
        bwd_flops=bwd * tokens,
        params=params,
        trainable=trainable,
        owned_trainable=trainable,
        tied=0,
        act_in=tokens * h * b,
        saved=saved,
        work=saved + transient,
        fwd_work=fwd_work,
        recompute=True,
    )


def _shard_sizes(vocab: int, shards: int) -> list[int]:
    base, extra = divmod(vocab, shards)
    return [base + (1 if j < extra else 0) for j in range(shards)]


def model_costs(
    config: Mapping[str, Any],
    seq_len: int,
    micro_batch_size: int = 1,
    dtype: str = "bf16",
    lora_rank: int | None = None,
    head_shards: int = 1,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
    lora_experts: bool = True,
    label_fraction: float = 1.0,
    fp16_accumulation: bool = False,
    mlp_chunk_tokens: int | None = None,
    quantization: str | None = None,
    optimizer_state: str = "fp32",
) -> list[LayerCost]:
    """Per-layer costs ``[embed, layers.0 .. layers.{L-1}, head | head.0 .. head.{k-1}]``.

    ``config`` is a transformers-style dict (:func:`roundpipe.presets.load_model_config`).
    ``lora_rank=None`` means full fine-tuning (every parameter trainable); an int means LoRA of that
    rank on every linear layer of the blocks (attention, MLP, MoE router and, unless
    ``lora_experts=False``, every expert), with embedding and head frozen.
    ``head_chunk_tokens`` is the token chunk of the fused head + loss. ``label_fraction`` is the
    share of tokens that have a label (not -100): the head computes logits and keeps gradients for
    those only (``models/head.py``), while the hand-off between head shards still carries every token.
    ``fp16_accumulation``: fp16 matmuls accumulate in fp16 (``RunConfig(fp16_accumulation=True)``),
    so every layer is timed at the GPU's fp16-accumulate rate where the preset has one.
    ``mlp_chunk_tokens``: the blocks run their MLP in token chunks of at most this many tokens
    (``RunConfig.mlp_chunk_tokens``; :func:`activation_parts`); None: in one piece.
    ``quantization``: the blocks' frozen linear weights kept compressed (``RunConfig.quantization``,
    LoRA only; ``quant_layout.py``): their bytes on the host, over PCIe and resident, their unpacked
    copies while a layer runs (kept by a backward stage) and the unpacking's memory traffic.
    ``optimizer_state``: AdamW's moments on the host in ``"fp32"``, ``"bf16"`` or ``"int8"``
    (``OptimizerConfig.state_dtype``): ``optimizer_bytes`` is the fp32 master plus their bytes.
    """
    check_mlp_chunk_tokens(mlp_chunk_tokens)
    check_quantized_lora(quantization, lora_rank)
    adam_bytes = FP32 + moment_bytes_per_param(optimizer_state)  # master + moments, per parameter
    if seq_len < 1 or micro_batch_size < 1:
        raise ConfigError(f"seq_len and micro_batch_size must be >= 1, got {seq_len} and {micro_batch_size}")
    if lora_rank is not None and lora_rank < 1:
        raise ConfigError(f"lora_rank must be a positive int or None (full fine-tuning), got {lora_rank}")
    check_label_fraction(label_fraction)
    dt = normalize_dtype(dtype)
    check_fp16_accumulation(fp16_accumulation, dt)
    b = DTYPE_BYTES[dt]
    shape = model_shape(config)
    if not 1 <= head_shards <= shape.vocab:
        raise ConfigError(f"head_shards must be in 1..{shape.vocab}, got {head_shards}")
    tokens = seq_len * micro_batch_size
    full = lora_rank is None
    h, v = shape.hidden, shape.vocab

    raw: list[tuple[str, str, dict[str, Any]]] = []
    embed_params = v * h
    embed_fwd, embed_bwd = embed_kernels(v, h, tokens, b, trained=full)
    raw.append(
        (
            "embed",
            "embed",
            dict(
                fwd_kernels=embed_fwd,
                bwd_kernels=embed_bwd,
                fwd_flops=0.0,
                bwd_flops=0.0,
                params=embed_params,
                trainable=embed_params if full else 0,
                owned_trainable=embed_params if full else 0,
                tied=0,
                act_in=tokens * 8,
                saved=0,
                work=2 * tokens * h * b,
                fwd_work=tokens * h * b + tokens * 8,
                recompute=True,
            ),
        )
    )
    for i in range(shape.num_layers):
        raw.append(
            (
                f"layers.{i}",
                "block",
                _block_cost(
                    shape, i, seq_len, tokens, b, lora_rank, lora_experts, mlp_chunk_tokens, quantization
                ),
            )
        )

    labelled = max(1, round(tokens * label_fraction))  # the rows the head gathers
    chunk = min(head_chunk_tokens, labelled)
    for j, vs in enumerate(_shard_sizes(v, head_shards)):
        weight = vs * h
        norm = h if j == 0 else 0
        fwd = 2.0 * h * vs * labelled
        trainable = (weight + norm) if full else 0
        tied = weight if shape.tied else 0
        saved = (tokens if j == 0 else 0) * h * b + labelled * h * b
        stats = tokens * FP32 * HEAD_STATS_PER_TOKEN if j > 0 else 0
        # After the first shard the hand-off is one packed fp32 tensor [tokens, H + 2] (models/head_shards.py).
        hidden_in = tokens * h * (FP32 if j > 0 else b)
        transient = HEAD_LOGIT_BUFFERS * chunk * vs * FP32 + tokens * h * b
        head_fwd, head_bwd = head_kernels(
            h, vs, tokens, labelled, chunk, b, first=j == 0, trained=full, trained_params=trainable
        )
        raw.append(
            (
                "head" if head_shards == 1 else f"head.{j}",
                "head",
                dict(
                    fwd_kernels=head_fwd,
                    bwd_kernels=head_bwd,
                    fwd_flops=fwd,
                    bwd_flops=fwd * (2.0 if full else 1.0),
                    params=weight + norm,
                    trainable=trainable,
                    owned_trainable=(trainable - tied) if full else 0,
                    tied=tied,
                    act_in=hidden_in + stats,
                    saved=saved + stats,
                    work=saved + stats + transient,
                    fwd_work=saved + stats + transient,
                    recompute=False,
                ),
            )
        )

    return [
        LayerCost(
            name=name,
            fwd_flops=float(c["fwd_flops"]),
            bwd_flops=float(c["bwd_flops"]),
            param_bytes=int(c.get("param_bytes", c["params"] * b)),
            trainable_params=int(c["trainable"]),
            act_in_bytes=int(c["act_in"]),
            work_bytes=int(c["work"]),
            kind=kind,
            params=int(c["params"]),
            tied_params=int(c["tied"]),
            recompute=bool(c["recompute"]),
            saved_bytes=int(c["saved"]),
            fwd_work_bytes=int(c["fwd_work"]),
            grad_device_bytes=int(c["trainable"] * DEVICE_GRAD_BYTES_PER_PARAM),
            grad_host_bytes=int(c["owned_trainable"] * GRAD_HOST_BYTES_PER_PARAM),
            optimizer_bytes=int(c["owned_trainable"] * adam_bytes),
            tokens=tokens,
            dtype=dt,
            fp16_accumulate=fp16_accumulation,
            fwd_kernels=c["fwd_kernels"],
            bwd_kernels=c["bwd_kernels"],
        )
        for name, kind, c in raw
    ]


def model_totals(costs: list[LayerCost]) -> dict[str, int | float]:
    """Whole-model sums: unique parameters (tied weights once), trainable parameters, host bytes.

    ``host_bytes`` is what the CPU holds for the model state: the pinned compute-dtype copy of every
    unique parameter (compressed where the layer keeps it so: its ``param_bytes``), fp32 gradient
    accumulators and AdamW state of the trainable ones (saved activations come on top,
    ``act_in_bytes`` per stage start per microbatch).
    """
    b = DTYPE_BYTES[costs[0].dtype] if costs else 2
    params = sum(c.params - c.tied_params for c in costs)
    weights = sum(c.param_bytes - c.tied_params * b for c in costs)
    trainable = sum(c.grad_host_bytes for c in costs) // GRAD_HOST_BYTES_PER_PARAM
    return {
        "params": params,
        "trainable_params": trainable,
        "fwd_flops": sum(c.fwd_flops for c in costs),
        "bwd_recompute_flops": sum(c.bwd_recompute_flops for c in costs),
        "host_bytes": weights + sum(c.grad_host_bytes + c.optimizer_bytes for c in costs),
    }


def layer_time(
    cost: LayerCost,
    hw: GPU | Server,
    *,
    phase: str = "forward",
    efficiency: float | None = None,
    fp16_accumulate: bool = False,
) -> float:
    """Seconds for one microbatch on ``hw``: the roofline of every kernel the layer runs.

    ``phase``: ``"forward"``, ``"backward"`` (backward alone) or ``"backward_stage"`` (what a
    backward stage spends: recompute forward where the layer recomputes, then backward).
    Each kernel takes ``max(compute, memory traffic) + launch`` (``partition/kernels.py``): GEMMs
    at an efficiency that grows with their size up to the preset's ``matmul_efficiency``,
    FlashAttention at ``attention_efficiency``, elementwise work at ``memory_efficiency`` of the
    memory bandwidth. ``efficiency`` replaces the preset's GEMM plateau ``matmul_efficiency``.
    A cost built by hand without kernels is timed as ``flops / (peak * efficiency)``.
    """
    if phase not in ("forward", "backward", "backward_stage"):
        raise ConfigError(f"unknown phase {phase!r}; use forward, backward or backward_stage")
    fp16_acc = fp16_accumulate or cost.fp16_accumulate
    r = rates(hw, cost.dtype, fp16_accumulate=fp16_acc, efficiency=efficiency)
    if not (cost.fwd_kernels or cost.bwd_kernels):
        flops = {"forward": cost.fwd_flops, "backward": cost.bwd_flops}.get(phase, cost.bwd_recompute_flops)
        return flops / (r.gemm_flops * r.gemm_efficiency)
    fwd = kernels_seconds(cost.fwd_kernels, r, r.launch_s)
    if phase == "forward":
        return fwd
    bwd = kernels_seconds(cost.bwd_kernels, r, r.launch_bwd_s)
    return bwd + (fwd if phase == "backward_stage" and cost.recompute else 0.0)


def layer_times(
    costs: list[LayerCost],
    hw: GPU | Server,
    *,
    efficiency: float | None = None,
    times: Mapping[str, tuple[float, float]] | None = None,
    fp16_accumulate: bool = False,
) -> tuple[list[float], list[float]]:
    """Per-layer seconds ``(forward, backward_stage)`` for the forward and backward partitions.

    ``times`` maps a layer name to measured ``(forward_s, backward_s)`` of one microbatch (backward
    alone, without recompute; the recompute forward is added here for layers that recompute) and
    replaces the analytic estimate of that layer. A profiling pass fills it; names it does not know
    raise :class:`ConfigError`.
    """
    times = dict(times or {})
    unknown = set(times) - {c.name for c in costs}
    if unknown:
        raise ConfigError(
            f"measured times for unknown layers {sorted(unknown)}; layers are {costs[0].name}.."
        )
    fwd, bwd = [], []
    seen: dict[tuple, tuple[float, float]] = {}  # identical blocks share their kernel tuples
    for c in costs:
        if c.name in times:
            f, b = (float(x) for x in times[c.name])
            if f < 0 or b < 0:
                raise ConfigError(f"measured times of {c.name} must be >= 0, got {times[c.name]}")
            fwd.append(f)
            bwd.append(b + (f if c.recompute else 0.0))
            continue
        key = (id(c.fwd_kernels), id(c.bwd_kernels), c.recompute, c.dtype, c.fp16_accumulate)
        if not c.fwd_kernels or key not in seen:
            seen[key] = (
                layer_time(c, hw, phase="forward", efficiency=efficiency, fp16_accumulate=fp16_accumulate),
                layer_time(
                    c, hw, phase="backward_stage", efficiency=efficiency, fp16_accumulate=fp16_accumulate
                ),
            )
        f, b = seen[key]
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd
