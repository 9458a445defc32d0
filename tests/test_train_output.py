"""What a training run prints: every line through one logger, so a progress bar stays whole and
``train.log`` holds every line; no warning from roundpipe's own calls; a warning for a warm-up
longer than the run; a forecast that says how far to trust it."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import torch
from test_train import _recipe

from roundpipe.train.recipe import config_from_dict
from roundpipe.train.trainer import LOG_FILE, Trainer

torch.set_num_threads(1)


def _short(tmp: Path, **groups) -> dict:
    """Two steps, an evaluation after each, nothing written at the end."""
    recipe = _recipe(tmp, run={"max_steps": 2}, eval={"every": 1}, **groups)
    recipe["checkpoint"] = {"every": None, "at_end": False, "export": "none"}
    return recipe


class _Terminal(io.StringIO):
    """stdout and stderr of a terminal, as one stream (what a user sees)."""

    def isatty(self) -> bool:
        return True


def test_log_lines_are_written_around_the_progress_bar_not_into_it(tmp_path, monkeypatch):
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line)

    recipe = _short(tmp_path, logging={"progress": True, "plots": False, "tensorboard": False})
    Trainer(config_from_dict(recipe), log=log).fit()
    # What stays on a terminal's line: the text after its last carriage return.
    shown = [row.rsplit("\r", 1)[-1] for row in screen.getvalue().split("\n")]
    broken = [part for line in lines for part in line.split("\n") if part not in shown]
    assert not broken, f"printed into the bar's line: {broken[0]!r}"
    assert any("eval at step 2" in line for line in lines)  # through the logger too


def test_train_log_holds_the_step_eval_and_done_lines(tmp_path):
    lines: list[str] = []
    Trainer(config_from_dict(_short(tmp_path)), log=lines.append).fit()
    logged = (tmp_path / "run" / LOG_FILE).read_text(encoding="utf-8")
    for start in ("step     1/2", "step     2/2", "eval at step 2", "done: 2 steps"):
        assert any(line.startswith(start) for line in lines), (start, lines)
        assert f" {start}" in logged, f"{start!r} is not in train.log"


def test_a_warm_up_longer_than_the_run_is_warned_about(tmp_path):
    lines: list[str] = []
    recipe = _short(tmp_path, schedule={"warmup_steps": 5})
    Trainer(config_from_dict(recipe), log=lines.append).fit()
    warned = [line for line in lines if "schedule.warmup_steps" in line]
    assert warned and "5" in warned[0] and "2 steps" in warned[0], lines


def test_a_lora_model_builds_without_a_deprecation_warning():
    from roundpipe.train.config import LoraConfig, ModelConfig
    from roundpipe.train.loading import build_model

    numbers = _recipe(Path("."))["model"]["config"] | {"vocab_size": 64}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build_model(ModelConfig(config=numbers), LoraConfig(enabled=True, rank=4), seed=0)
    deprecations = [
        str(w.message) for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))
    ]
    assert not deprecations, deprecations


def test_the_forecast_says_how_far_to_trust_it_for_its_backend():
    from support.tiny_models import make_model

    from roundpipe.backend import parse_device_spec
    from roundpipe.train.forecast import predict

    text = predict(
        make_model("llama"), parse_device_spec("cpu:2"), policy="roundpipe", seq_len=16, batch=4,
        microbatches=2, lora_rank=None, dtype="fp32", optimizer_mode="sync",
    ).text  # fmt: skip
    assert "predicts" in text and "rough" in text, text
