"""Where the bytes go at long sequence: Qwen3-32B (full) and Qwen3-235B-A22B (LoRA r=32) on 8x RTX
4090 in fp16, at the RoundPipe paper's longest sequences and at roundpipe's, with each block's MLP
in one piece (before) and in token chunks of 4,096 (``RunConfig.mlp_chunk_tokens``, after).

For the fullest device (one running a backward stage of one decoder layer, the finest recompute
grain) the memory rule's terms (``partition/memory.py``), the activations split by part
(``partition.cost.activation_parts``); for the host, the model state and what a plan keeps
besides it (stage inputs, hand-offs), simulated for the finest plan: a forward stage per device, a
layer per backward stage, 64 microbatches of one sequence in rounds of 8.

    python benchmarks/long_context_bytes.py
"""

from __future__ import annotations

import argparse

from _common import write_results

from roundpipe.partition.cost import (
    SAVED,
    TRANSIENT_ATTENTION,
    TRANSIENT_GRADS,
    TRANSIENT_MLP,
    activation_parts,
    model_costs,
)
from roundpipe.partition.memory import device_reserve_bytes, largest_others
from roundpipe.partition.shape import model_shape
from roundpipe.presets import GIB, load_hardware, load_model_config
from roundpipe.sim.options import SimOptions
from roundpipe.sim.scenario import Scenario, prepare
from roundpipe.sim.simulator import simulate

PAPER_HOST_GIB = 800e9 / GIB
CHUNK = 4096
# (label, model, LoRA rank, tokens, MLP chunk): the paper's longest sequences, before and after
# the MLP in chunks, and roundpipe's longest with them (`roundpipe plan --max-seq-len --dtype fp16
# --host-ram 745 --mlp-chunk-tokens 4096`, global batch 64; 32B stops at its 40,960 positions).
CASES = (
    ("32B full, 28,672 (paper), MLP whole", "qwen3-32b", None, 28_672, None),
    ("32B full, 28,672, MLP in chunks", "qwen3-32b", None, 28_672, CHUNK),
    ("32B full, 40,960, MLP in chunks", "qwen3-32b", None, 40_960, CHUNK),
    ("235B LoRA, 31,744 (paper), MoE whole", "qwen3-235b-a22b", 32, 31_744, None),
    ("235B LoRA, 31,744, MoE in chunks", "qwen3-235b-a22b", 32, 31_744, CHUNK),
    ("235B LoRA, 34,432, MoE in chunks", "qwen3-235b-a22b", 32, 34_432, CHUNK),
)
MICROBATCHES, ROUND = 64, 8


def device_rows(model: str, lora: int | None, tokens: int, chunk: int | None, hw) -> dict[str, int]:
    """The memory rule's terms for a device running the backward stage of one decoder layer."""
    config = load_model_config(model)
    costs = model_costs(config, tokens, 1, dtype="fp16", lora_rank=lora, mlp_chunk_tokens=chunk)
    i = 1  # layers.0: every decoder layer costs the same in these models
    layer = costs[i]
    others = largest_others([c.param_bytes for c in costs])
    draining = largest_others([c.grad_device_bytes for c in costs])
    parts = activation_parts(model_shape(config), 0, tokens, 2, chunk)
    rows = {
        "weights of the stage (fp16)": layer.param_bytes,
        "next stage prefetched (the largest other)": others[i],
        "fp32 gradients of the stage": layer.grad_device_bytes,
        "gradients of the previous stage draining": draining[i],
    }
    rows.update({k: v for k, v in parts.items() if k.startswith(SAVED)})
    widest = max((TRANSIENT_ATTENTION, TRANSIENT_MLP), key=parts.__getitem__)  # the rule takes the larger
    rows[TRANSIENT_GRADS], rows[widest] = parts[TRANSIENT_GRADS], parts[widest]
    rows["workspace (CUDA context, cuBLAS)"] = device_reserve_bytes(hw)
    assert sum(v for k, v in rows.items() if k.startswith(SAVED)) == layer.saved_bytes
    return rows


