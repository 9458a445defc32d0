"""The model and run options that ``roundpipe simulate`` and ``roundpipe plan`` share.

:func:`add_model_args` declares them on a parser; :func:`target` reads the model and the server
they plan for (its host RAM and cores from ``--host-ram`` / ``--host-cores``, this machine's when
it is the target, else the preset's), refusing an unknown model or hardware once, up front;
:func:`model_settings` hands the rest to every simulation and search.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.partition.quant_layout import QUANTIZATIONS, STATE_DTYPES

HOST_HELP = (
    "Host figures: --host-ram and --host-cores default to this machine's when it is the target (the "
    "virtual cpu devices of a `cpu` preset, or the value `this`), else to the preset's (a GPU "
    "server preset assumes a large host, e.g. 512 GiB and 64 cores for rtx3090: give your own)."
)


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
    ap.add_argument(
        "--mlp-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="run each block's MLP (or MoE experts) in token chunks of at most N tokens, each "
        "recomputed in the backward: long sequences need far less device memory, for one more MLP "
        "forward (RunConfig.mlp_chunk_tokens; default: in one piece)",
    )
    ap.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="keep the blocks' frozen linear weights compressed on the host, over PCIe and on the GPUs "
        "(QLoRA; RunConfig.quantization; needs --lora-rank): nf4 about 0.52 bytes a weight, int8 and "
        "fp8 about 1",
    )
    ap.add_argument(
        "--optimizer-state",
        choices=STATE_DTYPES,
        default="fp32",
        help="AdamW's moments on the host: fp32 (8 bytes a trained parameter), bf16 (4) or int8 "
        "(8-bit blocks, 2.03); the fp32 master comes on top (optim.state_dtype in a recipe)",
    )
    ap.add_argument(
        "--no-lora-experts",
        dest="lora_experts",
        action="store_false",
        help="LoRA on the attention (and dense MLPs, routers) but not on each expert of a MoE: what "
        "peft's target_modules give a model whose experts are fused tensors (default: every linear)",
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
    ap.add_argument(
        "--host-ram",
        default=None,
        metavar="GIB|this",
        help="host RAM of the server in GiB, or `this` for this machine's (default: this machine's for a "
        "cpu preset, else the preset's); all model state lives there, so it decides what fits",
    )
    ap.add_argument(
        "--rope-scaling",
        default=None,
        metavar="TYPE:FACTOR",
        help="plan as if the model's config had this rope scaling (e.g. yarn:2) over its "
        "max_position_embeddings: sequences up to FACTOR times as long; train with the same "
        "rope_scaling in its config.json",
    )
    ap.add_argument(
        "--host-cores",
        default=None,
        metavar="N|this",
        help="CPU cores of the server, or `this` (default as --host-ram); shown in the output, not yet "
        "used by the prediction: the simulator times the CPU optimizer by host memory bandwidth",
    )


def _this_machine() -> tuple[int, int]:
    """This machine's RAM in bytes and the cores this process may run on."""
    import psutil  # type: ignore[import-untyped]

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(psutil.virtual_memory().total), cores


def target(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(model, server)`` for the simulator: the model name, checked to be one the presets or a
    config.json describe (its config with ``--rope-scaling`` applied when given), and the ``Server`` of ``--hardware`` with the host's RAM and cores (see
    ``HOST_HELP``). ConfigError, once, for an unknown model or hardware or a bad host figure."""
    from roundpipe.presets import GIB, load_hardware, load_model_config

    config = load_model_config(args.model)  # an unknown model is one error here, not one per candidate
    server = load_hardware(args.hardware)
    here = server.gpu.name == "cpu"  # virtual cpu devices run on this machine
    overrides: dict[str, Any] = {}
    for flag, value, key in (
        ("--host-ram", args.host_ram, "host_memory_bytes"),
        ("--host-cores", args.host_cores, "cpu_cores"),
    ):
        if value is None and not here:
            continue
        if value is None or value == "this":
            ram, cores = _this_machine()
            overrides[key] = ram if key == "host_memory_bytes" else cores
            continue
        try:
            number = float(value) if key == "host_memory_bytes" else int(value)
        except ValueError:
            number = -1
        if not number > 0:
            what = "a number of GiB" if key == "host_memory_bytes" else "a whole number of cores"
            raise ConfigError(f"{flag} takes {what} > 0 or `this`, got {value!r}")
        overrides[key] = int(number * GIB) if key == "host_memory_bytes" else number
    server = load_hardware(args.hardware, **overrides)
    if getattr(args, "rope_scaling", None):
        from roundpipe.partition.positions import with_rope_scaling

        name = config.get("_name_or_path") or args.model
        return {**with_rope_scaling(config, args.rope_scaling), "_name_or_path": name}, server
    return args.model, server


def host_fields(server: Any) -> dict[str, Any]:
    """The host figures a plan was made for, for ``--json``."""
    return {"host_memory_bytes": server.host_memory_bytes, "cpu_cores": server.cpu_cores}


def host_text(server: Any) -> str:
    ram = (
        "RAM not modelled"
        if server.host_memory_bytes is None
        else f"{server.host_memory_bytes / 2**30:.0f} GiB RAM"
    )
    return f"host {ram}, {server.cpu_cores} cores"


def model_settings(args: argparse.Namespace) -> dict:
    """The settings :func:`add_model_args` parsed that every simulation and search takes."""
    return dict(
        global_batch=args.global_batch,
        lora_rank=args.lora_rank,
        dtype=args.dtype,
        num_devices=args.num_devices,
        label_fraction=args.label_fraction,
        fp16_accumulation=args.fp16_accumulation,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        quantization=args.quantization,
        lora_experts=args.lora_experts,
        optimizer_state=args.optimizer_state,
    )
