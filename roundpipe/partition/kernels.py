"""What one layer runs on a GPU, kernel by kernel, and how long that takes: a roofline per kernel.

A layer's forward and its backward (without the recompute forward) are tuples of :class:`Kernel`,
built from the model's shape the way HF's eager modules run them, with FlashAttention for the
attention core, peft LoRA adapters, and the chunked LM head + loss.

- **GEMMs.** Every linear layer is one GEMM forward; backward adds the input-gradient GEMM and,
  when its weight is trained, the weight-gradient GEMM (LoRA: frozen base weights get none; each
  adapter adds two small GEMMs forward and four backward). A bias is fused into the GEMM
  (``addmm``) unless the module adds it apart (gpt-oss experts).
- **Attention.** FlashAttention, causal (a query at position ``t`` sees ``t + 1`` keys, half the
  square) or a sliding window of ``w`` keys (gpt-oss, alternate layers); the backward does
  ``ATTENTION_BWD_FACTOR`` (2.5) times the forward's FLOPs. Attention sinks add one logit per row.
- **Elementwise work** is memory traffic, counted per element from the ops HF's eager code runs
  (``OPS``): an RMSNorm upcasts to fp32, squares, averages, scales, downcasts and multiplies by its
  weight, six kernels and ``28 + 4b`` bytes per element for a ``b``-byte dtype. Norms, rotary,
  activations and residual adds move about twice their forward bytes backward (each op reads its
  output's gradient and saved inputs and writes its input's gradient; autograd sums the gradients
  of tensors used twice). The head's cross-entropy is one fused pass over the logits forward and
  one (read + write) backward.
- **MoE.** HF's eager expert loop: the router GEMM, softmax / top-k and the one-hot expert mask,
  then for each expert its share of the tokens (``tokens * top_k / num_experts``): a gather, the
  expert's small GEMMs (as many launches as experts), the routing weight and a scatter-add back.
  Backward, the gather's gradient is a zero-filled ``[tokens x H]`` tensor per expert (index
  backward), and under full fine-tuning a fused 3-D expert parameter (gpt-oss) gets a gradient the
  size of the whole fused tensor per expert (select backward): ``FULL_GRAD`` kernels, charged
  ``expert_grad_passes`` passes over the full tensor.
- **Weight gradients** of a trained layer are added into the runtime's fp32 accumulators on the
  device (``runtime/gradients.py``): ``b + 8`` bytes per parameter.

Time of one launch, with the GPU's tensor-core ``peak`` for the dtype (fp16 GEMMs at the
fp16-accumulate rate when asked; FlashAttention always accumulates in fp32) and
``bandwidth = memory_bw * memory_efficiency``::

    gemm:       max(flops / (peak * eff(flops)), bytes / bandwidth, host)
                eff(flops) = matmul_efficiency * flops / (flops + half),
                half = matmul_efficiency * peak * gemm_ramp_s
    attention:  max(flops / (peak_fp32_accumulate * attention_efficiency), bytes / bandwidth, host)
    memory:     max(bytes / bandwidth, host);   full_grad: expert_grad_passes * bytes / bandwidth

``eff`` saturates: a GEMM pays a fixed ``gemm_ramp_s`` of filling and draining the GPU on top of
its work at ``matmul_efficiency``, so the few-GFLOP GEMM of one expert runs below a projection of
tens. ``host`` is the time the host needs to issue a kernel (``launch_s`` for the eager forward,
``launch_bwd_s`` for the autograd engine): a kernel shorter than that leaves the GPU waiting,
which is what hundreds of per-expert kernels do. The parameters live per GPU in
``presets/hardware.json``, fitted on the RTX 4090 to the RoundPipe paper's measured layer times
(``presets/measured_layers.json``, ``docs/simulator.md``); other GPUs use the same values
against their own peaks and bandwidth.

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from roundpipe.errors import ConfigError
from roundpipe.partition.shape import ModelShape
from roundpipe.presets import GPU, Server

GEMM, ATTENTION, MEMORY, FULL_GRAD = "gemm", "attention", "memory", "full_grad"
FP32 = 4
INT64 = 8
ATTENTION_BWD_FACTOR = 2.5  # dQ, dK, dV, dP matmuls + FlashAttention's recomputed scores
ACCUMULATOR_BYTES = 2 * FP32  # the fp32 accumulator is read and written (plus the gradient's b)


@dataclass(frozen=True)
class Kernel:
    """``count`` launches of one GPU kernel; ``flops`` and ``bytes`` (DRAM traffic) are per launch."""

    name: str
    kind: str  # GEMM | ATTENTION | MEMORY | FULL_GRAD
    flops: float = 0.0
    bytes: float = 0.0
    count: float = 1.0
    shape: tuple[float, float, float] | None = None  # a GEMM's (m, n, k): [m x k] @ [k x n]

    @property
    def total_flops(self) -> float:
        return self.flops * self.count

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


def gemm(name: str, m: float, n: float, k: float, b: int, count: float = 1) -> Kernel:
    """``[m x k] @ [k x n]`` in a ``b``-byte dtype: ``2 m n k`` FLOPs, both inputs read, the output written."""
    return Kernel(name, GEMM, 2.0 * m * n * k, b * (m * k + k * n + m * n), count, (m, n, k))


def memory(
    name: str, total_bytes: float, launches: float = 1, count: float = 1, kind: str = MEMORY
) -> Kernel:
    """Memory-bound work: ``total_bytes`` over ``launches`` kernels, repeated ``count`` times."""
    launches = max(launches, 1)
    return Kernel(name, kind, 0.0, total_bytes / launches, launches * count)


# ---------------------------------------------------------------------------------------------
# Time


@dataclass(frozen=True)
class Rates:
    """A GPU's roofline parameters (``presets/hardware.json``) in SI units, for one dtype setting."""

    gemm_flops: float  # tensor-core peak for GEMMs in this dtype (fp16-accumulate where asked)
    attention_flops: float  # tensor-core peak for FlashAttention (accumulates in fp32)
    memory_bw: float  # bytes/s elementwise kernels reach: datasheet x memory_efficiency
    gemm_efficiency: float  # the plateau large GEMMs reach (matmul_efficiency)
    gemm_ramp_s: float
    attention_efficiency: float
    launch_s: float  # host time to issue one forward kernel (eager Python)
    launch_bwd_s: float  # host time to issue one backward kernel (the autograd engine)
    expert_grad_passes: float  # DRAM passes charged per expert's full-size gradient

    @property
    def gemm_half_flops(self) -> float:
        """The GEMM size (FLOPs) that runs at half of ``gemm_efficiency``."""
        return self.gemm_efficiency * self.gemm_flops * self.gemm_ramp_s


