"""Frozen weights kept compressed (``RunConfig.quantization``): what nf4, int8 and fp8 save in host
RAM and over PCIe and what they cost in time, for Qwen3-235B-A22B LoRA on 8x RTX 4090 with 256 GiB
of host RAM and Qwen3-32B LoRA on one RTX 4090 with 64 GB, against bf16; AdamW's moments in bf16
or 8-bit blocks for Qwen3-32B full fine-tuning within 512 GiB; and, measured on this machine, the
host bytes a store really holds for the compressed weights of a small model and the CPU time of an
optimizer step with each kind of moments.

Plans: ``roundpipe plan``'s search (``sim.tune.tune``) for each precision with the host's RAM as
the limit (bf16 also with the preset's 1 TiB, to show what it would need); a what-if: nf4 with the
unpack as one pass over memory (reading the packed weight, writing the bf16 one), as a fused
kernel would do it, where the runtime's torch ops make about six (``partition/quant_layout.py``,
``UNPACK_TRAFFIC``); and the recipe's own schedule simulated in every precision side by side.

    python benchmarks/quantization.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib

from _common import write_results

from roundpipe.partition import quant_layout
from roundpipe.presets import GIB, load_hardware
from roundpipe.sim.scenario import Scenario, safe_run

FORMATS = (None, "nf4", "int8", "fp8")
# (label, model, server, host GiB, LoRA rank, LoRA on experts, batch, microbatches, round size)
SETTINGS = (
    ("Qwen3-235B-A22B LoRA r=32 (attention), 8x RTX 4090, 256 GiB", "qwen3-235b-a22b", "8xrtx4090", 256.0, 32,
     False, 64, 16, 8),
    ("Qwen3-32B LoRA r=16 (all linears), 1x RTX 4090, 64 GB", "qwen3-32b", "1xrtx4090", 64e9 / GIB, 16,
     True, 16, 4, None),
)  # fmt: skip
SEQ = 4096


@contextlib.contextmanager
def one_pass_unpack():
    """The cost model's unpack traffic as a fused kernel's: the packed bytes read, the result written."""
    saved = dict(quant_layout.UNPACK_TRAFFIC)
    quant_layout.UNPACK_TRAFFIC.update({"nf4": 0.5, "int8": 1.0, "fp8": 1.0})
    try:
        yield
    finally:
        quant_layout.UNPACK_TRAFFIC.update(saved)


def server(hardware: str, host_gib: float | None):
    return load_hardware(hardware, **({} if host_gib is None else {"host_memory_bytes": int(host_gib * GIB)}))


def scenario(setting, fmt, host_gib) -> Scenario:
    """The recipe's schedule (roundpipe, its microbatches and rounds) in precision ``fmt``."""
    _, model, hardware, _, rank, experts, batch, microbatches, round_size = setting
    return Scenario(
        model, server(hardware, host_gib), "roundpipe", seq_len=SEQ, global_batch=batch, lora_rank=rank,
        dtype="bf16", quantization=fmt, lora_experts=experts, microbatches=microbatches, round_size=round_size,
    )  # fmt: skip


def best_plan(setting, fmt, host_gib, budget_s: float):
    """``roundpipe plan``'s search in precision ``fmt`` with ``host_gib`` of host RAM (None: the preset's)."""
    from roundpipe.sim.tune import tune

    _, model, hardware, _, rank, experts, batch, _, _ = setting
    found = tune(
        model, server(hardware, host_gib), seq_len=SEQ, global_batch=batch, lora_rank=rank, dtype="bf16",
        quantization=fmt, lora_experts=experts, time_budget_s=budget_s,
    )  # fmt: skip
    return found.best.result


def row(label: str, w) -> dict:
    return {
        "case": label,
        "fits": bool(w.fits),
        "reason": None if w.fits else w.reason,
        "tokens_per_s": w.tokens_per_s,
        "step_s": w.iteration_s,
        "peak_gpu_gib": max(w.peak_gpu_bytes) / GIB,
        "host_gib": w.peak_host_bytes / GIB,
        "h2d_gb": w.h2d_bytes / 1e9,
        "compute_busy_s": max(w.compute_busy_s),
    }