def host_rows(model: str, lora: int | None, tokens: int, chunk: int | None, hw) -> dict[str, int]:
    """Host RAM of the finest plan (see the module docstring), simulated without its device check."""
    config = load_model_config(model)
    n = len(model_costs(config, tokens, 1, dtype="fp16", lora_rank=lora))
    step = -(-n // hw.num_gpus)
    forward = tuple(sorted({*range(0, n, step), n}))
    s = Scenario(
        model, hw, "roundpipe", seq_len=tokens, global_batch=MICROBATCHES, microbatches=MICROBATCHES,
        lora_rank=lora, dtype="fp16", partitions=(forward, tuple(range(n + 1))), head_shards=1, round_size=ROUND,
        mlp_chunk_tokens=chunk,
    )  # fmt: skip
    prep = prepare(s)
    res = simulate(prep.table, prep.workload, prep.hardware, SimOptions(record_timeline=False))
    state = prep.workload.host_state_bytes
    return {
        "model state (weights, fp32 gradients and AdamW state of the trained ones)": state,
        "stage inputs and hand-offs (two rounds of 8 microbatches)": res.peak_host_bytes - state,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    hw = load_hardware("8xrtx4090")
    device = {label: device_rows(m, r, t, c, hw) for label, m, r, t, c in CASES}
    host = {label: host_rows(m, r, t, c, hw) for label, m, r, t, c in CASES}
    labels = [c[0] for c in CASES]
    keys = list(dict.fromkeys(k for label in labels for k in device[label]))
    table = []
    for k in keys:
        table.append([f"GPU: {k}", *(f"{device[lb].get(k, 0) / GIB:.2f}" for lb in labels)])
    table.append(
        ["**GPU total** (of 24.00)", *(f"**{sum(device[lb].values()) / GIB:.2f}**" for lb in labels)]
    )
    for k in host[labels[0]]:
        table.append([f"host: {k}", *(f"{host[lb][k] / GIB:.1f}" for lb in labels)])
    table.append(
        [
            f"**host total** (of {PAPER_HOST_GIB:.1f})",
            *(f"**{sum(host[lb].values()) / GIB:.1f}**" for lb in labels),
        ]
    )
    notes = """
GiB. The GPU rows are the memory rule's (`partition/memory.py`) for the device that runs one decoder
layer's backward stage, the fullest device of a long-sequence plan: the layer's fp16 weights, the
next stage's prefetched beside them, its fp32 gradient buffer, the previous stage's gradients still
downloading, the activations autograd saves while the layer recomputes (by part,
`partition.cost.activation_parts`) and the largest transient of its backward, plus the workspace
every device keeps. The host rows simulate the finest plan (a forward stage per device, one layer
per backward stage, 64 microbatches of one sequence in rounds of 8) without its device check.

Where the bytes go: at these lengths the activations of one layer outweigh its weights (32B: 8.5
GiB saved and 4.7 GiB transient at 28,672 tokens against 0.9 GiB of weights); the MLP's saved
intermediates are the largest part (4 x 25,600 values per token for 32B) and, for 235B, the MoE's
dispatched copies and expert outputs beside them (2 x 8 x 4,096 per token). For 235B the weights
of a layer (4.8 GiB, experts included) and its prefetched neighbour take 9.5 GiB before any
activation: at 31,744 tokens with the MoE in one piece the rule needs 27.5 GiB, which is why the
GPUs bound it at 21,760.

After: with the MLP (the MoE block) in chunks of 4,096 tokens (`RunConfig.mlp_chunk_tokens`,
`runtime/mlp_chunks.py`) autograd saves no MLP intermediate and no dispatched copy for the stage;
the backward recomputes one chunk's at a time, beside its gradients and the MLP input's gradient
gathered over the chunks: 13.4 GiB instead of 21.3 for 32B at 28,672 tokens, 16.6 instead of 27.5
for 235B at 31,744. The host figures do not change at a given length (the stage inputs are the
layers' inputs, not the MLP's): with the GPUs freed, host RAM is what binds 235B, at 34,432.
"""
    write_results(
        "long_context_bytes",
        {"cases": [dict(zip(("label", "model", "lora_rank", "tokens", "mlp_chunk_tokens"), c)) for c in CASES],
         "device_bytes": device, "host_bytes": host},
        table,
        ["bytes (GiB)", *labels],
        notes,
    )  # fmt: skip


if __name__ == "__main__":
    main()
