"""``roundpipe costs``: what the cost model predicts for each layer of one microbatch on one GPU.

Examples::

    roundpipe costs --model qwen3-32b --hardware rtx4090 --seq-len 2048 --microbatch-size 4 \\
        --dtype fp16 --fp16-accumulation
    roundpipe costs --model qwen3-235b-a22b --seq-len 4096 --lora-rank 16 --head-shards 4 --json
    roundpipe costs --calibration

Per layer, named as the runtime names them (``embed``, ``layers.i``, ``head`` or ``head.0`` ..
``head.{k-1}``): forward seconds, backward seconds without the recompute forward, FLOPs, and bytes
(weights on the device, the input a stage starting here keeps, what autograd saves while the layer
backpropagates, and the transient of its backward); then totals. ``--calibration`` prints the
measured layer times the cost model is fitted on (``presets/measured_layers.json``) next to its
predictions. ``--json`` prints one JSON object instead. Bad settings exit with status 2 and say
what to change.
"""

from __future__ import annotations

import argparse
import sys

from roundpipe.errors import RoundpipeError
from roundpipe.partition.layer_rows import CalibrationRow, LayerRow, calibration, layer_rows, totals
from roundpipe.partition.quant_layout import QUANTIZATIONS
from roundpipe.presets import load_measured_layers
from roundpipe.sim.report import dumps

GIB = 1 << 30


def _bytes(n: float) -> str:
    return f"{n / GIB:8.3f}"


def layers_table(rows: list[LayerRow], title: str) -> str:
    lines = [
        title,
        f"  {'layer':<12} {'fwd ms':>9} {'bwd ms':>9} {'fwd TFLOP':>10} {'params GiB':>11} "
        f"{'act in GiB':>11} {'saved GiB':>10} {'transient GiB':>14}",
    ]
    for r in rows:
        lines.append(
            f"  {r.name:<12} {r.forward_s * 1e3:9.3f} {r.backward_s * 1e3:9.3f} {r.fwd_flops / 1e12:10.3f} "
            f"{_bytes(r.param_bytes):>11} {_bytes(r.act_in_bytes):>11} {_bytes(r.saved_bytes):>10} "
            f"{_bytes(r.transient_bytes):>14}"
        )
    t = totals(rows)
    lines += [
        f"  {'total':<12} {t['forward_s'] * 1e3:9.3f} {t['backward_s'] * 1e3:9.3f} "
        f"{t['fwd_flops'] / 1e12:10.3f} {_bytes(t['param_bytes']):>11} {'':>11} {_bytes(t['saved_bytes']):>10}",
        f"  backward stages with recompute: {t['backward_stage_s'] * 1e3:.3f} ms; "
        f"{t['tflops_per_s']:.1f} TFLOP/s over forward + backward",
    ]
    return "\n".join(lines)


def calibration_table(rows: list[CalibrationRow]) -> str:
    s = load_measured_layers()["setting"]
    lines = [
        f"measured (presets/measured_layers.json) vs predicted on {s['hardware']}, {s['microbatch_size']} x "
        f"{s['seq_len']} tokens, {s['dtype']}{' with fp16 accumulation' if s['fp16_accumulation'] else ''}",
        f"  {'model':<18} {'tuning':<10} {'quantity':<9} {'measured ms':>12} {'predicted ms':>13} {'error':>7}",
    ]
    for r in rows:
        tuning = "full" if r.lora_rank is None else f"LoRA r={r.lora_rank}"
        lines.append(
            f"  {r.model:<18} {tuning:<10} {r.quantity:<9} {r.measured_s * 1e3:12.3f} "
            f"{r.predicted_s * 1e3:13.3f} {r.error:+7.1%}"
        )
    lines.append(f"  largest error: {max(abs(r.error) for r in rows):.1%}")
    return "\n".join(lines)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="roundpipe costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="preset name (e.g. gpt-oss-20b) or path to a config.json")
    ap.add_argument("--hardware", default="rtx4090", help="GPU (or server spec) to time on (default rtx4090)")
    ap.add_argument("--seq-len", type=_positive, default=None, help="tokens per sequence")
    ap.add_argument(
        "--microbatch-size", type=_positive, default=1, help="sequences per microbatch (default 1)"
    )
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument(
        "--fp16-accumulation",
        action="store_true",
        help="fp16 GEMMs accumulate in fp16 (needs --dtype fp16), as RunConfig(fp16_accumulation=True) runs",
    )
    ap.add_argument("--lora-rank", type=_positive, default=None, help="LoRA rank (default: full fine-tuning)")
    ap.add_argument(
        "--head-shards", type=_positive, default=1, help="vocabulary shards of the LM head (default 1)"
    )
    ap.add_argument(
        "--label-fraction", type=float, default=1.0, help="share of tokens with a label (default 1)"
    )
    ap.add_argument(
        "--mlp-chunk-tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="each block's MLP in token chunks of at most N tokens (RunConfig.mlp_chunk_tokens; default: in one piece)",
    )
    ap.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="the blocks' frozen linear weights kept compressed (RunConfig.quantization; needs --lora-rank)",
    )
    ap.add_argument(
        "--calibration",
        action="store_true",
        help="print the measured layer times the cost model is fitted on next to its predictions",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if not args.calibration and (args.model is None or args.seq_len is None):
        ap.error("give --model M and --seq-len S (or --calibration for the measured-vs-predicted table)")
    try:
        if args.calibration:
            rows = calibration()
        else:
            layers = layer_rows(
                args.model,
                args.hardware,
                seq_len=args.seq_len,
                microbatch_size=args.microbatch_size,
                dtype=args.dtype,
                fp16_accumulation=args.fp16_accumulation,
                lora_rank=args.lora_rank,
                head_shards=args.head_shards,
                label_fraction=args.label_fraction,
                mlp_chunk_tokens=args.mlp_chunk_tokens,
                quantization=args.quantization,
            )
    except (RoundpipeError, ValueError) as err:
        print(f"roundpipe costs: error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.calibration:
        if args.json:
            print(
                dumps(
                    {
                        "setting": load_measured_layers()["setting"],
                        "rows": [{**r.__dict__, "error": r.error} for r in rows],
                        "max_abs_error": max(abs(r.error) for r in rows),
                    }
                )
            )
        else:
            print(calibration_table(rows))
        return
    if args.json:
        out = {
            "model": args.model,
            "hardware": args.hardware,
            "seq_len": args.seq_len,
            "microbatch_size": args.microbatch_size,
            "tokens": args.seq_len * args.microbatch_size,
            "dtype": args.dtype,
            "fp16_accumulation": args.fp16_accumulation,
            "lora_rank": args.lora_rank,
            "head_shards": args.head_shards,
            "label_fraction": args.label_fraction,
            "mlp_chunk_tokens": args.mlp_chunk_tokens,
            "quantization": args.quantization,
            "layers": [r.__dict__ for r in layers],
            "totals": totals(layers),
        }
        print(dumps(out))
        return
    tuning = "full" if args.lora_rank is None else f"LoRA r={args.lora_rank}"
    acc = " with fp16 accumulation" if args.fp16_accumulation else ""
    title = (
        f"{args.model} on one GPU of {args.hardware}, {args.microbatch_size} x {args.seq_len} tokens, {tuning}, "
        f"{args.dtype}{acc}: per-layer time of one microbatch (backward without recompute)"
    )
    print(layers_table(layers, title))


if __name__ == "__main__":
    main()
