"""What ``Trainer.fit`` builds before its first step, from the recipe and the ranks.

The synthetic task's data files (``write_synthetic``), the model (``model_for_run``: from a
directory or a config, LoRA applied), and the ``RunConfig`` the Pipeline runs under
(``run_config_for``: ``run:``'s settings, the devices each rank takes, the host RAM check on every
node, and the simulator's forecast in the log); ``check_joined`` confirms the pipeline joined the
ranks the environment names; after the first step, ``record_plan`` writes the plan the run chose
into ``plan.json``. ``log`` is rank 0's log line (``Trainer.log``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from roundpipe.config import RunConfig, recipe_settings
from roundpipe.errors import DataError, DataParallelError
from roundpipe.schedule import PROVISIONAL_POLICY
from roundpipe.train.config import RunSection, TrainConfig
from roundpipe.train.ranks import Ranks


def write_synthetic(cfg: TrainConfig, log) -> None:
    """With ``data.synthetic``, write the built-in task's training and held-out files."""
    d = cfg.data
    if d.synthetic is None:
        return
    from roundpipe.train.synthetic import write_task

    if d.eval is None:
        raise DataError("data.synthetic writes a held-out file too: set data.eval to its path")
    if write_task(d.synthetic, d.train, d.eval, d.synthetic_samples, cfg.run.seed):
        log(f"data: wrote the synthetic task {d.synthetic!r} to {d.train} and {d.eval}")


def model_for_run(cfg: TrainConfig, tokenizer, log):
    """``(model, weights)`` as ``loading.build_model`` gives them, in training mode; a ``config:``
    model takes its vocabulary size and special token ids from the tokenizer unless it sets them."""
    from roundpipe.train.loading import build_model

    model_cfg = cfg.model
    if model_cfg.config is not None:
        numbers = dict(model_cfg.config)
        numbers.setdefault("vocab_size", len(tokenizer))
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, key, None) is not None:
                numbers.setdefault(key, getattr(tokenizer, key))
        model_cfg = replace(model_cfg, config=numbers)
    loaded = build_model(model_cfg, cfg.lora, cfg.run.seed)
    model = loaded.model
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    what = "LoRA" if cfg.lora.enabled else "full fine-tuning"
    source = model_cfg.path or "a config (random init)"
    log(f"model: {total / 1e6:,.1f}M parameters from {source}; {what}, {trainable / 1e6:,.2f}M trainable")
    return model, loaded.weights


