"""YAML recipes: how a file and ``--set`` overrides become a TrainConfig, and how they fail.

Every error names the dotted key and where it came from (``FILE:LINE`` or ``--set ...``); the
reference page docs/recipes.md is generated from the dataclasses and must match them.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.recipe_files import error_of, write

from roundpipe.errors import RecipeError
from roundpipe.train.config import REQUIRED, TrainConfig
from roundpipe.train.recipe import config_from_dict, dump_recipe, load_recipe
from roundpipe.train.recipe_reference import help_epilog, reference_markdown

ROOT = Path(__file__).resolve().parents[1]

VALID = """\
model:
  path: /models/qwen3
lora:
  enabled: true
  rank: 8
  alpha: 16            # an int for a float field
  target_modules: [q_proj, v_proj]
data:
  train: data/train.jsonl
  format: chat
  max_length: 512
run:
  name: demo
  num_microbatches: auto
  max_steps: 20
  options: {head_shards: 4}
optim:
  lr: 1e-4             # YAML 1.1 reads this as a string; a float field takes it
  betas: [0.9, 0.95]
  max_grad_norm: null
schedule:
  kind: linear
logging:
  tensorboard: false
"""


MINIMAL = "model:\n  path: /m\ndata:\n  train: t.jsonl\n"


# --- a valid recipe ----------------------------------------------------------------------------------


def test_a_valid_recipe_loads_with_its_values_and_defaults_elsewhere(tmp_path):
    cfg = load_recipe(write(tmp_path, VALID))
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.path == "/models/qwen3" and cfg.model.config is None
    assert cfg.lora.enabled is True and cfg.lora.rank == 8
    assert cfg.lora.alpha == 16.0 and isinstance(cfg.lora.alpha, float)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.train == "data/train.jsonl" and cfg.data.format == "chat" and cfg.data.max_length == 512
    assert cfg.run.name == "demo" and cfg.run.num_microbatches == "auto" and cfg.run.max_steps == 20
    assert cfg.run.options == {"head_shards": 4}
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == [0.9, 0.95] and cfg.optim.max_grad_norm is None
    assert cfg.schedule.kind == "linear" and cfg.logging.tensorboard is False
    # untouched keys keep the dataclass defaults
    assert cfg.run.batch_size == 8 and cfg.eval == TrainConfig().eval and cfg.checkpoint.keep_last == 2
    assert cfg.output_dir == "runs/demo"


def test_a_group_with_every_key_commented_out_keeps_its_defaults(tmp_path):
    cfg = load_recipe(write(tmp_path, MINIMAL + "lora:\n  # enabled: true\n"))
    assert cfg.lora == TrainConfig().lora


def test_yaml_merge_keys_work_and_the_written_key_wins(tmp_path):
    text = MINIMAL + "eval: &common\n  every: 5\n  batch_size: 2\ncheckpoint:\n  <<: *common\n  every: 7\n"
    with pytest.raises(RecipeError, match=r"unknown key checkpoint\.batch_size"):
        load_recipe(write(tmp_path, text))
    text = MINIMAL + "eval: &common\n  every: 5\ncheckpoint:\n  <<: *common\n  keep_last: 3\n"
    cfg = load_recipe(write(tmp_path, text))
    assert cfg.checkpoint.every == 5 and cfg.checkpoint.keep_last == 3 and cfg.eval.every == 5


# --- overrides ---------------------------------------------------------------------------------------


def test_overrides_win_over_the_file_and_are_read_as_yaml(tmp_path):
    cfg = load_recipe(
        write(tmp_path, VALID),
        [
            "run.max_steps=10",
            "lora.target_modules=[k_proj,o_proj]",
            "model.path=/x",
            "run.options.partition=auto",
            "optim.max_grad_norm=0.5",
            "run.max_steps=11",  # applied in order: the last one wins
        ],
    )
    assert cfg.run.max_steps == 11
    assert cfg.lora.target_modules == ["k_proj", "o_proj"]
    assert cfg.model.path == "/x"
    assert cfg.run.options == {"head_shards": 4, "partition": "auto"}  # one entry set, the other kept
    assert cfg.optim.max_grad_norm == 0.5


def test_a_dotted_override_sets_one_entry_of_a_dict_even_when_the_recipe_has_none(tmp_path):
    path = write(tmp_path, "data:\n  train: t.jsonl\n")
    cfg = load_recipe(path, ["model.config.model_type=qwen3", "model.config.num_hidden_layers=2"])
    assert cfg.model.config == {"model_type": "qwen3", "num_hidden_layers": 2}


def test_an_override_can_set_a_required_key_the_file_lacks(tmp_path):
    cfg = load_recipe(write(tmp_path, "model:\n  path: /m\n"), ["data.train=d.jsonl"])
    assert cfg.data.train == "d.jsonl"


def test_override_errors_name_the_override_not_a_line(tmp_path):
    path = write(tmp_path, MINIMAL)
    message = error_of(path, ("run.max_step=10",))
    assert message == "--set run.max_step=10: unknown key run.max_step; did you mean run.max_steps?"
    message = error_of(path, ("run.max_steps=ten",))
    assert message.startswith("--set run.max_steps=ten: run.max_steps must be int or null")
    assert "GROUP.KEY=VALUE" in error_of(path, ("max_steps=10",))
    assert "GROUP.KEY=VALUE" in error_of(path, ("run.max_steps",))
    assert error_of(path, ("run.max_steps=[1",)).startswith(
        "--set run.max_steps=[1: the value is not valid YAML"
    )
    assert "run.max_steps is not a dict" in error_of(path, ("run.max_steps.x=1",))


# --- unknown keys ------------------------------------------------------------------------------------


def test_an_unknown_group_names_file_and_line_and_the_nearest_group(tmp_path):
    path = write(tmp_path, MINIMAL + "optimm:\n  lr: 0.1\n")
    assert error_of(path) == f"{path}:5: unknown key optimm; did you mean optim?"


def test_an_unknown_nested_key_names_the_dotted_key_its_line_and_the_nearest(tmp_path):
    path = write(tmp_path, MINIMAL + "run:\n  name: x\n  max_step: 10\n")
    assert error_of(path) == f"{path}:7: unknown key run.max_step; did you mean run.max_steps?"


def test_a_key_in_the_wrong_place_points_to_its_group(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "run:\n  lr: 0.1\n"))
    assert message.endswith(":6: unknown key run.lr; did you mean optim.lr?")
    message = error_of(write(tmp_path, MINIMAL + "max_steps: 3\n"))
    assert message.endswith(
        ":5: unknown key max_steps; keys go under their group: did you mean run.max_steps?"
    )


def test_an_unknown_key_with_no_near_neighbour_lists_what_is_valid(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "schedule:\n  zzzz: 1\n"))
    assert "unknown key schedule.zzzz; schedule takes kind, warmup_steps, min_lr_ratio" in message


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = write(tmp_path, MINIMAL + "run:\n  seed: 1\n  seed: 2\n")
    assert error_of(path) == f"{path}:7: run.seed is given twice (first at line 6)"


# --- wrong types -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("run:\n  max_steps: ten", 'run.max_steps must be int or null; got str "ten"'),
        ("run:\n  batch_size: true", "run.batch_size must be int; got bool true"),  # bool is not int
        ("run:\n  batch_size: 2.5", "run.batch_size must be int; got float 2.5"),
        ("optim:\n  lr: fast", 'optim.lr must be float; got str "fast"'),
        ("optim:\n  betas: [0.9, high]", "optim.betas must be list[float]; got list [0.9, high]"),
        ("lora:\n  target_modules: 3", "lora.target_modules must be list[str] or str; got int 3"),
        ("run:\n  options: [1, 2]", "run.options must be dict; got list [1, 2]"),
        ("checkpoint:\n  at_end: 1", "checkpoint.at_end must be bool; got int 1"),
        ("run:\n  num_microbatches: four", 'run.num_microbatches must be int or auto; got str "four"'),
        ("logging:\n  tensorboard: maybe", 'logging.tensorboard must be bool or auto; got str "maybe"'),
    ],
)
def test_a_wrong_type_names_the_key_the_expected_type_and_the_line(tmp_path, line, expected):
    path = write(tmp_path, MINIMAL + line + "\n")
    assert error_of(path) == f"{path}:6: {expected}"


@pytest.mark.parametrize(
    "line, key",
    [
        ("optim:\n  lr: -1.0", "optim.lr"),
        ("optim:\n  lr: .nan", "optim.lr"),
        ("optim:\n  weight_decay: .nan", "optim.weight_decay"),
        ("optim:\n  weight_decay: -0.1", "optim.weight_decay"),
        ("optim:\n  eps: 0.0", "optim.eps"),
        ("optim:\n  eps: .inf", "optim.eps"),
        ("optim:\n  betas: [0.9, 1.0]", "optim.betas"),
        ("optim:\n  max_grad_norm: .nan", "optim.max_grad_norm"),
        ("optim:\n  max_grad_norm: 0.0", "optim.max_grad_norm"),
    ],
)
def test_an_optimizer_setting_adamw_cannot_take_is_refused_when_the_recipe_loads(tmp_path, line, key):
    """The values configure_optimizer refuses are refused at load, naming the key, before any model
    is built."""
    message = error_of(write(tmp_path, MINIMAL + line + "\n"))
    assert f"{key} must be" in message, message


def test_literal_choices_are_listed_with_the_nearest(tmp_path):
    path = write(tmp_path, MINIMAL.replace("t.jsonl\n", "t.jsonl\n  format: txt\n"))
    assert error_of(path) == (
        f'{path}:5: data.format must be one of text, instruction, chat, sharegpt; got str "txt"; did you mean text?'
    )
    message = error_of(write(tmp_path, MINIMAL + "run:\n  dtype: 16\n"))
    assert "run.dtype must be one of fp32, bf16, fp16; got int 16" in message


def test_a_group_that_is_not_a_mapping_is_an_error(tmp_path):
    path = write(tmp_path, MINIMAL + "run: 5\n")
    message = error_of(path)
    assert message.startswith(f"{path}:5: run must be a mapping of keys") and message.endswith("got int")


# --- missing, empty, broken ----------------------------------------------------------------------------


def test_a_missing_data_train_names_the_key_and_the_file(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\ndata:\n  format: text\n")
    message = error_of(path)
    assert message.startswith(f"{path}: data.train is required")


def test_every_required_field_is_refused_when_missing():
    required = [
        (g.name, f.name)
        for g in dataclasses.fields(TrainConfig)
        for f in dataclasses.fields(g.default_factory())
        if f.default is REQUIRED
    ]
    assert ("data", "train") in required
    for group, key in required:
        data = {"model": {"path": "/m"}, "data": {"train": "t.jsonl"}}
        data.setdefault(group, {}).pop(key, None)
        with pytest.raises(RecipeError, match=rf"^<dict>: {group}\.{key} is required"):
            config_from_dict(data)


def test_an_empty_file_is_an_error(tmp_path):
    path = write(tmp_path, "# nothing yet\n")
    assert error_of(path).startswith(f"{path}: the recipe is empty")


def test_a_recipe_that_is_not_a_mapping_is_an_error(tmp_path):
    path = write(tmp_path, "- model\n- data\n")
    assert error_of(path).startswith(f"{path}:1: a recipe is a mapping of groups")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\ndata:\n  train: t.jsonl\n   format: text\n")
    message = error_of(path)
    assert message.startswith(f"{path}:5: invalid YAML: mapping values are not allowed here")


def test_a_missing_file_is_an_error(tmp_path):
    assert error_of(tmp_path / "nope.yaml") == f"recipe file not found: {tmp_path / 'nope.yaml'}"


def test_cross_field_rules_run_and_name_the_file(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\n  config: {model_type: qwen3}\ndata:\n  train: t.jsonl\n")
    assert error_of(path).startswith(f"{path}: set exactly one of model.path")


def test_a_run_setting_is_checked_by_run_configs_own_rule_naming_the_line(tmp_path):
    path = write(tmp_path, MINIMAL + "run:\n  num_microbatches: 0\n")
    assert error_of(path) == f"{path}:6: run.num_microbatches must be a positive int or 'auto', got 0"
    path = write(tmp_path, MINIMAL + "run:\n  policy: zigzag\n")
    assert error_of(path).startswith(
        f"{path}:6: run.policy: unknown policy 'zigzag'; choose 'auto' or one of "
    )
    assert error_of(path, ("run.policy=roundpipe", "run.dp_timeout_s=0")) == (
        "--set run.dp_timeout_s=0: run.dp_timeout_s must be a positive number of seconds, got 0.0"
    )


# --- config_from_dict ----------------------------------------------------------------------------------


def test_config_from_dict_checks_the_same_and_copies_the_values():
    modules = ["q_proj"]
    cfg = config_from_dict(
        {
            "model": {"config": {"model_type": "qwen3"}},
            "data": {"train": "t"},
            "lora": {"target_modules": modules},
        }
    )
    modules.append("v_proj")
    assert cfg.lora.target_modules == ["q_proj"] and cfg.model.config == {"model_type": "qwen3"}
    with pytest.raises(
        RecipeError, match=r"^mine: unknown key run\.max_step; did you mean run\.max_steps\?$"
    ):
        config_from_dict({"data": {"train": "t"}, "run": {"max_step": 1}}, source="mine")
    with pytest.raises(RecipeError, match=r"^<dict>: optim\.lr must be float; got bool true$"):
        config_from_dict({"model": {"path": "/m"}, "data": {"train": "t"}, "optim": {"lr": True}})


# --- dump and round trip -------------------------------------------------------------------------------


def test_a_dumped_config_loads_back_equal(tmp_path):
    cfg = load_recipe(
        write(tmp_path, VALID),
        [
            "data.prompt_template=|\n  Q: {instruction}\n\n  A:\n",
            "model.tokenizer=byte",
            "optim.eps=1e-12",
            "run.output_dir='yes'",  # a string YAML would otherwise read as a bool
        ],
    )
    assert cfg.data.prompt_template == "Q: {instruction}\n\nA:\n" and cfg.run.output_dir == "yes"
    text = dump_recipe(cfg)
    again = load_recipe(write(tmp_path, text, "resolved.yaml"))
    assert again == cfg
    assert config_from_dict(yaml.safe_load(text)) == cfg
    # every key of every group is written, so the file documents the whole run
    data = yaml.safe_load(text)
    for group in dataclasses.fields(TrainConfig):
        assert set(data[group.name]) == {f.name for f in dataclasses.fields(getattr(cfg, group.name))}


def test_dump_refuses_a_value_yaml_cannot_hold():
    cfg = config_from_dict({"model": {"path": "/m"}, "data": {"train": "t"}})
    cfg.run.options["bad"] = object()
    with pytest.raises(RecipeError, match="cannot write the config as YAML"):
        dump_recipe(cfg)


# --- reference docs --------------------------------------------------------------------------------------


def test_every_default_fits_its_own_annotation_and_every_field_has_help():
    # A field added to config.py with an annotation the loader cannot check, or without help, fails here.
    defaults = TrainConfig()
    defaults.model.path, defaults.data.train = "/m", "t.jsonl"
    assert config_from_dict(dataclasses.asdict(defaults)) == defaults  # every key given, every key checked
    for group in dataclasses.fields(TrainConfig):
        assert group.metadata["help"]
        for f in dataclasses.fields(group.default_factory()):
            assert f.metadata.get("help"), f"{group.name}.{f.name} has no help"


def test_the_reference_and_the_epilog_list_every_key():
    page, epilog = reference_markdown(), help_epilog()
    for group in dataclasses.fields(TrainConfig):
        assert f"\n## {group.name}\n" in page
        for f in dataclasses.fields(group.default_factory()):
            assert f"| `{f.name}` |" in page
            assert f"  {group.name}.{f.name} (" in epilog
    assert "  data.train (str or list[str or dict], required): Training data file" in epilog
    assert "  run.max_steps (int or null, default null): " in epilog
    assert "| `format` | text \\| instruction \\| chat \\| sharegpt | `instruction` |" in page
    assert all(len(line) <= 100 for line in epilog.splitlines())


def test_docs_recipes_md_is_in_step_with_the_dataclasses():
    page = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert page == reference_markdown(), (
        "docs/recipes.md is out of date; regenerate it with "
        ".venv/bin/python -m roundpipe.train.recipe --markdown > docs/recipes.md"
    )


def test_the_module_prints_the_markdown_and_never_imports_torch():
    code = (
        "import runpy, sys; sys.argv = ['recipe', '--markdown']\n"
        "try:\n    runpy.run_module('roundpipe.train.recipe', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'roundpipe.train.recipe imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference_markdown()