def plans(quick: bool) -> list[dict]:
    rows = []
    budget = 5.0 if quick else 15.0
    for setting in SETTINGS if not quick else SETTINGS[1:]:
        label, _, _, host, *_ = setting
        rows.append(
            row(f"{label}: bf16, best plan, host RAM of the preset", best_plan(setting, None, None, budget))
        )
        for fmt in FORMATS if not quick else (None, "nf4"):
            rows.append(row(f"{label}: {fmt or 'bf16'}, best plan", best_plan(setting, fmt, host, budget)))
        with one_pass_unpack():
            rows.append(
                row(
                    f"{label}: nf4, best plan, what-if: a one-pass unpack",
                    best_plan(setting, "nf4", host, budget),
                )
            )
        for fmt in FORMATS if not quick else (None, "nf4"):
            rows.append(
                row(
                    f"{label}: {fmt or 'bf16'}, the recipe's schedule", safe_run(scenario(setting, fmt, host))
                )
            )
    return rows


def state_plans(quick: bool) -> list[dict]:
    """Qwen3-32B full fine-tuning on 8x RTX 4090 with 512 GiB of host RAM: AdamW's moments in fp32,
    bf16 and int8 (``optim.state_dtype``), the best plan of each."""
    from roundpipe.sim.tune import tune

    rows = []
    for state in ("fp32", "bf16") if quick else ("fp32", "bf16", "int8"):
        found = tune(
            "qwen3-32b", server("8xrtx4090", 512.0), seq_len=SEQ, global_batch=64, dtype="bf16",
            optimizer_state=state, time_budget_s=5.0 if quick else 15.0,
        )  # fmt: skip
        rows.append(
            row(
                f"Qwen3-32B full, 8x RTX 4090, 512 GiB: AdamW moments in {state}, best plan",
                found.best.result,
            )
        )
    return rows


def measured_optimizer_step(quick: bool) -> list[dict]:
    """One AdamW step over 16M fp32 parameters on this machine's CPU, the moments stored in each
    dtype: medians of the steps after the first (which makes the state), side by side."""
    import os
    import statistics
    import time

    import torch

    from roundpipe.optim import LayerwiseAdamW, OptimizerConfig

    torch.set_num_threads(1)
    n = (1 << 20) if quick else (1 << 24)
    out = []
    load = os.getloadavg()[0]
    for state in ("fp32", "bf16", "int8"):
        master = torch.nn.Parameter(torch.randn(n))
        entry = _Entry(master, torch.randn(n) * 1e-3)
        adamw = LayerwiseAdamW(_Store([entry]), OptimizerConfig(lr=1e-3, state_dtype=state))
        times = []
        for _ in range(3 if quick else 6):
            entry.has_grad = True
            t0 = time.perf_counter()
            adamw.step_group(0)
            times.append(time.perf_counter() - t0)
        out.append(
            {"state_dtype": state, "params": n, "median_s": statistics.median(times[1:]), "times_s": times}
        )
    for r in out:
        r["vs_fp32"] = r["median_s"] / out[0]["median_s"]
        r["load_average"] = load
    return out


class _Entry:
    """One trainable tensor as ``LayerwiseAdamW`` sees it (``optim.SteppedEntry``)."""

    key, name, trainable, owner = 0, "w", True, 0

    def __init__(self, master, grad):
        self.master, self.grad, self.has_grad = master, grad, True

    def discard_grad(self) -> None:  # the gradient stays: every measured step reads the same one
        self.has_grad = False


class _Store:
    def __init__(self, entries):
        self.entries = entries

    def refresh_compute(self, keys, into=None) -> None:
        pass


