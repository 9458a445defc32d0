"""Recipe files written by tests, and the error a recipe's loading raises."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from roundpipe.errors import RecipeError
from roundpipe.train.recipe import load_recipe


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    """``text`` (dedented) as ``tmp_path / name``."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> str:
    """The message of the RecipeError loading ``path`` with ``overrides`` raises (fails if none)."""
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return str(info.value)
