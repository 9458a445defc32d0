"""A recipe is checked whole before anything loads: every value's range, the optional packages it
asks for, and the rules between keys, each refusal naming the key and where it was given
(``FILE:LINE`` or ``--set ...``)."""

from __future__ import annotations

import pytest
from support.recipe_files import error_of, write

from roundpipe.errors import RecipeError
from roundpipe.train import config as config_module
from roundpipe.train.recipe import config_from_dict, load_recipe

MINIMAL = "model:\n  path: /m\ndata:\n  train: t.jsonl\n"  # lines 1-4; a group added after starts at 5


@pytest.mark.parametrize(
    "lines, expected",
    [
        ("optim:\n  lr: -1.0", "optim.lr must be a finite number >= 0, got -1.0"),
        ("run:\n  batch_size: 0", "run.batch_size must be at least 1, got 0"),
        ("run:\n  max_steps: 0", "run.max_steps must be at least 1 or null, got 0"),
        ("run:\n  epochs: -1", "run.epochs must be a finite number > 0, got -1.0"),
        ("data:\n  eval_fraction: 1.0", "data.eval_fraction must be in [0, 1), got 1.0"),
        ("lora:\n  dropout: 1.5", "lora.dropout must be in [0, 1), got 1.5"),
        ("lora:\n  rank: 0", "lora.rank must be at least 1, got 0"),
        ("schedule:\n  warmup_steps: -2", "schedule.warmup_steps must be at least 0, got -2"),
        ("schedule:\n  min_lr_ratio: 2", "schedule.min_lr_ratio must be in [0, 1], got 2.0"),
        ("eval:\n  max_new_tokens: 0", "eval.max_new_tokens must be at least 1, got 0"),
        ("eval:\n  show_samples: -1", "eval.show_samples must be at least 0, got -1"),
        ("eval:\n  batch_size: 0", "eval.batch_size must be at least 1 or null, got 0"),
        (
            "data:\n  synthetic_samples: [5]",
            "data.synthetic_samples must be two counts >= 1 [train, eval], got [5]",
        ),
    ],
)
def test_a_value_out_of_range_is_refused_naming_its_line_and_key(tmp_path, lines, expected):
    text = MINIMAL + lines + "\n"
    if lines.startswith("data:"):  # under the recipe's own data: group
        text = MINIMAL + lines.split("\n", 1)[1] + "\n"
    path = write(tmp_path, text)
    line = text.count("\n")  # the last line holds the value
    assert error_of(path) == f"{path}:{line}: {expected}"


def test_an_override_out_of_range_names_the_override(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert error_of(path, ("optim.lr=-1",)) == (
        "--set optim.lr=-1: optim.lr must be a finite number >= 0, got -1.0"
    )


def test_tensorboard_true_without_the_package_is_refused_when_the_recipe_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(config_module, "package_installed", lambda name: name != "tensorboard")
    path = write(tmp_path, MINIMAL + "logging:\n  tensorboard: true\n")
    assert error_of(path) == (
        f"{path}:6: logging.tensorboard is true but tensorboard is not installed: "
        "pip install 'roundpipe[tensorboard]', or set logging.tensorboard: auto"
    )
    write(tmp_path, MINIMAL + "logging:\n  tensorboard: auto\n")
    assert load_recipe(path).logging.tensorboard == "auto"  # auto: used when there


def test_a_rule_between_keys_names_the_line_of_the_key_to_change(tmp_path):
    path = write(tmp_path, MINIMAL + "checkpoint:\n  export: adapter\n")
    assert error_of(path) == (
        f"{path}:6: checkpoint.export: adapter needs lora.enabled: true (a full fine-tune has no "
        "adapter); export: merged, or enable LoRA"
    )
    path = write(tmp_path, MINIMAL + "  synthetic: reverse\n")
    assert error_of(path) == (
        f"{path}:5: data.synthetic writes a held-out file too: set data.eval to its path"
    )


def test_a_config_built_in_python_is_checked_the_same(tmp_path):
    from dataclasses import replace

    from roundpipe.train.trainer import Trainer

    cfg = config_from_dict({"model": {"path": "/m"}, "data": {"train": "t.jsonl"}})
    cfg = replace(cfg, optim=replace(cfg.optim, lr=-1.0))
    with pytest.raises(RecipeError, match=r"^optim.lr must be a finite number >= 0, got -1.0$"):
        Trainer(cfg)
    cfg = replace(cfg, optim=replace(cfg.optim, lr=1e-4), schedule=replace(cfg.schedule, warmup_steps=-1))
    with pytest.raises(RecipeError, match=r"^schedule.warmup_steps must be at least 0, got -1$"):
        Trainer(cfg)


def test_the_table_beside_axolotl_and_llama_factory_names_only_recipe_keys(monkeypatch):
    from roundpipe.train import recipe_reference

    rows = recipe_reference.comparison_markdown()
    assert len([r for r in rows if r.startswith("| `")]) == len(recipe_reference.ELSEWHERE)
    monkeypatch.setattr(recipe_reference, "ELSEWHERE", (("optim.learning_rate", "x", "y"),))
    with pytest.raises(ValueError, match="optim.learning_rate, which is no recipe key"):
        recipe_reference.comparison_markdown()