def rates(
    hw: GPU | Server, dtype: str, *, fp16_accumulate: bool = False, efficiency: float | None = None
) -> Rates:
    """The roofline parameters of ``hw`` for ``dtype``; ``efficiency`` replaces the GEMM plateau."""
    gpu = hw.gpu if isinstance(hw, Server) else hw
    eff = gpu.matmul_efficiency if efficiency is None else efficiency
    if not 0 < eff <= 1:
        raise ConfigError(f"efficiency must be in (0, 1], got {eff}")
    return Rates(
        gemm_flops=gpu.peak_flops(dtype, fp16_accumulate=fp16_accumulate),
        attention_flops=gpu.peak_flops(dtype),
        memory_bw=gpu.memory_bw * gpu.memory_efficiency,
        gemm_efficiency=eff,
        gemm_ramp_s=gpu.gemm_ramp_s,
        attention_efficiency=gpu.attention_efficiency,
        launch_s=gpu.launch_s,
        launch_bwd_s=gpu.launch_bwd_s,
        expert_grad_passes=gpu.expert_grad_passes,
    )


def gemm_efficiency(flops: float, r: Rates) -> float:
    """Fraction of peak a GEMM of ``flops`` reaches before the memory bound: saturating in size."""
    return r.gemm_efficiency * flops / (flops + r.gemm_half_flops) if flops > 0 else 0.0


def kernel_seconds(kernel: Kernel, r: Rates, host_s: float = 0.0) -> float:
    """All ``count`` launches of ``kernel``; ``host_s`` is the host's time to issue one."""
    move = kernel.bytes / r.memory_bw
    if kernel.kind == GEMM and kernel.flops > 0:
        compute = kernel.flops / (r.gemm_flops * gemm_efficiency(kernel.flops, r))
    elif kernel.kind == ATTENTION:
        compute = kernel.flops / (r.attention_flops * r.attention_efficiency)
    else:
        compute = 0.0
    if kernel.kind == FULL_GRAD:
        move *= r.expert_grad_passes
    return kernel.count * max(compute, move, host_s)


def kernels_seconds(kernels: Iterable[Kernel], r: Rates, host_s: float = 0.0) -> float:
    return math.fsum(kernel_seconds(k, r, host_s) for k in kernels)


# ---------------------------------------------------------------------------------------------
# What a layer runs


