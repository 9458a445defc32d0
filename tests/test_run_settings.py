"""A run setting is declared once, as a field of RunConfig; everything else is read off it.

The recipe's ``run:`` keys, their types, defaults and help, the keys ``run.options`` may not repeat,
the recipe loader's check of each key and the trainer's copy into a RunConfig all follow the
declaration. These tests say so for every setting, so a new one is covered without a new test.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields
from pathlib import Path

import pytest

import roundpipe
from roundpipe.config import RunConfig, recipe_settings
from roundpipe.errors import ConfigError, RecipeError
from roundpipe.settings_table import settings_table
from roundpipe.train.config import RunSection, TrainConfig
from roundpipe.train.recipe import config_from_dict

SETTINGS = {f.name: f for f in dataclasses.fields(roundpipe.RunConfig)}
RECIPE = {f.name: f for f in recipe_settings()}
MINIMAL = {"model": {"path": "/m"}, "data": {"train": "t.jsonl"}}


def test_every_setting_has_help_and_appears_in_the_docstring():
    for name, f in SETTINGS.items():
        assert f.metadata["help"], f"RunConfig.{name} has no help"
        assert f"\n        {name}: " in roundpipe.RunConfig.__doc__


def test_the_run_section_holds_every_setting_a_recipe_sets_with_its_default_and_help():
    section = {f.name: f for f in dataclasses.fields(RunSection)}
    hints = typing.get_type_hints(RunSection)
    assert set(section) & set(SETTINGS) == set(RECIPE)  # no hand-written mirror of a setting
    for name, f in RECIPE.items():
        assert section[name].metadata["help"] == f.metadata["recipe"]
        assert getattr(RunSection(), name) == getattr(roundpipe.RunConfig(), name)
        if f.metadata["choices"]:
            assert typing.get_args(hints[name]) == f.metadata["choices"]


def test_the_run_sections_defaults_make_the_default_run_config():
    run = TrainConfig().run
    assert roundpipe.RunConfig(**{name: getattr(run, name) for name in RECIPE}) == roundpipe.RunConfig()


def test_run_options_takes_every_other_setting_and_refuses_those_run_sets():
    for name in SETTINGS:
        value = getattr(roundpipe.RunConfig(), name)
        recipe = {**MINIMAL, "run": {"options": {name: value}}}
        if name in RECIPE:
            with pytest.raises(RecipeError, match=rf"run\.options\.{name} is set by run\.{name}"):
                config_from_dict(recipe)
        else:
            assert config_from_dict(recipe).run.options == {name: value}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # A bool is not a count (round_size and dp_bucket_bytes always said so; now every count does).
        ({"head_shards": True}, "head_shards must be a positive int, got True"),
        ({"head_chunk_tokens": True}, "head_chunk_tokens must be a positive int, got True"),
        ({"copy_chunk_bytes": True}, "copy_chunk_bytes must be a positive int, got True"),
        ({"num_microbatches": True}, "num_microbatches must be a positive int or 'auto', got True"),
        ({"partition": (1, True)}, r"partition must list a positive number of layers per stage"),
        # "auto" is a forward partition only; as a backward partition it failed later, at wrap time.
        ({"partition": (1, 2), "backward_partition": "auto"}, "backward_partition must list a positive"),
        ({"backward_partition": (1, 1)}, "backward_partition needs partition too"),
        ({"watchdog_s": 0}, "watchdog_s must be a positive number of seconds"),
        ({"dp_timeout_s": float("inf")}, "dp_timeout_s must be a positive number of seconds"),
        ({"host_memory": "disk"}, "unknown host_memory 'disk'; choose one of arena, pinned, pageable"),
    ],
)
def test_each_setting_is_checked_by_its_own_declared_rule(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        roundpipe.RunConfig(**kwargs)


def test_lists_become_tuples_and_an_infinite_watchdog_is_allowed():
    config = roundpipe.RunConfig(partition=[2, 2], backward_partition=[1, 1, 1, 1], watchdog_s=float("inf"))
    assert config.partition == (2, 2) and config.backward_partition == (1, 1, 1, 1)


def test_the_guides_settings_table_is_generated_from_the_declarations():
    """docs/guide.md lists every run setting, as ``settings_table`` reads them off ``RunConfig``
    (``scripts/docs_tables.py`` rewrites it)."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    assert settings_table() in guide, "docs/guide.md is stale: run scripts/docs_tables.py"
    assert all(f"| `{f.name}` |" in guide for f in fields(RunConfig))
