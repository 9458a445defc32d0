"""Print partition plans: ``roundpipe partition [model ...] [--hardware 8xrtx4090] ...``.

Without model names it prints the recorded reference set: balance of Qwen3-1.7B, Qwen3-8B and
Llama-3.1-8B on 8 stages, and the 24 GB memory plans of Qwen3-8B and Qwen3-32B (full) and
Qwen3-235B-A22B (LoRA r=16), all at sequence length 4096 on 8x RTX 4090.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from roundpipe.errors import RoundpipeError
from roundpipe.partition.model_plan import plan_partitions

REFERENCE: tuple[tuple[str, dict[str, Any]], ...] = (
    ("qwen3-1.7b", dict(stages=8)),
    ("qwen3-8b", dict(stages=8)),
    ("llama3.1-8b", dict(stages=8)),
    ("qwen3-8b", dict()),
    ("qwen3-32b", dict()),
    ("qwen3-235b-a22b", dict(lora_rank=16)),
)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and print one plan per model; a PlanError/ConfigError exits with status 2."""
    ap = argparse.ArgumentParser(prog="roundpipe partition", description=__doc__)
    ap.add_argument(
        "models", nargs="*", help="preset names or config.json paths (default: the reference set)"
    )
    ap.add_argument("--hardware", default="8xrtx4090")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--stages", type=int, default=None, help="stages per partition (default: auto)")
    ap.add_argument("--lora", type=int, default=None, help="LoRA rank (default: full fine-tuning)")
    ap.add_argument("--head-shards", default="auto")
    ap.add_argument("--json", action="store_true", help="print PartitionPlan.to_json() instead of the table")
    args = ap.parse_args(argv)
    shards = args.head_shards if args.head_shards == "auto" else int(args.head_shards)
    if args.models:
        jobs = [(m, dict(stages=args.stages, lora_rank=args.lora, head_shards=shards)) for m in args.models]
    else:
        jobs = list(REFERENCE)
    for model, kw in jobs:
        try:
            p = plan_partitions(model, args.hardware, seq_len=args.seq, micro_batch_size=args.mbs, **kw)
        except RoundpipeError as err:
            print(f"{model}: {type(err).__name__}: {err}", file=sys.stderr)
            sys.exit(2)
        print(p.to_json() if args.json else p.table())
        print()


if __name__ == "__main__":
    main()