class _Op(NamedTuple):
    """An elementwise chain of HF's eager code: bytes per element (``fixed + per_b * b`` for a
    ``b``-byte dtype) and kernel launches, forward and backward."""

    fwd_fixed: int
    fwd_per_b: int
    fwd_launches: int
    bwd_fixed: int
    bwd_per_b: int
    bwd_launches: int


OPS = {
    # RMSNorm: upcast, square, mean, scale, downcast, weight; backward through all six in fp32
    "rms_norm": _Op(28, 4, 6, 56, 8, 12),
    # rotary on q or k: x * cos + rotate_half(x) * sin; backward also fills the halves' zero gradients
    "rotary": _Op(0, 10, 5, 0, 20, 10),
    "residual": _Op(0, 3, 1, 0, 6, 2),  # backward: the branches' gradients summed
    "silu_mul": _Op(0, 5, 2, 0, 10, 4),  # per intermediate element
    # gpt-oss, per intermediate element: strided gate / up views of the [n, 2I] projection, two
    # clamps, sigmoid, products; backward also zero-fills and sums the two strided views' gradients
    "clamped_swiglu": _Op(0, 20, 7, 0, 46, 16),
    "bias": _Op(0, 3, 1, 0, 0, 0),  # a bias added apart; its gradient is the linear's dbias
    "routing_weight": _Op(0, 3, 2, 0, 5, 2),  # gather the weights, scale the expert output
    "scatter_add": _Op(0, 3, 1, 0, 2, 1),  # index_add_ back into the tokens; backward gathers rows
    "gather": _Op(0, 2, 1, 0, 3, 3),  # x[idx]; backward sorts and index_put_s the rows (zero fill apart)
    "lora_scale_add": _Op(0, 5, 2, 0, 2, 1),  # per output element: * scaling, + base output
    "grad_sum": _Op(0, 0, 0, 0, 3, 1),  # backward only: two input gradients added
}


class _Recorder:
    """Collects a layer's forward and backward kernels as its modules are walked in order."""

    def __init__(self, b: int, full: bool, lora_rank: int | None, lora_experts: bool = True):
        self.b, self.full, self.lora, self.lora_experts = b, full, lora_rank or 0, lora_experts
        self.fwd: list[Kernel] = []
        self.bwd: list[Kernel] = []

    def op(self, kind: str, name: str, elements: float, count: float = 1) -> None:
        """Elementwise chain ``kind`` (see ``OPS``) over ``elements``, ``count`` times."""
        o, b = OPS[kind], self.b
        if o.fwd_launches:
            self.fwd.append(memory(name, elements * (o.fwd_fixed + o.fwd_per_b * b), o.fwd_launches, count))
        if o.bwd_launches:
            self.bwd.append(
                memory(f"{name} bwd", elements * (o.bwd_fixed + o.bwd_per_b * b), o.bwd_launches, count)
            )

    def linear(
        self,
        name: str,
        rows: float,
        fan_in: int,
        fan_out: int,
        *,
        count: float = 1,
        bias: bool = False,
        bias_apart: bool = False,
        adapted: bool = True,
    ) -> None:
        """``rows x fan_in -> rows x fan_out``, ``count`` times (once per expert); LoRA unless ``adapted=False``."""
        b = self.b
        self.fwd.append(gemm(name, rows, fan_out, fan_in, b, count))
        if bias and bias_apart:
            self.op("bias", f"{name} bias", rows * fan_out, count)
        self.bwd.append(gemm(f"{name} dX", rows, fan_in, fan_out, b, count))
        if self.full:
            self.bwd.append(gemm(f"{name} dW", fan_in, fan_out, rows, b, count))
            if bias:
                self.bwd.append(memory(f"{name} dbias", b * rows * fan_out, 1, count))
        r = self.lora if adapted and not self.full else 0
        if r:
            self.fwd += [
                gemm(f"{name} lora_A", rows, r, fan_in, b, count),
                gemm(f"{name} lora_B", rows, fan_out, r, b, count),
            ]
            self.bwd += [
                gemm(f"{name} lora_B dX", rows, r, fan_out, b, count),
                gemm(f"{name} lora_B dW", r, fan_out, rows, b, count),
                gemm(f"{name} lora_A dX", rows, fan_in, r, b, count),
                gemm(f"{name} lora_A dW", fan_in, r, rows, b, count),
            ]
            self.op("lora_scale_add", f"{name} lora scale+add", rows * fan_out, count)
            self.op("grad_sum", f"{name} lora dX sum", rows * fan_in, count)

    def grad_accumulate(self, params: float) -> None:
        """Add the layer's weight gradients into the runtime's fp32 accumulators on the device."""
        if params:
            self.bwd.append(memory("grad accumulate", params * (self.b + ACCUMULATOR_BYTES)))

    def attention(self, shape: ModelShape, window: int | None, seq_len: int, sequences: int) -> None:
        b, q, kv, heads = self.b, shape.q_dim, shape.kv_dim, shape.heads
        tokens = seq_len * sequences
        flops = 4.0 * heads * shape.head_dim * keys_per_query(seq_len, window) * tokens
        io = tokens * (b * (2 * q + 2 * kv) + FP32 * heads)  # q, k, v in; output and log-sum-exp out
        self.fwd.append(Kernel("attention", ATTENTION, flops, io))
        self.bwd.append(Kernel("attention bwd", ATTENTION, ATTENTION_BWD_FACTOR * flops, 2 * io))


