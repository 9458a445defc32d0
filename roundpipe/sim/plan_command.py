"""``roundpipe plan``: which policy, partition and microbatch count to use (the tuner), or with
``--max-seq-len`` the longest sequence that fits.

Examples::

    roundpipe plan --model qwen3-235b-a22b --hardware 8xrtx4090 --seq-len 4096 --lora-rank 16
    roundpipe plan --model qwen3-8b --hardware 8xrtx4090 --max-seq-len --json

Prints the best plan and a ranked table of alternatives, or with ``--json`` one JSON object (the
best plan's policy, num_microbatches, tokens_per_s, iteration_s, bubble_fraction, peak_gpu_bytes,
peak_host_bytes, fits, plus ``alternatives`` and, when asked, ``max_seq_len``).
"""

from __future__ import annotations

import argparse
import sys

from roundpipe.errors import ConfigError, RoundpipeError
from roundpipe.sim.report import dumps, result_table
from roundpipe.sim.simulate_command import add_model_args, model_settings
from roundpipe.sim.tune import DEFAULT_TIME_BUDGET_S


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="roundpipe plan", description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--max-seq-len", action="store_true", help="find the longest sequence that fits instead")
    ap.add_argument("--policies", default=None, help="comma-separated policies to search (default: all)")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help=f"seconds the search may take (default {DEFAULT_TIME_BUDGET_S:.0f})",
    )
    ap.add_argument("--top", type=int, default=12, help="rows of the ranked table to print")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    try:
        from roundpipe.sim.tune import format_ranked, max_seq_len, tune

        if args.max_seq_len:
            n, res = max_seq_len(args.model, args.hardware, **model_settings(args))
            if args.json:
                out = {"model": args.model, "hardware": args.hardware, "max_seq_len": n}
                out.update(res.to_dict() if res is not None else {"fits": False})
                out["max_seq_len"] = n
                print(dumps(out))
            else:
                print(
                    f"{args.model} on {args.hardware}: the longest sequence that fits is {n} tokens (roundpipe)"
                )
                if res is not None:
                    print(result_table(res))
            return
        if args.seq_len is None:
            raise ConfigError("give --seq-len N (or --max-seq-len to find the longest that fits)")
        policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
        result = tune(
            args.model,
            args.hardware,
            seq_len=args.seq_len,
            optimizer=args.optimizer,
            policies=policies,
            time_budget_s=args.time_budget,
            **model_settings(args),
        )
    except (RoundpipeError, ValueError) as err:
        print(f"roundpipe plan: error: {err}", file=sys.stderr)
        sys.exit(2)
    best = result.best
    if args.json:
        out = {"model": args.model, "hardware": args.hardware, "seq_len": args.seq_len}
        out.update(best.result.to_dict())
        out.update(best.summary())
        out["alternatives"] = [c.summary() for c in result.ranked[1:]]
        out["search_s"] = result.elapsed_s
        out["notes"] = list(result.notes) + list(best.result.notes)
        print(dumps(out))
        return
    tuned = "full" if args.lora_rank is None else f"LoRA r={args.lora_rank}"
    print(
        f"best plan for {args.model} on {args.hardware}, seq {args.seq_len}, batch {args.global_batch}, {tuned}: "
        f"{best.policy} with {best.microbatches} microbatches, {best.stages[0]} forward / {best.stages[1]} backward "
        f"stages, {best.head_shards} head shard(s)"
    )
    print(result_table(best.result))
    print()
    print(f"ranked alternatives (searched {len(result.ranked)} in {result.elapsed_s:.1f} s):")
    print(format_ranked(result, args.top))
    for n in result.notes:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
