"""The training loop: ``Trainer(TrainConfig(...)).fit()``, which ``roundpipe train`` runs.

One ``fit``: read the data and the tokenizer, build or load the model (a HF directory is read
straight into the parameter store), check the host RAM and print the simulator's forecast, wrap
the model in a ``Pipeline``, then for every optimizer step: the learning rate of the schedule,
``grad_accum`` forward/backward calls whose gradients add up to that of the token-mean loss of the
whole step, ``step()``; metrics, evaluation and checkpoints at their intervals. SIGINT / SIGTERM
finish the step under way, write a checkpoint and stop; ``resume`` continues from one exactly.

What makes a resumed run equal to an uninterrupted one, bit for bit on the cpu backend: the
checkpoint holds the fp32 masters (all of them, or the adapters), the optimizer moments and step
counts, the loss scaler, the pipeline's step counter (dropout seeds, async buffer parity), the data
position and the host RNG states; the learning rate is a pure function of the step. None of them
depends on the device count, so a run may resume on another one.

Under ``torchrun`` (``WORLD_SIZE`` > 1, ``run.data_parallel: auto``) every rank runs this same
loop on the same global batches; the pipeline gives each rank its rows and reduces the gradients
(``roundpipe.distributed``). Rank 0 alone writes the run directory (logs, progress, metrics, plots,
timelines, samples, exports, the checkpoint's state and manifest); every rank writes its optimizer
shard into the checkpoint (``checkpoint_shards``). The ranks agree on what rank 0 decides (the
checkpoint to resume from), on a refusal anywhere (host RAM on a node), and on stopping after a
signal (``roundpipe.train.ranks``). A failed step ends every rank at once, without the on-error
checkpoint: the ranks may be in the middle of different collectives, so ``--resume auto`` takes the
last periodic one, and ``torchrun --max-restarts`` restarts the ranks from it.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from roundpipe.config import RunConfig, recipe_settings
from roundpipe.errors import CheckpointError, DataError, DataParallelError
from roundpipe.schedule import PROVISIONAL_POLICY, TaskKind
from roundpipe.train.config import TrainConfig
from roundpipe.train.lr_schedule import lr_at
from roundpipe.train.ranks import Ranks

LOG_FILE = "train.log"  # in the run directory: every line the run printed, and a failure's traceback


@dataclass
class TrainResult:
    """What ``fit`` did. ``interrupted``: stopped by a signal (a checkpoint was written)."""

    run_dir: Path
    steps: int
    train_losses: list[float] = field(default_factory=list)  # of the steps this call ran
    eval: dict[str, float] = field(default_factory=dict)  # the last evaluation
    checkpoint: Path | None = None
    exports: dict[str, Path] = field(default_factory=dict)
    interrupted: bool = False
    elapsed_s: float = 0.0


class _StopFlag:
    """SIGINT / SIGTERM set the flag (the step under way finishes); a second signal interrupts."""

    def __init__(self, enabled: bool, announce: bool = True):
        self.signal: int | None = None
        self._announce = announce  # rank 0 only: the other ranks of a data-parallel run stay silent
        self._previous = {}
        if enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        if not self._announce:
            return
        print(
            f"\nroundpipe: {signal.Signals(signum).name}: finishing this step, then checkpoint and stop",
            flush=True,
        )

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Runs one ``TrainConfig``. ``resume``: ``"auto"`` (the newest checkpoint of the run, if any)
    or a checkpoint directory. ``log``: where lines of text go (default ``print``; on rank 0 only
    under torchrun)."""

    def __init__(self, config: TrainConfig, *, resume: str | None = None, log=print):
        config.check()
        self.config = config
        self.resume = resume
        self._print = log
        self.run_dir = Path(config.output_dir)
        self.ranks = Ranks()  # read from the environment when the run starts

    def log(self, line: str) -> None:
        """Print ``line`` and append it to the run's log file (``train.log``, once the run dir exists).
        Rank 0's job: other ranks stay silent."""
        if not self.ranks.is_main:
            return
        self._print(line)
        if self.run_dir.is_dir():
            self._log_file(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")

    # ------------------------------------------------------------------ the run
    def fit(self) -> TrainResult:
        from roundpipe.runtime import Pipeline
        from roundpipe.train.batches import Batches
        from roundpipe.train.checkpoint import CheckpointManager
        from roundpipe.train.data import load_data
        from roundpipe.train.paths import check_run_paths
        from roundpipe.train.recipe import dump_recipe
        from roundpipe.train.tokenizer import load_tokenizer
        from roundpipe.train.watch import MetricsLog, Progress

        cfg = self.config
        t_start = time.perf_counter()
        self.ranks = ranks = Ranks.from_environment(cfg.run.data_parallel, cfg.run.dp_timeout_s)
        ranks.join()  # the default process group (gloo), which the pipeline joins, and the trainer's own
        main = ranks.is_main
        manager = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, repair=main
        )

        def open_run_dir() -> Path | None:  # rank 0's: the others wait for it, and fail with it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            check_run_paths(cfg)  # again, now that the run starts: no symlink in run_dir leads outside
            (self.run_dir / "config.yaml").write_text(dump_recipe(cfg), encoding="utf-8")
            self._write_synthetic()
            return manager.resolve(self.resume) if self.resume else None

        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        resume_from = ranks.on_main(open_run_dir)
        if ranks.distributed:
            self.log(
                f"data parallel: {ranks.world_size} ranks ({ranks.local_world_size} on this node), "
                f"optimizer sharding {cfg.run.optimizer_sharding}"
                + (f"; torchrun restart {ranks.restart}" if ranks.restart else "")
            )
        tokenizer = load_tokenizer(cfg.model)
        splits = load_data(cfg.data, tokenizer, cfg.run.seed)
        self.log(f"data: {len(splits.train)} training and {len(splits.eval)} held-out samples")
        self.log(splits.report.summary())
        pad_id = tokenizer.pad_token_id
        batches = Batches(
            splits.train,
            cfg.run.batch_size,
            seed=cfg.run.seed,
            shuffle=cfg.data.shuffle,
            group_by_length=cfg.data.group_by_length,
            packing=cfg.data.packing,
            max_length=cfg.data.max_length,
            pad_id=pad_id,
        )
        if batches.steps_per_epoch < 1:
            raise DataError(
                f"{len(splits.train)} training samples make no batch of run.batch_size={cfg.run.batch_size}; "
                "lower run.batch_size or add data"
            )
        total_steps = cfg.run.max_steps or max(
            1, math.floor(cfg.run.epochs * batches.steps_per_epoch / cfg.run.grad_accum)
        )

        model, weights = self._model(tokenizer)
        pipe_config = self._run_config(model, tokenizer)
        with Pipeline(model, pipe_config, weights=weights) as pipe:
            self._check_joined(pipe)
            self.log(
                f"plan: {len(pipe.adapter.layers)} layers over [{', '.join(d.name for d in pipe.backend.devices)}]"
            )
            pipe.configure_optimizer(
                lr=cfg.optim.lr,
                weight_decay=cfg.optim.weight_decay,
                betas=tuple(cfg.optim.betas),
                eps=cfg.optim.eps,
                max_grad_norm=cfg.optim.max_grad_norm,
            )
            start = 0
            if resume_from is not None:
                start = self._restore(manager, resume_from, pipe, batches)
                self.log(f"resumed from {resume_from} at step {start}")
            metrics = MetricsLog(
                self.run_dir, cfg.logging, resume_step=start if resume_from else None, write=main
            )
            result = TrainResult(self.run_dir, start)
            stop = _StopFlag(cfg.checkpoint.on_signal, announce=main)
            progress = Progress(total_steps, start, cfg.logging.progress, cfg.logging.every, silent=not main)
            try:
                if start == 0 and cfg.eval.every is not None and splits.eval:
                    result.eval = self._evaluate(pipe, model, splits.eval, tokenizer, 0, metrics)
                    progress.write(_eval_line(0, result.eval))
                for step in range(start, total_steps):
                    before = self._position(batches)  # where this step starts, should it fail
                    try:
                        row = self._train_step(pipe, batches, step, total_steps)
                    except Exception as err:
                        self._failed(err, manager, step, pipe, before, result)
                        raise
                    if step == start:  # what runs from now on, and why (an "auto" choice is made by now)
                        self.log(_plan_line(pipe.plan))
                    metrics.log(row)
                    result.train_losses.append(row["loss"])
                    result.steps = step + 1
                    progress.update(step + 1, row["loss"], row["tokens_per_s"], row["idle"], row["lr"])
                    last = step + 1 == total_steps
                    # A signal may reach the ranks on either side of a step: every rank stops after
                    # the step at which any rank saw it, so all write the same checkpoint.
                    stopping = ranks.any(stop.signal is not None)
                    if main and cfg.logging.plots and (last or stopping):
                        self._save_timeline(pipe)
                    if splits.eval and (last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)):
                        result.eval = self._evaluate(pipe, model, splits.eval, tokenizer, step + 1, metrics)
                        progress.write(_eval_line(step + 1, result.eval))
                    due = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
                    if due or stopping or (last and cfg.checkpoint.at_end):
                        result.checkpoint = self._save(manager, step + 1, pipe, batches)
                    if stopping:
                        result.interrupted = True
                        self.log(f"stopped at step {step + 1} of {total_steps}; resume with --resume auto")
                        break
            except Exception as err:  # outside a step too (a checkpoint write, an evaluation)
                if not getattr(err, "_roundpipe_logged", False):
                    self._log_failure(err, f"the run failed after step {result.steps}")
                raise
            finally:
                progress.close()
                stop.restore()
                metrics.close()
            if main and cfg.logging.plots:
                from roundpipe.train.watch import save_loss_curve

                save_loss_curve(metrics, self.run_dir / "loss.png", f"{cfg.run.name}: loss")
            if not result.interrupted:
                result.exports = self._export(pipe, model, tokenizer)
                if main and cfg.eval.show_samples and splits.eval:
                    self._show_samples(model, splits.eval[: cfg.eval.show_samples], tokenizer)
        result.elapsed_s = time.perf_counter() - t_start
        return result

    # ------------------------------------------------------------------ pieces
    def _write_synthetic(self) -> None:
        d = self.config.data
        if d.synthetic is None:
            return
        from roundpipe.train.synthetic import write_task

        if d.eval is None:
            raise DataError("data.synthetic writes a held-out file too: set data.eval to its path")
        if write_task(d.synthetic, d.train, d.eval, d.synthetic_samples, self.config.run.seed):
            self.log(f"data: wrote the synthetic task {d.synthetic!r} to {d.train} and {d.eval}")

    def _model(self, tokenizer):
        from roundpipe.train.loading import build_model

        cfg = self.config
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
        self.log(
            f"model: {total / 1e6:,.1f}M parameters from {source}; {what}, {trainable / 1e6:,.2f}M trainable"
        )
        return model, loaded.weights

    def _run_config(self, model, tokenizer):
        from roundpipe.train.forecast import check_host_ram, host_ram_needed

        cfg = self.config
        run = cfg.run
        ranks = self.ranks
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
            self.log(line)
        devices = self._devices()
        if ranks.is_main:
            self._log_forecast(model, devices, rows, shards)
        settings = {f.name: getattr(run, f.name) for f in recipe_settings()}  # run.X is RunConfig's X
        return RunConfig(**{**settings, "devices": devices}, **run.options)

    def _devices(self) -> str:
        """``run.devices``, with ``auto`` resolved: every GPU (else ``cpu:2``); under torchrun with
        several ranks on a server, each rank takes its own equal share of the server's GPUs, in
        ``LOCAL_RANK`` order, as DDP gives each local rank its own device."""
        run, ranks = self.config.run, self.ranks
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

    def _log_forecast(self, model, devices: str, rows: int, optimizer_shards: int) -> None:
        """The simulator's forecast of one rank's pipeline on its ``rows`` of each batch."""
        from roundpipe.backend import parse_device_spec
        from roundpipe.train.forecast import predict

        cfg = self.config
        run = cfg.run
        # policy / num_microbatches "auto" are the runtime's: it profiles the first batch and
        # chooses from the measured times (logged after the first step). The forecast before it
        # shows what the provisional policy, roundpipe, would do.
        forecast = predict(
            model,
            parse_device_spec(devices),
            policy=PROVISIONAL_POLICY if run.policy == "auto" else run.policy,
            seq_len=cfg.data.max_length,
            batch=rows,
            microbatches=run.num_microbatches,
            lora_rank=cfg.lora.rank if cfg.lora.enabled else None,
            dtype=run.dtype,
            optimizer_mode=run.optimizer_mode,
            tune_policy=False,
            fp16_accumulation=bool(run.options.get("fp16_accumulation", False)),
            optimizer_shards=optimizer_shards,
        )
        world = self.ranks.world_size
        self.log(
            forecast.text
            + (
                f"; each of the {world} ranks on its {rows} rows of a batch, the gradient reduction "
                "between them not counted"
                if world > 1
                else ""
            )
            + ("; policy auto: chosen after profiling the first batch" if run.policy == "auto" else "")
        )

    def _check_joined(self, pipe) -> None:
        """The pipeline joined the same ranks the environment names (or none, alone)."""
        dp = getattr(pipe, "dp", None)
        ranks = self.ranks
        if not ranks.distributed:
            return
        if dp is None or (dp.rank, dp.world_size) != (ranks.rank, ranks.world_size):
            got = "did not join them" if dp is None else f"joined as rank {dp.rank} of {dp.world_size}"
            raise DataParallelError(
                f"this process is rank {ranks.rank} of {ranks.world_size} but the pipeline {got}",
                rank=ranks.rank,
            )

    def _train_step(self, pipe, batches, step: int, total_steps: int) -> dict:
        from roundpipe.testing import faults

        cfg = self.config
        lr = lr_at(step, total_steps, cfg.optim.lr, cfg.schedule)
        pipe.set_lr(lr)
        faults.point("data", step=step + 1)
        micro = [batches.next() for _ in range(cfg.run.grad_accum)]
        label_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        t0 = time.perf_counter()
        loss_sum, tokens, idle = 0.0, 0, []
        for i, b in enumerate(micro):
            out = pipe.forward_backward(
                b["input_ids"],
                labels=b["labels"],
                attention_mask=b["attention_mask"],
                accumulate=i < len(micro) - 1,
                loss_tokens=label_tokens,
            )
            loss_sum += out.loss * out.num_tokens
            tokens += int(b["attention_mask"].sum())
            idle += [d["bubble_fraction"] for d in pipe.stats()["devices"]]
        pipe.step()
        seconds = time.perf_counter() - t0
        row = {
            "kind": "train",
            "step": step + 1,
            "loss": loss_sum / label_tokens,
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "idle": sum(idle) / len(idle),
            "epoch": batches.epoch,
            "time_s": seconds,
            "skipped_steps": pipe.skipped_steps,  # updates dropped on non-finite values so far
        }
        if pipe.last_grad_norm is not None:
            row["grad_norm"] = pipe.last_grad_norm
        if pipe.last_step_skipped:  # a non-finite value (nan_policy skip, or an fp16 overflow)
            row["skipped"] = True
            found = pipe.last_nonfinite
            self.log(
                f"step {step + 1}: update skipped"
                + (f", {found.describe()} was not finite" if found is not None else ", non-finite gradients")
                + f" ({pipe.skipped_steps} skipped so far)"
            )
        return row

    def _eval_chunks(self, samples, pad_id: int) -> list[dict]:
        """Held-out samples in order, as batches no smaller than the microbatch count."""
        from roundpipe.train.batches import eval_batches

        cfg = self.config
        size = cfg.eval.batch_size or cfg.run.batch_size
        count = max(1, math.ceil(len(samples) / size))
        bounds = [round(i * len(samples) / count) for i in range(count + 1)]
        return [
            batch for a, b in zip(bounds, bounds[1:]) for batch in eval_batches(samples[a:b], b - a, pad_id)
        ]

    def _evaluate(self, pipe, model, samples, tokenizer, step: int, metrics) -> dict:
        samples = samples[: self.config.eval.max_samples] if self.config.eval.max_samples else samples
        batches = self._eval_chunks(samples, tokenizer.pad_token_id)
        loss_sum, tokens = 0.0, 0
        for b in batches:
            out = pipe.evaluate(b["input_ids"], labels=b["labels"], attention_mask=b["attention_mask"])
            loss_sum += out.loss * out.num_tokens
            tokens += out.num_tokens
        row = {"kind": "eval", "step": step, "loss": loss_sum / tokens}
        if self.config.eval.exact_match:
            pipe.export_to(model)  # on every rank (as every pipeline call), the answers on rank 0 only
            if self.ranks.is_main:
                row["exact_match"] = exact_match(model, batches, samples)
        metrics.log(row)
        return {k: v for k, v in row.items() if k not in ("kind", "step")}

    def _save_timeline(self, pipe) -> None:
        from roundpipe.train.watch import save_timeline

        try:
            save_timeline(pipe, self.run_dir, f"{self.config.run.name}: one training step")
        except Exception as e:  # a picture must not fail the run
            self.log(f"timeline not drawn: {e}")

    @staticmethod
    def _position(batches) -> dict:
        """The data position and host RNG states: what a checkpoint needs besides the pipeline."""
        return {
            "data": batches.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def _failed(self, err: Exception, manager, step: int, pipe, before: dict, result) -> None:
        """Step ``step + 1`` raised ``err``: log it in full, and checkpoint the last completed step
        (``step``) when the failure left it intact (``Pipeline.abandon_step``) and none holds it yet."""
        self._log_failure(err, f"step {step + 1} failed")
        if not self.config.checkpoint.on_error:
            return
        if self.ranks.distributed:  # the ranks may be in different collectives: none can save now
            last = manager.latest_step()
            self.log(
                "no checkpoint written: under data parallelism a failed step leaves the ranks in "
                "different places; "
                + (
                    f"--resume auto continues from the last periodic checkpoint (step {last})"
                    if last is not None
                    else "no periodic checkpoint exists yet"
                )
            )
            return
        if not pipe.abandon_step():
            self.log(
                f"no checkpoint written: step {step + 1} failed half-way through its optimizer update "
                "(some layers hold the new weights, some the old); resume from the last checkpoint"
            )
            return
        if manager.latest_step() == step:
            self.log(f"checkpoint of step {step} already written; resume with --resume auto")
            return
        if step == 0:  # nothing trained yet (a refused plan, a first batch that failed): nothing to keep
            self.log("no checkpoint written: the first step failed, there is nothing to resume from")
            return
        try:
            result.checkpoint = self._save(manager, step, pipe, None, position=before)
            self.log(f"wrote a checkpoint of step {step}, the last completed one; resume with --resume auto")
        except Exception as save_err:  # the error that stopped the run stays the one raised
            self.log(f"could not write a checkpoint after the failure: {type(save_err).__name__}: {save_err}")

    def _log_failure(self, err: Exception, what: str) -> None:
        """One line of what failed, and the full traceback in the log file (once per error); on
        ranks other than 0, which write no log, the traceback goes to stderr."""
        import sys
        import traceback

        self.log(f"{what}: {type(err).__name__}: {err}")
        text = "".join(traceback.format_exception(err))
        if self.ranks.is_main:
            self._log_file(text)
        else:
            print(f"roundpipe train (rank {self.ranks.rank}): {what}\n{text}", file=sys.stderr, flush=True)
        err._roundpipe_logged = True

    def _log_file(self, text: str) -> None:
        with contextlib.suppress(OSError), open(self.run_dir / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def _save(self, manager, step: int, pipe, batches, position: dict | None = None) -> Path:
        """Write checkpoint ``step`` (every rank calls it). With optimizer sharding each rank's
        optimizer state goes into its own file; otherwise rank 0's state is the whole of it."""
        from roundpipe.train.checkpoint_shards import Shard
        from roundpipe.train.recipe import dump_recipe

        position = position or self._position(batches)
        pipeline = pipe.state_dict()
        shard = None
        if pipeline.pop("optimizer_shard", None) is not None:  # which rank wrote it: state.json says
            optimizer = dict(pipeline["optimizer"])
            shard = Shard(("pipeline", "optimizer", "state"), optimizer.pop("state"))
            pipeline["optimizer"] = optimizer
        state = {"step": step, "pipeline": pipeline, **position}
        ranks = self.ranks
        path = manager.save(
            step,
            state if ranks.is_main else None,
            extra_files={"config.yaml": dump_recipe(self.config).encode()},
            shard=shard,
            group=ranks if ranks.distributed else None,
        )
        self.log(f"checkpoint: {path}")
        return path

    def _restore(self, manager, path: Path, pipe, batches) -> int:
        """Load checkpoint ``path`` on every rank: rank 0 verifies every file against the manifest
        (once: the files are the same for all), then each rank reads it; a sharded optimizer state
        comes back as the union of every rank's part, of which each pipeline takes its own."""
        self.ranks.on_main(lambda: manager.verify(path) and None)
        step, state, _ = manager.load(path, hash_files=False)
        if state.get("step") != step:
            raise CheckpointError(f"{path}: the state says step {state.get('step')} but the manifest {step}")
        pipe.load_state_dict(state["pipeline"])
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_tuples(state["rng"]["python"]))
        return step

    def _export(self, pipe, model, tokenizer) -> dict[str, Path]:
        from roundpipe.train.export import export_adapter, export_merged

        cfg = self.config
        kind = cfg.checkpoint.export
        if kind == "none":
            return {}
        if kind == "auto":
            kind = "adapter" if cfg.lora.enabled else "merged"
        if kind in ("adapter", "both") and not cfg.lora.enabled:
            raise DataError("checkpoint.export asks for an adapter but lora.enabled is false; export: merged")
        pipe.export_to(model)  # on every rank, as every pipeline call; rank 0 writes the files
        if not self.ranks.is_main:
            return {}
        out = {}
        if kind in ("adapter", "both"):
            out["adapter"] = self.run_dir / "export" / "adapter"
            export_adapter(model, out["adapter"])
            tokenizer.save_pretrained(str(out["adapter"]))
        if kind in ("merged", "both"):
            out["merged"] = self.run_dir / "export" / "merged"
            export_merged(model, out["merged"], tokenizer=tokenizer)
        for name, path in out.items():
            self.log(f"export ({name}): {path}")
        return out

    def _show_samples(self, model, samples, tokenizer) -> None:
        was_training = model.training
        model.eval()
        self.log("held-out samples (greedy):")
        try:
            with torch.no_grad():
                for s in samples:
                    prompt = torch.tensor([s.input_ids[: s.prompt_len]])
                    out = model.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),
                        max_new_tokens=self.config.eval.max_new_tokens,
                        do_sample=False,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id,
                    )[0, prompt.shape[1] :].tolist()
                    got = tokenizer.decode(out, skip_special_tokens=True)
                    want = tokenizer.decode(list(s.input_ids[s.prompt_len :]), skip_special_tokens=True)
                    mark = "ok " if got.strip() == want.strip() else "MISS"
                    shown = tokenizer.decode(list(s.input_ids[: s.prompt_len]), skip_special_tokens=True)
                    self.log(f"  {mark} {shown!r} -> {got!r} (answer {want!r})")
        finally:
            model.train(was_training)