def keys_per_query(seq_len: int, window: int | None) -> float:
    """Keys an average causal query attends to: ``(T + 1) / 2``, or at most ``window`` of them."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def _moe(rec: _Recorder, shape: ModelShape, tokens: int) -> None:
    """HF's eager MoE block: route, then loop over the experts (all of them get tokens here)."""
    b, h, e, k = rec.b, shape.hidden, shape.num_experts, shape.experts_per_tok
    im = shape.expert_width
    per_expert = tokens * k / e
    rec.linear("router", tokens, h, e, bias=shape.router_bias)
    # softmax / top-k over the router logits; the one-hot expert mask [E, k, tokens] (int64) and its sum
    rec.fwd.append(memory("routing", tokens * e * (b + 3 * FP32) + 2 * INT64 * tokens * k * e, 6))
    rec.bwd.append(memory("routing bwd", tokens * e * (b + 5 * FP32), 4))
    # per expert: find its tokens, gather them, run the expert, weight and scatter-add the result
    rec.fwd.append(memory("expert tokens", INT64 * k * tokens, 1, e))
    rec.op("gather", "expert gather", per_expert * h, e)
    if shape.fused_experts:
        rec.linear("gate_up_proj", per_expert, h, 2 * im, count=e, bias=True, bias_apart=True)
        rec.op("clamped_swiglu", "clamped swiglu", per_expert * im, e)
        rec.linear("down_proj", per_expert, im, h, count=e, bias=True, bias_apart=True)
    else:
        for name in ("gate_proj", "up_proj"):
            rec.linear(name, per_expert, h, im, count=e, adapted=rec.lora_experts, bias=shape.mlp_bias)
        rec.op("grad_sum", "gate/up dX sum", per_expert * h, e)
        rec.op("silu_mul", "silu*up", per_expert * im, e)
        rec.linear("down_proj", per_expert, im, h, count=e, adapted=rec.lora_experts, bias=shape.mlp_bias)
    rec.op("routing_weight", "routing weight", per_expert * h, e)
    rec.op("scatter_add", "scatter-add", per_expert * h, e)
    # index backward of each expert's gather: a zero-filled [tokens x H] gradient, summed into the total
    rec.bwd.append(memory("gather grad (full size)", b * tokens * h, 1, e, kind=FULL_GRAD))
    if shape.fused_experts and rec.full:
        # select backward of param[expert]: a zero-filled gradient of the whole fused tensor per expert
        fused = e * (h * 2 * im + 2 * im + im * h + h)
        rec.bwd.append(memory("fused expert grad (full size)", b * fused, 4, e, kind=FULL_GRAD))


