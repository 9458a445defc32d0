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
import dataclasses
import math
import random
import signal
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roundpipe.errors import ConfigError, DataError
from roundpipe.schedule import TaskKind
from roundpipe.train.batches import Batches, model_inputs
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.config import TrainConfig
from roundpipe.train.data import DataSplits, load_data
from roundpipe.train.evaluation import eval_line, evaluate, show_samples
from roundpipe.train.lr_schedule import lr_at
from roundpipe.train.ranks import Ranks
from roundpipe.train.run_checkpoints import RunCheckpoints
from roundpipe.train.run_setup import (
    check_joined,
    model_for_run,
    record_plan,
    run_config_for,
    write_synthetic,
)

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


@dataclass
class _Run:
    """What one ``fit`` trains, once its pipeline is up: the phases after setup read it."""

    pipe: Any
    model: Any
    tokenizer: Any
    splits: DataSplits
    batches: Batches
    total_steps: int
    checkpoints: RunCheckpoints


@dataclass
class _Loop:
    """The training loop's companions: metrics, the result, the stop flag, the progress bar."""

    metrics: Any
    result: TrainResult
    stop: _StopFlag
    progress: Any


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
    or a checkpoint directory. ``overwrite``: the run directory may hold an earlier run, whose
    outputs (``paths.RUN_DIR_ENTRIES``) are removed first; without it or ``resume`` a run directory
    that holds a run (metrics, a checkpoint, an export) is refused. ``log``: where lines of text go
    (default ``print``; on rank 0 only under torchrun)."""

    def __init__(self, config: TrainConfig, *, resume: str | None = None, overwrite: bool = False, log=print):
        config.check()
        if resume and overwrite:
            raise ConfigError(
                f"--resume {resume} continues the run in {config.output_dir}; --overwrite removes it: "
                "give one of them"
            )
        self.config = config
        self.resume = resume
        self.overwrite = overwrite
        self._print = log
        self.run_dir = Path(config.output_dir)
        self.ranks = Ranks()  # read from the environment when the run starts
        self._progress = None  # the progress bar, while the steps run: lines are written around it

    def log(self, line: str, *, screen: bool = True) -> None:
        """Print ``line`` (above the progress bar, if one is drawn; not at all without ``screen``)
        and append it to the run's log file (``train.log``, once the run dir exists). Every line
        of the run goes through here. Rank 0's job: other ranks stay silent."""
        if not self.ranks.is_main:
            return
        if screen and self._progress is not None:
            self._progress.write(line, self._print)
        elif screen:
            self._print(line)
        if self.run_dir.is_dir():
            self._log_file(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")

    # ------------------------------------------------------------------ the run
    def fit(self) -> TrainResult:
        """Set the run up, train, finish; the phases below, in this order."""
        from roundpipe.runtime import Pipeline

        t_start = time.perf_counter()
        checkpoints, resume_from = self._start_run()
        tokenizer, splits, batches, total_steps = self._read_data()
        self._warn_warmup(total_steps)
        model, weights = model_for_run(self.config, tokenizer, self.log)
        self._check_packing(model)
        self._check_positions(model, splits)
        pipe_config = run_config_for(self.config, model, self.ranks, self.log)
        with Pipeline(model, pipe_config, weights=weights) as pipe:
            run = _Run(pipe, model, tokenizer, splits, batches, total_steps, checkpoints)
            self._prepare_pipeline(pipe)
            start = 0
            if resume_from is not None:
                start = checkpoints.restore(resume_from, pipe, batches)
                self.log(f"resumed from {resume_from} at step {start}")
            loop = self._train(run, start, resumed=resume_from is not None)
            self._finish(run, loop)
        loop.result.elapsed_s = time.perf_counter() - t_start
        if not loop.result.interrupted:
            self.log(_done_line(loop.result))
        return loop.result

    def _warn_warmup(self, total_steps: int) -> None:
        """A warm-up longer than the run never reaches ``optim.lr``: say so before it starts."""
        warmup = self.config.schedule.warmup_steps
        if warmup > total_steps:
            peak = lr_at(total_steps - 1, total_steps, self.config.optim.lr, self.config.schedule)
            self.log(
                f"warning: schedule.warmup_steps is {warmup}, more than the run's {total_steps} steps: "
                f"the learning rate rises to {peak:.2e} only, never to optim.lr {self.config.optim.lr:.2e}; "
                "lower schedule.warmup_steps"
            )

    # ------------------------------------------------------------------ setup
    def _start_run(self) -> tuple[RunCheckpoints, Path | None]:
        """Join the ranks, seed the host RNGs, open the run directory (rank 0; the others wait for
        it, and fail with it) and find the checkpoint to resume from."""
        from roundpipe.train.paths import check_run_paths
        from roundpipe.train.recipe import dump_recipe

        cfg = self.config
        self.ranks = ranks = Ranks.from_environment(cfg.run.data_parallel, cfg.run.dp_timeout_s)
        ranks.join()  # the default process group (gloo), which the pipeline joins, and the trainer's own
        manager = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, repair=ranks.is_main
        )

        def open_run_dir() -> Path | None:  # rank 0's: the others wait for it, and fail with it
            check_run_paths(cfg)  # again, now that the run starts: no symlink in run_dir leads outside
            self._claim_run_dir()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_recipe(cfg), encoding="utf-8")
            write_synthetic(cfg, self.log)
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
        return RunCheckpoints(manager, cfg, ranks, self.log), resume_from

    def _claim_run_dir(self) -> None:
        """A fresh run (no ``resume``) starts in a run directory that holds no earlier run, or, with
        ``overwrite``, one whose earlier outputs it removes first (and says which)."""
        from roundpipe.train.paths import clear_run, previous_run

        if self.resume:
            return
        found = previous_run(self.run_dir)
        if not found:
            return
        if not self.overwrite:
            raise ConfigError(
                f"{self.run_dir} holds a run ({', '.join(found)}): continue it with --resume auto, "
                "start afresh there with --overwrite (removes its checkpoints, metrics, logs, plots "
                "and exports), or set run.output_dir (or run.name) to another directory"
            )
        removed = clear_run(self.run_dir)
        self.log(f"overwrite: removed the earlier run's {', '.join(removed)} from {self.run_dir}")

    def _read_data(self) -> tuple[Any, DataSplits, Batches, int]:
        """The tokenizer, the samples, the training batches and the number of steps to run."""
        from roundpipe.train.tokenizer import load_tokenizer

        cfg = self.config
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
        return tokenizer, splits, batches, total_steps

    def _check_packing(self, model) -> None:
        """Refuse ``data.packing`` for a model whose layers cannot keep the samples of a row apart,
        before any weight is read (``models.adapter.packing_refusal_of``)."""
        from roundpipe.models.adapter import packing_refusal_of

        refusal = self.config.data.packing and packing_refusal_of(model)
        if refusal:
            raise ConfigError(f"data.packing: {refusal}")

    def _check_positions(self, model, splits: DataSplits) -> None:
        """Refuse rows longer than the model's config reaches (``partition.positions``: its
        positions, or what its rope scaling stretches them to), before any weight is read."""
        from roundpipe.partition.positions import check_positions

        data = self.config.data
        samples = [*splits.train, *splits.eval]
        longest = data.max_length if data.packing else max((len(s.input_ids) for s in samples), default=0)
        try:
            check_positions(model.config.to_dict(), longest)
        except ConfigError as err:
            what = "packed rows" if data.packing else "its longest sample"
            raise ConfigError(f"data.max_length: rows of {longest} tokens ({what}): {err}") from None

    def _prepare_pipeline(self, pipe) -> None:
        """Check the ranks the pipeline joined, log its layers and devices, set up its optimizer."""
        cfg = self.config
        check_joined(pipe, self.ranks)
        self.log(
            f"plan: {len(pipe.adapter.layers)} layers over [{', '.join(d.name for d in pipe.backend.devices)}]"
        )
        pipe.configure_optimizer(
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            max_grad_norm=cfg.optim.max_grad_norm,
            state_dtype=cfg.optim.state_dtype,
        )

    # ------------------------------------------------------------------ training
    def _train(self, run: _Run, start: int, *, resumed: bool) -> _Loop:
        """Steps ``start + 1`` .. ``total_steps`` (an evaluation first on a fresh run), until the end
        or a signal. A failure is logged in full, with the on-error checkpoint, and raised."""
        from roundpipe.train.watch import MetricsLog, Progress

        cfg, main = self.config, self.ranks.is_main
        loop = _Loop(
            metrics=MetricsLog(
                self.run_dir,
                cfg.logging,
                resume_step=start if resumed else None,
                write=main,
                run_name=cfg.run.name,
                settings=dataclasses.asdict(cfg),
            ),
            result=TrainResult(self.run_dir, start),
            stop=_StopFlag(cfg.checkpoint.on_signal, announce=main),
            progress=Progress(
                run.total_steps, start, cfg.logging.progress, cfg.logging.every, silent=not main
            ),
        )
        self._progress = loop.progress
        caught = warnings.catch_warnings()  # rank 0's Python warnings of the steps: through self.log
        caught.__enter__()
        if main:  # the other ranks, which log nothing, keep printing theirs to stderr
            warnings.showwarning = self._log_warning
        try:
            if start == 0 and cfg.eval.every is not None and run.splits.eval:
                self._evaluate_at(run, loop, 0)
            for step in range(start, run.total_steps):
                before = run.checkpoints.position(run.batches)  # where this step starts, should it fail
                try:
                    row = self._train_step(run, step)
                except Exception as err:
                    self._log_failure(err, f"step {step + 1} failed")
                    written = run.checkpoints.after_failure(step, run.pipe, before)
                    if written is not None:
                        loop.result.checkpoint = written
                    raise
                if step == start:  # what runs from now on, and why (an "auto" choice is made by now)
                    self.log(_plan_line(run.pipe.plan))
                    if main:
                        record_plan(self.run_dir, run.pipe, resumed=resumed, log=self.log)
                if self._after_step(run, loop, step, row):
                    break
        except Exception as err:  # outside a step too (a checkpoint write, an evaluation)
            if not getattr(err, "_roundpipe_logged", False):
                self._log_failure(err, f"the run failed after step {loop.result.steps}")
            raise
        finally:
            caught.__exit__(None, None, None)
            loop.progress.close()
            self._progress = None
            loop.stop.restore()
            loop.metrics.close()
        return loop

    def _after_step(self, run: _Run, loop: _Loop, step: int, row: dict) -> bool:
        """Step ``step + 1`` is done: record it, then draw, evaluate and checkpoint where due. True
        when the run stops here."""
        cfg, result = self.config, loop.result
        loop.metrics.log(row)
        result.train_losses.append(row["loss"])
        result.steps = step + 1
        line = loop.progress.update(step + 1, row["loss"], row["tokens_per_s"], row["idle"], row["lr"])
        if line is not None:  # the bar shows the step; train.log gets its line
            self.log(line, screen=not loop.progress.has_bar)
        last = step + 1 == run.total_steps
        # A signal may reach the ranks on either side of a step: every rank stops after
        # the step at which any rank saw it, so all write the same checkpoint.
        stopping = self.ranks.any(loop.stop.signal is not None)
        if self.ranks.is_main and cfg.logging.plots and (last or stopping):
            self._save_timeline(run.pipe)
        if run.splits.eval and (last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)):
            self._evaluate_at(run, loop, step + 1)
        due = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
        if due or stopping or (last and cfg.checkpoint.at_end):
            result.checkpoint = run.checkpoints.save(step + 1, run.pipe, run.batches)
        if stopping:
            result.interrupted = True
            self.log(f"stopped at step {step + 1} of {run.total_steps}; resume with --resume auto")
        return stopping

    def _train_step(self, run: _Run, step: int) -> dict:
        """Step ``step + 1``: its learning rate, ``grad_accum`` forward/backward calls whose gradients
        add up to those of the token-mean loss of the whole step, the update; its metrics row."""
        from roundpipe.testing import faults

        cfg, pipe, batches = self.config, run.pipe, run.batches
        lr = lr_at(step, run.total_steps, cfg.optim.lr, cfg.schedule)
        pipe.set_lr(lr)
        faults.point("data", step=step + 1)
        micro = [batches.next() for _ in range(cfg.run.grad_accum)]
        label_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        t0 = time.perf_counter()
        loss_sum, tokens, idle = 0.0, 0, []
        for i, b in enumerate(micro):
            out = pipe.forward_backward(
                **model_inputs(b),  # packed rows: position ids restart per sample, no attention mask
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

    def _evaluate_at(self, run: _Run, loop: _Loop, step: int) -> None:
        """Evaluate on the held-out samples after ``step`` steps; the result keeps the values."""
        loop.result.eval = evaluate(
            run.pipe,
            run.model,
            run.splits.eval,
            run.tokenizer,
            step,
            loop.metrics,
            cfg=self.config,
            is_main=self.ranks.is_main,
        )
        self.log(eval_line(step, loop.result.eval))

    def _log_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """``warnings.showwarning`` while the steps run: above the bar, and into train.log."""
        self.log(f"warning: {category.__name__}: {message} ({Path(filename).name}:{lineno})")

    def _save_timeline(self, pipe) -> None:
        from roundpipe.train.watch import save_timeline

        try:
            save_timeline(pipe, self.run_dir, f"{self.config.run.name}: one training step")
        except Exception as e:  # a picture must not fail the run
            self.log(f"timeline not drawn: {e}")

    # ------------------------------------------------------------------ the end
    def _finish(self, run: _Run, loop: _Loop) -> None:
        """The loss curve; unless a signal stopped the run, the exports and a few greedy answers."""
        cfg, main = self.config, self.ranks.is_main
        if main and cfg.logging.plots:
            from roundpipe.train.watch import save_loss_curve

            save_loss_curve(loop.metrics, self.run_dir / "loss.png", f"{cfg.run.name}: loss")
        if not loop.result.interrupted:
            loop.result.exports = self._export(run)
            if main and cfg.eval.show_samples and run.splits.eval:
                samples = run.splits.eval[: cfg.eval.show_samples]
                show_samples(run.model, samples, run.tokenizer, cfg.eval.max_new_tokens, self.log)

    def _export(self, run: _Run) -> dict[str, Path]:
        """The exports ``checkpoint.export`` asks for (rank 0 writes them), by kind."""
        from roundpipe.train.export import export_adapter, export_merged

        cfg, pipe, model, tokenizer = self.config, run.pipe, run.model, run.tokenizer
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
            # a base kept compressed merges on what the run computed with, written in bf16
            unpacked = pipe.store.unpacked_weights()
            export_merged(
                model,
                out["merged"],
                tokenizer=tokenizer,
                dtype=torch.bfloat16 if unpacked else None,
                base_values=unpacked,
                merged_from=pipe.config.quantization if unpacked else None,
            )
        for name, path in out.items():
            self.log(f"export ({name}): {path}")
        return out

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


def _done_line(result: TrainResult) -> str:
    line = f"done: {result.steps} steps in {result.elapsed_s:.0f} s"
    if result.eval:
        line += "; held-out " + ", ".join(f"{k} {v:.4f}" for k, v in result.eval.items())
    return line


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