def exact_match(model, batches, samples) -> float:
    """Share of ``samples`` whose whole answer (``input_ids[prompt_len:]``, end-of-sequence
    included) is the model's greedy choice at every position, fed the reference prefix. That is
    exactly the share a greedy decoder answers correctly: each answer token is then predicted from
    the correct prefix. ``batches`` hold ``samples`` in order (``eval_batches``)."""
    was_training = model.training
    model.eval()
    hits, index = 0, 0
    try:
        with torch.no_grad():
            for b in batches:
                logits = model(
                    input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False
                ).logits
                pred = logits[:, :-1].argmax(-1)
                for row in range(b["input_ids"].shape[0]):
                    s = samples[index]
                    index += 1
                    start, end = s.prompt_len, len(s.input_ids)
                    if start == 0:
                        continue  # no answer to match (text format)
                    want = b["input_ids"][row, start:end]
                    hits += bool(torch.equal(pred[row, start - 1 : end - 1], want))
    finally:
        model.train(was_training)
    answered = sum(1 for s in samples[:index] if s.prompt_len > 0)
    return hits / answered if answered else 0.0


def _plan_line(plan) -> str:
    parts = "; ".join(f"{part} {line}" for part, line in plan.why.items())
    stages = (
        sum(1 for r in plan.rows if r["kind"] == TaskKind.F),
        sum(1 for r in plan.rows if r["kind"] == TaskKind.B),
    )
    return (
        f"plan: policy {plan.policy}, {stages[0]} forward + {stages[1]} backward stages, "
        f"{plan.num_microbatches} microbatches ({parts})"
    )


def _eval_line(step: int, ev: dict) -> str:
    return f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items())


def _as_tuples(state):
    """``random.setstate`` wants tuples where a JSON round trip may have left lists."""
    if isinstance(state, list):
        return tuple(_as_tuples(x) for x in state)
    return state