def block_kernels(
    shape: ModelShape,
    layer: int,
    seq_len: int,
    sequences: int,
    b: int,
    lora_rank: int | None,
    lora_experts: bool,
    trained_params: int,
    mlp_recompute: bool = False,
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Forward and backward kernels of decoder layer ``layer`` for ``sequences`` x ``seq_len`` tokens;
    ``mlp_recompute``: the backward runs the MLP's forward kernels once more (token-chunked MLP)."""
    return _block_kernels(
        shape, shape.is_moe(layer), shape.window(layer), seq_len, sequences, b, lora_rank, lora_experts,
        trained_params, mlp_recompute,
    )  # fmt: skip


@lru_cache(maxsize=512)
def _block_kernels(
    shape: ModelShape,
    moe: bool,
    window: int | None,
    seq_len: int,
    sequences: int,
    b: int,
    lora_rank: int | None,
    lora_experts: bool,
    trained_params: int,
    mlp_recompute: bool = False,
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    tokens = seq_len * sequences
    h, q, kv, ab = shape.hidden, shape.q_dim, shape.kv_dim, shape.attention_bias
    rec = _Recorder(b, lora_rank is None, lora_rank, lora_experts)
    rec.op("rms_norm", "input_layernorm", tokens * h)
    rec.linear("q_proj", tokens, h, q, bias=ab)
    rec.linear("k_proj", tokens, h, kv, bias=ab)
    rec.linear("v_proj", tokens, h, kv, bias=ab)
    rec.op("grad_sum", "q/k/v dX sum", 2 * tokens * h)
    if shape.qk_norm:
        rec.op("rms_norm", "q_norm", tokens * q)
        rec.op("rms_norm", "k_norm", tokens * kv)
    rec.op("rotary", "rotary", tokens * (q + kv))
    rec.attention(shape, window, seq_len, sequences)
    rec.linear("o_proj", tokens, q, h, bias=ab)
    rec.op("residual", "residual", tokens * h)
    rec.op("rms_norm", "post_attention_layernorm", tokens * h)
    mlp_start = len(rec.fwd)
    if moe:
        _moe(rec, shape, tokens)
    else:
        i, mb = shape.dense_width, shape.mlp_bias
        rec.linear("gate_proj", tokens, h, i, bias=mb)
        rec.linear("up_proj", tokens, h, i, bias=mb)
        rec.op("grad_sum", "gate/up dX sum", tokens * h)
        rec.op("silu_mul", "silu*up", tokens * i)
        rec.linear("down_proj", tokens, i, h, bias=mb)
    if mlp_recompute:
        rec.bwd.extend(replace(k, name=f"{k.name} (recomputed)") for k in rec.fwd[mlp_start:])
    rec.op("residual", "residual", tokens * h)
    rec.grad_accumulate(trained_params)
    return tuple(rec.fwd), tuple(rec.bwd)


def head_kernels(
    hidden: int,
    rows: int,
    tokens: int,
    labelled: int,
    chunk: int,
    b: int,
    *,
    first: bool,
    trained: bool,
    trained_params: int,
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """One vocabulary shard of ``rows`` rows of the chunked LM head + loss (``models/head.py``).

    Per chunk of ``chunk`` labelled tokens: the logits GEMM and the fused cross-entropy pass
    (forward); the loss gradient, the hidden-state GEMM and, when trained, the weight GEMM
    (backward). The first shard also runs the final norm and, with masked labels, gathers the
    labelled rows; later shards unpack the packed fp32 hand-off of the shards before.
    """
    rec = _Recorder(b, trained, None)
    if first:
        rec.op("rms_norm", "norm", tokens * hidden)
        if labelled < tokens:
            rec.op("gather", "gather labelled", labelled * hidden)
    else:
        handoff = tokens * (hidden + 2) * (FP32 + b)
        rec.fwd.append(memory("unpack hand-off", handoff, 2))
        rec.bwd.append(memory("pack hand-off", handoff, 2))
    chunks = labelled / chunk
    rec.fwd.append(gemm("lm_head", chunk, rows, hidden, b, chunks))
    rec.fwd.append(memory("cross-entropy", chunk * rows * b, 1, chunks))
    rec.bwd.append(memory("cross-entropy bwd", chunk * rows * 2 * b, 1, chunks))
    rec.bwd.append(gemm("lm_head dX", chunk, hidden, rows, b, chunks))
    if trained:
        rec.bwd.append(gemm("lm_head dW", rows, hidden, chunk, b, chunks))
    rec.grad_accumulate(trained_params)
    return tuple(rec.fwd), tuple(rec.bwd)


def embed_kernels(
    vocab: int, hidden: int, tokens: int, b: int, trained: bool
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """The embedding lookup (a gather) and, when trained, its scatter-add backward into ``[V x H]``."""
    fwd = (memory("embedding gather", tokens * (INT64 + 2 * b * hidden)),)
    if not trained:
        return fwd, ()
    params = vocab * hidden
    bwd = (
        memory("embedding bwd", b * params + 2 * b * tokens * hidden, 3),
        memory("grad accumulate", params * (b + ACCUMULATOR_BYTES)),
    )
    return fwd, bwd


__all__ = [
    "ATTENTION",
    "FULL_GRAD",
    "GEMM",
    "MEMORY",
    "OPS",
    "Kernel",
    "Rates",
    "block_kernels",
    "embed_kernels",
    "gemm",
    "gemm_efficiency",
    "head_kernels",
    "kernel_seconds",
    "kernels_seconds",
    "keys_per_query",
    "memory",
    "rates",
]
