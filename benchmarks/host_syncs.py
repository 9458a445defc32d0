"""How many times a steady training step reads a device value on the host, per model family.

Such a read (``.item()``, ``bool(t)``, ``.all()`` as a condition, ``nonzero``, a copy to the host
that is not an ordered download) waits until the device's stream has run everything issued before
it: on a GPU the worker stops issuing ahead and the device idles through the next task's Python.
The cpu backend keeps CUDA's clock and counts every such read with its call site
(``pipe.stats()["host_syncs"]``). Each family of ``tests/support/tiny_models.py`` (and mixtral) is built
tiny, trained two steps with left padding and an attention mask, full and LoRA, on ``cpu:2``
with the roundpipe policy, one layer per stage; the table gives the second step's count and where
the reads come from. Dense families must read nothing; a mixture of experts routes tokens by
value, and the count says what its own routing code (transformers') needs.

    python benchmarks/host_syncs.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests", REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import write_results  # noqa: E402

MICROBATCHES = 4
RUN = dict(devices="cpu:2", num_microbatches=MICROBATCHES, policy="roundpipe", partition=None)


def _mixtral():
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


MOE = ("qwen3_moe", "mixtral")
# transformers runs a mixture of experts one of several ways: "grouped_mm" (its default here, one
# grouped matrix product over every expert's tokens) or "eager" (a Python loop over the experts hit,
# found with ``nonzero`` and ``where``: reads of device values on the host).
EXPERTS = ("grouped_mm", "eager")


def build(family: str, lora: bool, experts: str | None = None):
    from support.tiny_models import make_model

    if family == "mixtral":
        model = _mixtral()
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    else:
        model = make_model(family, lora="default" if lora else None)
    if experts is not None:
        model.set_experts_implementation(experts)  # a peft model hands it to the model it wraps
    return model


def measure(family: str, lora: bool, experts: str | None = None) -> dict:
    """Two steps; the second step's host syncs."""
    from support.tiny_models import make_batch

    import roundpipe

    batch = make_batch(batch=8, padding="left")
    with roundpipe.wrap(build(family, lora, experts), roundpipe.RunConfig(**RUN)) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for _ in range(2):
            pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
        syncs = pipe.stats()["host_syncs"]
    return {"family": family, "experts": experts, "mode": "lora" if lora else "full", **syncs}


def _where(row: dict) -> str:
    if not row["count"]:
        return "-"
    by_site = Counter()
    for site in row["sites"]:
        by_site[
            f"`{site['what']}` at {Path(site['where'].split(':')[0]).name}:{site['where'].split(':')[-1]}"
        ] += site["count"]
    return "; ".join(f"{n} x {where}" for where, n in by_site.most_common())


def main() -> None:
    import torch
    from support.tiny_models import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="llama and qwen3_moe only, full fine-tuning")
    args = parser.parse_args()
    torch.set_num_threads(1)
    families = ["llama", "qwen3_moe"] if args.quick else [*FAMILIES, "mixtral"]
    modes = (False,) if args.quick else (False, True)
    started = time.perf_counter()
    runs = [(f, None) for f in families if f not in MOE] + [
        (f, e) for f in families if f in MOE for e in EXPERTS
    ]
    rows = [measure(family, lora, experts) for family, experts in runs for lora in modes]
    elapsed = time.perf_counter() - started
    table = [
        [
            r["family"] + (f" ({r['experts']} experts)" if r["experts"] else ""),
            r["mode"],
            str(r["count"]),
            f"{r['count'] / (2 * MICROBATCHES):.1f}",
            _where(r),
            ", ".join(f"{n} x `{op}`" for op, n in sorted(r["eager_ops"].items())) or "-",
        ]
        for r in rows
    ]
    syncing = sorted(
        {r["family"] + (f" ({r['experts']} experts)" if r["experts"] else "") for r in rows if r["count"]}
    )
    notes = f"""
Host syncs of the second step (the first one measures and plans), counted by the cpu backend on
CUDA's clock: `cpu:2`, the roundpipe policy, one layer per stage, {MICROBATCHES} microbatches, a
batch of 8 x 12 tokens with left padding and an attention mask; "per microbatch pass" divides by
the {2 * MICROBATCHES} passes of a layer (each microbatch's forward, and its backward, which
recomputes the forward). Every count that is not zero comes from the model's own code
(transformers'), not from roundpipe's: {", ".join(syncing) or "none"}. transformers' `grouped_mm` experts
(the default here) read one value on the host per grouped product: torch's `_grouped_mm` copies
its group offsets to the host except on its fast path, bf16 on compute capability 9.x or 10.x
(`roundpipe/backend/grouped_mm.py`); the cpu backend stands for no particular GPU and counts it.
Its `eager` experts find the experts hit with `nonzero` and loop over them in Python, reading the
expert's index and its tokens for every expert hit in every layer pass. On a GPU each read stalls
the issuing thread until the stream drains: train mixtures of experts with grouped experts, in bf16
on a GPU with the fast path; on an RTX 4090 (8.9) every grouped product syncs in any dtype.

"ops run eagerly": ops with no meta kernel in this torch, which the cpu backend cannot queue, so it
waits for the stream and runs them on the issuing thread (not a host sync on CUDA, where they are
ordinary kernels; on the cpu backend they cost the run-ahead). Run time {elapsed:.0f} s:
`python benchmarks/host_syncs.py{" --quick" if args.quick else ""}`.
"""
    write_results(
        "host_syncs",
        {
            "command": " ".join(["python", "benchmarks/host_syncs.py", *sys.argv[1:]]),
            "rows": rows,
            "elapsed_s": elapsed,
        },
        table,
        [
            "family",
            "mode",
            "host syncs per step",
            "per microbatch pass",
            "where",
            "ops run eagerly on the cpu backend",
        ],
        notes,
    )
    dense = [r for r in rows if r["family"] not in MOE and r["count"]]
    if dense:
        raise SystemExit(f"dense families read device values on the host: {dense}")


if __name__ == "__main__":
    main()