def measured_host_bytes() -> list[dict]:
    """The store's buffers of the compressed weights (measured), against the same weights in bf16,
    for a Qwen3 of hidden 512 and 2 blocks (pageable host memory: the bytes are the tensors')."""
    import torch
    import transformers

    import roundpipe

    config = transformers.Qwen3Config(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    import peft

    out, bf16 = [], None
    for fmt in FORMATS:
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear"))
        run = roundpipe.RunConfig(devices="cpu:1", dtype="bf16", host_memory="pageable", quantization=fmt)
        with roundpipe.wrap(model, run) as pipe:
            if fmt is None:  # the same weights: the blocks' frozen matrices
                picked = [
                    e
                    for e in pipe.store.entries
                    if "layers." in e.name and e.tensor.dim() == 2 and not e.trainable
                ]
            else:
                picked = [e for e in pipe.store.entries if e.quant is not None]
            held = sum(b.untyped_storage().nbytes() for e in picked for b in e.buffers)
            total = pipe.store.host_memory_stats()["static_requested_bytes"]
        base = model.unload()  # the plain model back for the next format
        bf16 = held if fmt is None else bf16
        out.append(
            {"format": fmt or "bf16", "frozen_weight_bytes": held, "ratio": held / bf16, "store_bytes": total}
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 32B setting only, bf16 and nf4 (CI smoke)")
    args = ap.parse_args()
    rows = plans(args.quick) + state_plans(args.quick)
    host = measured_host_bytes()
    steps = measured_optimizer_step(args.quick)
    table = [
        [
            r["case"],
            f"{r['tokens_per_s']:,.0f}" if r["fits"] else f"does not fit: {r['reason'].split(' (')[0][:60]}",
            f"{r['step_s']:.1f}",
            f"{r['compute_busy_s']:.1f}",
            f"{r['h2d_gb']:,.0f}",
            f"{r['peak_gpu_gib']:.1f}",
            f"{r['host_gib']:.0f}",
        ]
        for r in rows
    ]
    table += [
        [
            f"measured: a Qwen3 (hidden 512, 2 blocks) store, frozen block weights in {h['format']}",
            "",
            "",
            "",
            "",
            "",
            f"{h['frozen_weight_bytes']:,} B ({h['ratio']:.3f}x bf16)",
        ]
        for h in host
    ]
    table += [
        [
            f"measured: one AdamW step over {st['params'] / 2**20:.0f}M parameters on this CPU (1 thread), "
            f"moments in {st['state_dtype']}",
            "",
            f"{st['median_s']:.3f} ({st['vs_fp32']:.2f}x fp32)",
            "",
            "",
            "",
            "",
        ]
        for st in steps
    ]
    notes = NOTES + f"\nLoad average when the optimizer steps were timed: {steps[0]['load_average']:.2f}.\n"
    write_results(
        "quantization",
        {
            "seq_len": SEQ,
            "plans": rows,
            "measured_host_bytes": host,
            "optimizer_step": steps,
            "quick": args.quick,
        },
        table,
        ["case", "tokens/s", "step s", "busiest GPU computing s", "PCIe up GB/step", "GPU GiB", "host GiB"],
        notes,
    )


NOTES = """
Simulated (the cost model, `partition/quant_layout.py` for the packed layout and the unpacking),
except the last rows, which measure the store's buffers on this machine. "the recipe's schedule":
roundpipe, the microbatches of `recipes/qwen3-235b-a22b-qlora-8x4090.yaml` (16 in rounds of 8) and
`recipes/qwen3-32b-qlora-1x4090.yaml` (4), every precision on the same schedule.

Where the time goes. Both settings are compute-bound with these batches, so the PCIe bytes nf4
saves (about half of the upload traffic for 235B, where activations are the other half) buy no
time, and the unpacking adds to every layer's forward and to its backward's recompute, once per
microbatch: for 235B each block's 2.4 billion expert weights are unpacked twice per microbatch,
each time about 14.5 bytes of memory traffic per weight with the runtime's torch ops (int32
indices, an fp32 gather, the scaling into bf16) -- about 35 ms on an RTX 4090, against about 36 ms
for the layer's compute. A one-pass kernel (the what-if row: 2.5 bytes per weight) takes most of
that back. For 32B on one GPU the layer's compute per microbatch is larger against its weights,
so nf4 costs a few percent.

What nf4 buys: the 235B fine-tune fits 256 GiB of host RAM (bf16 needs about 625 GiB), and 32B fits
a 64 GB workstation (bf16 needs about 76 GiB). int8 and fp8 keep about half of bf16's bytes: for
235B that is about 240 GiB of model state, at the edge of 256 GiB, so a plan fits only with few
stage inputs kept on the host, and the search finds one for fp8 at a lower speed and none for int8
within its time budget (the two differ only in the unpack's traffic, 17 against 9 bytes per
weight). A row that does not fit shows that plan's figures for what it would need. The measured rows: the store holds each compressed
weight as its packed bytes and nothing else, 0.258x of bf16 for nf4 (0.5 bytes per weight, a byte
per 64 for the absmax codes, the second-level scales), about 0.5x for int8 and fp8 (a byte per
weight and an fp32 scale per row of 512).

AdamW's moments (`optim.state_dtype`, full fine-tuning): the model state of Qwen3-32B is 549 GiB
with fp32 moments (2 bytes of bf16 weights, 4 of fp32 master, 4 of gradient and 8 of moments per
parameter), which with the stage inputs does not fit 512 GiB; bf16 moments take 4 bytes off per
parameter and int8 (8-bit blocks) 6, and both fit. The simulator times the CPU optimizer by an
fp32 step's memory traffic for every state dtype; the measured rows show what coding the moments
costs on the CPU (decoding to fp32 and encoding after the fused step; the int8 search for the
nearest code is a binary search per value), which the plan's step hides only while the optimizer
stays off the critical path.
"""


if __name__ == "__main__":
    main()
