"""Watching a run: a tqdm progress bar that other lines are written around, metrics as JSON lines
(and to TensorBoard, Weights & Biases or trackio when asked for), and the pictures drawn at the end (the loss curve, one step's timeline as PNG and Chrome trace).

Caller's thread only. Metrics files are appended line by line and flushed, so a run killed at any
moment leaves every line it logged readable; a resumed run drops the lines past its checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roundpipe.train.config import LoggingConfig
from roundpipe.train.paths import check_filled_dir, run_file


class MetricsLog:
    """``metrics.jsonl`` in the run directory: one JSON object per logged step or evaluation,
    with ``step`` and ``kind`` (``train`` / ``eval``); and its numbers as ``KIND/KEY`` scalars to
    TensorBoard, wandb and trackio when ``config`` asks for them (``run_name`` and ``settings``, the
    resolved recipe, name and describe the wandb / trackio run). ``write=False`` (the ranks other than 0 of a data-parallel run) keeps the rows in memory and
    touches no file."""

    def __init__(
        self,
        run_dir: Path,
        config: LoggingConfig,
        resume_step: int | None = None,
        *,
        write: bool = True,
        run_name: str = "run",
        settings: dict[str, Any] | None = None,
    ):
        self.path = run_file(run_dir, "metrics.jsonl")  # refused if a symlink there leads outside
        self.rows: list[dict[str, Any]] = []
        self._file = self._tb = None
        self._trackers: list[Any] = []  # wandb / trackio runs: init'ed, log(data, step=), finish()
        if not write:
            return
        if resume_step is not None and self.path.exists():
            # Keep what the checkpointed part of the run logged; the steps after it run again.
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if row.get("step", math.inf) <= resume_step:
                    self.rows.append(row)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _tensorboard_writer(run_dir, config.tensorboard)
        self._trackers = _trackers(run_dir, config, run_name, settings or {})

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = {
            f"{row['kind']}/{key}": value
            for key, value in row.items()
            if key not in ("step", "kind") and isinstance(value, (int, float))
        }
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, row["step"])
        for tracker in self._trackers:
            tracker.log(scalars, step=row["step"])

    def series(self, kind: str, key: str) -> tuple[list[int], list[float]]:
        rows = [r for r in self.rows if r.get("kind") == kind and key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.finish()
        self._trackers = []


def _trackers(run_dir: Path, config: LoggingConfig, name: str, settings: dict[str, Any]) -> list[Any]:
    """The wandb and trackio runs ``logging.wandb`` / ``logging.trackio`` ask for (the recipe
    loader has checked that their packages are installed). Each keeps its own online/offline
    setting: WANDB_MODE for wandb; trackio stays local unless given a Space, which this never does."""
    runs = []
    if config.wandb:
        import wandb

        run_file(run_dir, "wandb")  # wandb writes there: refused if a symlink leads outside
        runs.append(wandb.init(project=config.project, name=name, config=settings, dir=str(run_dir)))
    if config.trackio:
        import trackio

        trackio.init(project=config.project, name=name, config=settings)
        runs.append(trackio)  # trackio's log and finish are module functions
    return runs


def _tensorboard_writer(run_dir: Path, wanted: bool | str):
    if wanted is False:
        return None
    directory = run_file(run_dir, "tensorboard")
    check_filled_dir(
        directory, "run.output_dir", value=run_dir, base=run_dir
    )  # its file names are tensorboard's
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        if wanted is True:
            from roundpipe.errors import RecipeError

            raise RecipeError(
                "logging.tensorboard is true but tensorboard is not installed: "
                "pip install 'roundpipe[tensorboard]', or set logging.tensorboard: auto"
            ) from None
        return None
    return SummaryWriter(str(directory))


class Progress:
    """A tqdm bar over optimizer steps showing loss, tokens/s, ETA and the workers' idle share, or
    none when progress bars are off, the output is not a terminal, or ``silent`` (the ranks other
    than 0 of a data-parallel run). ``update`` gives the step's line every ``every`` steps (the
    caller logs it: on the screen where there is no bar, in ``train.log`` always); ``write`` shows
    any other line above the bar, which it redraws below, so no line is written into the bar."""

    def __init__(self, total: int, start: int, enabled: bool, every: int, *, silent: bool = False):
        self.every = every
        self.silent = silent
        self._bar = None
        self._start, self._t0 = start, time.monotonic()
        if enabled and not silent and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.total = total

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def update(self, step: int, loss: float, tokens_per_s: float, idle: float, lr: float) -> str | None:
        """Advance to ``step``; its line when it is one to log (every ``every`` steps, and the last)."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", idle=f"{idle:.0%}")
        if self.silent or not (step % self.every == 0 or step == self.total):
            return None
        per_step = (time.monotonic() - self._t0) / max(1, step - self._start)
        eta = per_step * (self.total - step)
        return (
            f"step {step:5d}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  "
            f"{tokens_per_s:,.0f} tokens/s  workers idle {idle:.0%}  ETA {eta // 60:.0f}:{eta % 60:02.0f}"
        )

    def write(self, text: str, echo: Callable[[str], Any] = print) -> None:
        """``echo(text)``, with the bar cleared first and drawn again after it."""
        if self.silent:
            return
        if self._bar is None:
            echo(text)
            return
        with self._bar.external_write_mode():
            echo(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def save_loss_curve(metrics: MetricsLog, path: Path, title: str) -> None:
    """Train (and eval, where there is one) loss against the optimizer step, as a PNG."""
    path = run_file(Path(path).parent, Path(path).name)  # refused if a symlink there leads outside
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, losses = metrics.series("train", "loss")
    ax.plot(steps, losses, label="train", linewidth=1.2)
    steps, losses = metrics.series("eval", "loss")
    if steps:
        ax.plot(steps, losses, "o-", label="eval", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean cross-entropy per label token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_timeline(pipe, run_dir: Path, title: str) -> list[Path]:
    """The last recorded step of ``pipe``: a Gantt PNG (the simulator's drawing code) and a Chrome
    trace (open in chrome://tracing or Perfetto)."""
    from roundpipe.sim.gantt import save_gantt

    timeline = pipe.last_timeline()
    png, trace = run_file(run_dir, "timeline.png"), run_file(run_dir, "timeline.trace.json")
    save_gantt(timeline, str(png), title=title)
    timeline.save_chrome_trace(str(trace))
    return [png, trace]
