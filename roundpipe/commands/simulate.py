"""``roundpipe simulate``: how fast one configuration runs, and whether it fits, before a GPU is touched.

Example::

    roundpipe simulate --model qwen3-8b --hardware 8xrtx4090 --policy 1f1b --seq-len 4096 \\
        --global-batch 64 --lora-rank 16 --timeline step.png --trace step.json

Prints a readable table, or with ``--json`` one JSON object (policy, num_microbatches,
tokens_per_s, iteration_s, bubble_fraction, peak_gpu_bytes, peak_host_bytes, fits, ...). Bad
settings exit with status 2 and a message saying what to change.
"""

from __future__ import annotations

import argparse
import json
import sys

from roundpipe.commands.model_args import (
    HOST_HELP,
    add_model_args,
    host_fields,
    host_text,
    model_settings,
    target,
)
from roundpipe.errors import ConfigError, RoundpipeError
from roundpipe.schedule import POLICIES, PROVISIONAL_POLICY
from roundpipe.sim.options import SimOptions
from roundpipe.sim.report import dumps, result_table


def parse_times(path: str | None) -> dict | None:
    """Measured per-layer times: a JSON object ``{"layers.3": [forward_s, backward_s], ...}``."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return {str(k): (float(v[0]), float(v[1])) for k, v in data.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise ConfigError(
            f"cannot read measured times from {path!r}: {e}; expected {{name: [fwd_s, bwd_s]}}"
        ) from None


def _stages(text: str | None):
    if text is None:
        return None
    parts = text.split(",")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--stages takes N or F,B (forward,backward), got {text!r}") from None
    return vals[0] if len(vals) == 1 else tuple(vals)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="roundpipe simulate", description=__doc__.split("\n\n")[0], epilog=HOST_HELP
    )
    add_model_args(ap, seq_required=True)
    ap.add_argument("--policy", default=PROVISIONAL_POLICY, choices=list(POLICIES))
    ap.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="default: one sequence per microbatch; any count up to the batch (uneven sizes are fine)",
    )
    ap.add_argument(
        "--round-size", type=int, default=None,
        help="roundpipe: deal microbatches in rounds of this many (>= devices); bounds the host's saved inputs",
    )  # fmt: skip
    ap.add_argument("--stages", default=None, help="stage count N, or F,B for roundpipe (default: automatic)")
    ap.add_argument("--head-shards", default="auto", help="vocabulary shards of the LM head (default: auto)")
    ap.add_argument("--times", default=None, help="JSON file of measured per-layer [forward_s, backward_s]")
    ap.add_argument(
        "--per-microbatch-grads",
        action="store_true",
        help="what-if: send weight gradients down after every microbatch instead of summing them on the device",
    )
    ap.add_argument("--timeline", default=None, help="write a PNG Gantt chart of the step here")
    ap.add_argument("--trace", default=None, help="write a Chrome trace (open in Perfetto) here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    try:
        from roundpipe.sim.scenario import Scenario, run_scenario

        model, server = target(args)
        shards = args.head_shards if args.head_shards == "auto" else int(args.head_shards)
        scenario = Scenario(
            model=model,
            hardware=server,
            policy=args.policy,
            seq_len=args.seq_len,
            microbatches=args.microbatches,
            round_size=args.round_size,
            optimizer=args.optimizer,
            head_shards=shards,
            stages=_stages(args.stages),
            times=parse_times(args.times),
            **model_settings(args),
        )
        record = bool(args.timeline or args.trace)
        result = run_scenario(
            scenario, SimOptions(accumulate_grads=not args.per_microbatch_grads, record_timeline=record)
        )
        timeline = result.timeline
        if timeline is not None and args.trace:
            timeline.save_chrome_trace(args.trace)
        if timeline is not None and args.timeline:
            from roundpipe.sim.gantt import save_gantt

            save_gantt(timeline, args.timeline, title=_title(scenario, result))
    except (RoundpipeError, ValueError) as err:
        print(f"roundpipe simulate: error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        out = {
            "model": scenario.model_name,
            "hardware": args.hardware,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "lora_rank": args.lora_rank,
            "label_fraction": args.label_fraction,
            **host_fields(server),
            **result.to_dict(),
        }
        print(dumps(out))
    else:
        print(result_table(result, _title(scenario, result)))


def _title(s, r) -> str:
    tune = "full" if s.lora_rank is None else f"LoRA r={s.lora_rank}"
    return (
        f"{s.model_name} on {r.num_devices} devices of {s.hardware if isinstance(s.hardware, str) else s.hardware.name} "
        f"({host_text(s.hardware) if not isinstance(s.hardware, str) else 'preset host'}), "
        f"{s.policy}, seq {s.seq_len}, batch {s.global_batch}, {tune}, {s.dtype}"
    )


if __name__ == "__main__":
    main()
