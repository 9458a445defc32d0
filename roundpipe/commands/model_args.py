"""The model and run options that ``roundpipe simulate`` and ``roundpipe plan`` share.

:func:`add_model_args` declares them on a parser; :func:`model_settings` hands what it parsed to
every simulation and search.
"""

from __future__ import annotations

import argparse


def add_model_args(ap: argparse.ArgumentParser, *, seq_required: bool = False) -> None:
    ap.add_argument("--model", required=True, help="preset name (e.g. qwen3-8b) or path to a config.json")
    ap.add_argument(
        "--hardware", default="8xrtx4090", help="server spec such as 8xrtx4090 (default) or 2xcpu"
    )
    ap.add_argument("--num-devices", type=int, default=None, help="use only this many of the server's GPUs")
    ap.add_argument(
        "--seq-len", type=int, default=None if not seq_required else 4096, help="tokens per sequence"
    )
    ap.add_argument("--global-batch", type=int, default=64, help="sequences per optimizer step (default 64)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tuning)")
    ap.add_argument(
        "--label-fraction",
        type=float,
        default=1.0,
        help="share of tokens with a label (not -100), e.g. 0.4 for SFT with masked prompts; the LM "
        "head computes only those (default 1)",
    )
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument(
        "--fp16-accumulation",
        action="store_true",
        help="fp16 matmuls accumulate in fp16 (needs --dtype fp16): the GPU's fp16-accumulate rate "
        "(2x on GeForce cards), as RunConfig(fp16_accumulation=True) runs",
    )
    ap.add_argument(
        "--optimizer", default="sync", choices=["sync", "async"], help="exact (sync) or one-step-stale"
    )


def model_settings(args: argparse.Namespace) -> dict:
    """The settings :func:`add_model_args` parsed that every simulation and search takes."""
    return dict(
        global_batch=args.global_batch,
        lora_rank=args.lora_rank,
        dtype=args.dtype,
        num_devices=args.num_devices,
        label_fraction=args.label_fraction,
        fp16_accumulation=args.fp16_accumulation,
    )
