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


# --- Weights & Biases and trackio ------------------------------------------------------------------


class _FakeTracker:
    """A stand-in for the ``wandb`` / ``trackio`` module: records the calls made to it."""

    def __init__(self, name: str):
        self.__name__ = name
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


def _metrics_with(tmp_path, monkeypatch, name: str):
    from roundpipe.train.config import LoggingConfig
    from roundpipe.train.watch import MetricsLog

    fake = _FakeTracker(name)
    monkeypatch.setitem(sys.modules, name, fake)
    config = LoggingConfig(tensorboard=False, **{name: True}, project="p")
    metrics = MetricsLog(tmp_path, config, run_name="r", settings={"optim": {"lr": 0.1}})
    metrics.log({"kind": "train", "step": 1, "loss": 2.5, "lr": 0.1, "skipped": True})
    metrics.log({"kind": "eval", "step": 1, "loss": 2.0})
    metrics.close()
    return fake.calls


def test_wandb_gets_the_run_its_settings_every_row_and_a_finish(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    calls = _metrics_with(tmp_path, monkeypatch, "wandb")
    init = calls[0][1]
    assert init["project"] == "p" and init["name"] == "r" and init["config"] == {"optim": {"lr": 0.1}}
    assert "mode" not in init  # offline or online is wandb's own setting (WANDB_MODE), not overridden
    assert Path(init["dir"]).resolve() == tmp_path.resolve()
    assert calls[1:] == [
        ("log", {"train/loss": 2.5, "train/lr": 0.1, "train/skipped": True}, 1),
        ("log", {"eval/loss": 2.0}, 1),
        ("finish",),
    ]


def test_trackio_gets_the_run_its_settings_every_row_and_a_finish(tmp_path, monkeypatch):
    calls = _metrics_with(tmp_path, monkeypatch, "trackio")
    assert calls[0] == ("init", {"project": "p", "name": "r", "config": {"optim": {"lr": 0.1}}})
    assert calls[1:] == [
        ("log", {"train/loss": 2.5, "train/lr": 0.1, "train/skipped": True}, 1),
        ("log", {"eval/loss": 2.0}, 1),
        ("finish",),
    ]


def test_a_tracker_asked_for_but_not_installed_is_refused_when_the_recipe_loads(tmp_path, monkeypatch):
    import pytest

    from roundpipe.errors import RecipeError
    from roundpipe.train import config as config_module
    from roundpipe.train.recipe import load_recipe

    monkeypatch.setattr(config_module, "package_installed", lambda name: name not in ("wandb", "trackio"))
    for name in ("wandb", "trackio"):
        path = tmp_path / "recipe.yaml"
        path.write_text(f"model:\n  path: /m\ndata:\n  train: t.jsonl\nlogging:\n  {name}: true\n")
        with pytest.raises(RecipeError) as info:
            load_recipe(path)
        assert str(info.value) == (
            f"{path}:6: logging.{name} is true but {name} is not installed: "
            f"pip install 'roundpipe[{name}]', or set logging.{name}: false"
        )


def test_a_python_warning_during_the_steps_goes_through_the_run_log(tmp_path, monkeypatch):
    from roundpipe.train import trainer as trainer_module

    real = trainer_module.lr_at

    def lr_at(*args, **kwargs):
        warnings.warn("an odd learning rate", UserWarning, stacklevel=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "lr_at", lr_at)
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        Trainer(config_from_dict(_short(tmp_path)), log=lines.append).fit()
    assert any(line.startswith("warning: UserWarning: an odd learning rate") for line in lines), lines
    assert "warning: UserWarning: an odd learning rate" in (tmp_path / "run" / LOG_FILE).read_text()