def run_config_for(cfg: TrainConfig, model, ranks: Ranks, log) -> RunConfig:
    """The Pipeline's ``RunConfig``: ``run:``'s settings and ``run.options``, the devices this rank
    takes. Before it, every rank checks its node's host RAM (``run.host_ram_check``) and rank 0
    logs the simulator's forecast for one rank's share of each batch."""
    from roundpipe.train.forecast import check_host_ram, host_ram_needed

    run = cfg.run
    shards = ranks.world_size if run.optimizer_sharding == "nodes" else 1
    rows = -(-run.batch_size // ranks.world_size)  # this rank's share of each global batch
    need = host_ram_needed(
        model, run.dtype, run.optimizer_mode, rows * cfg.data.max_length, optimizer_shards=shards
    )
    if run.host_ram_check:  # every rank checks its node, counting the ranks that share it
        line = ranks.everywhere(
            check_host_ram,
            need,
            lora=cfg.lora.enabled,
            dtype=run.dtype,
            ranks_here=ranks.local_world_size,
        )
        log(line)
    settings = {f.name: getattr(run, f.name) for f in recipe_settings()}  # run.X is RunConfig's X
    config = RunConfig(**{**settings, "devices": rank_devices(run, ranks)}, **run.options)
    if ranks.is_main:
        _log_forecast(cfg, config, model, rows, shards, ranks.world_size, log)
    return config


def rank_devices(run: RunSection, ranks: Ranks) -> str:
    """``run.devices``, with ``auto`` resolved: every GPU (else ``cpu:2``); under torchrun with
    several ranks on a server, each rank takes its own equal share of the server's GPUs, in
    ``LOCAL_RANK`` order, as DDP gives each local rank its own device."""
    if run.devices != "auto":
        return run.devices
    if not torch.cuda.is_available():
        return "cpu:2"
    if ranks.local_world_size <= 1:
        return run.devices
    from roundpipe.errors import DeviceSpecError

    count = torch.cuda.device_count()
    share = count // ranks.local_world_size
    if share < 1:
        raise DeviceSpecError(
            f"{ranks.local_world_size} ranks on this server share {count} GPUs: each needs at least one. "
            "Start fewer ranks per server (torchrun --nproc-per-node) or set run.devices per rank"
        )
    first = ranks.local_rank * share
    return "cuda:" + ",".join(str(i) for i in range(first, first + share))


def _log_forecast(
    cfg: TrainConfig, config: RunConfig, model, rows: int, optimizer_shards: int, world: int, log
) -> None:
    """The simulator's forecast of one rank's pipeline (as ``config`` runs it) on its ``rows`` of
    each batch."""
    from roundpipe.backend import parse_device_spec
    from roundpipe.train.forecast import predict

    # policy / num_microbatches "auto" are the runtime's: it profiles the first batch and
    # chooses from the measured times (logged after the first step). The forecast before it
    # shows what the provisional policy, roundpipe, would do.
    forecast = predict(
        model,
        parse_device_spec(config.devices),
        policy=PROVISIONAL_POLICY if config.policy == "auto" else config.policy,
        seq_len=cfg.data.max_length,
        batch=rows,
        microbatches=config.num_microbatches,
        lora_rank=cfg.lora.rank if cfg.lora.enabled else None,
        dtype=config.dtype,
        optimizer_mode=config.optimizer_mode,
        fp16_accumulation=config.fp16_accumulation,
        optimizer_shards=optimizer_shards,
        head_shards=config.head_shards,
    )
    log(
        forecast.text
        + (
            f"; each of the {world} ranks on its {rows} rows of a batch, the gradient reduction "
            "between them not counted"
            if world > 1
            else ""
        )
        + ("; policy auto: chosen after profiling the first batch" if config.policy == "auto" else "")
    )


def check_joined(pipe, ranks: Ranks) -> None:
    """The pipeline joined the same ranks the environment names (or none, alone)."""
    dp = getattr(pipe, "dp", None)
    if not ranks.distributed:
        return
    if dp is None or (dp.rank, dp.world_size) != (ranks.rank, ranks.world_size):
        got = "did not join them" if dp is None else f"joined as rank {dp.rank} of {dp.world_size}"
        raise DataParallelError(
            f"this process is rank {ranks.rank} of {ranks.world_size} but the pipeline {got}",
            rank=ranks.rank,
        )


PLAN_FILE = "plan.json"  # in the run directory: the plan the first step ran, and what timing chose


def record_plan(run_dir, pipe, *, resumed: bool, log) -> None:
    """After the first step a ``fit`` runs (rank 0): the plan into ``plan.json``, and when the
    microbatch count was chosen from this machine's timing (``num_microbatches: auto``) a line that
    says another run may choose otherwise, and how to pin it.

    The count is the one automatic choice that changes the numbers (how each batch is split, so the
    order the gradients add up in); the policy and partitions that ``auto`` chooses change only the
    speed (the planner keeps to plans that run every backward stage on one device). A resumed run
    makes the same choice from the profile its checkpoint carries; its ``plan.json`` stays the first
    run's, and a different count is logged."""
    import json

    from roundpipe.train.paths import run_file

    config, plan = pipe.config, pipe.plan
    timed = (
        []
        if config.schedule is not None
        else [part for part in ("policy", "partition", "num_microbatches") if getattr(config, part) == "auto"]
    )
    path = run_file(run_dir, PLAN_FILE)
    if resumed and path.is_file():
        with contextlib.suppress(ValueError, OSError):
            first = json.loads(path.read_text(encoding="utf-8")).get("num_microbatches")
            if first != plan.num_microbatches:
                log(
                    f"plan: this run splits each batch into {plan.num_microbatches} microbatches, "
                    f"the first run into {first} ({PLAN_FILE}): its losses differ from an uninterrupted run's"
                )
        return
    record = {
        **json.loads(plan.to_json()),
        "chosen_from_timing": timed,
        "repeat_with": (
            {"run.num_microbatches": plan.num_microbatches} if "num_microbatches" in timed else {}
        ),
    }
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if "num_microbatches" in timed:
        log(
            f"plan: num_microbatches auto chose {plan.num_microbatches} from this machine's timing; "
            "another run may differ (another count, so other losses from step 1 on); to repeat "
            f"this run bit for bit give run.num_microbatches: {plan.num_microbatches} "
            f"(recorded in {run_dir}/{PLAN_FILE})"
        )
