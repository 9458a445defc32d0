"""Read a YAML recipe into a ``TrainConfig``, write one back, and document every key.

A recipe maps one to one onto ``roundpipe.train.config.TrainConfig``: each top-level key is a group
(``model:``, ``run:``, ...), each key under it one field of that group's dataclass. Nothing else is
accepted: an unknown key, a value of the wrong type or a missing required field is a
``RecipeError`` whose message names the dotted key, the file and line (``recipe.yaml:12``) and, for
an unknown key, the nearest valid one. ``--set GROUP.KEY=VALUE`` overrides apply on top of the file
and are checked the same way; their errors name the override instead of a line.

Here: the public calls (``load_recipe``, ``config_from_dict``, ``dump_recipe``) and the checks of
every given value. The schema and the type checks live in ``recipe_schema.py``, the reading of a
file, a dict and the overrides in ``recipe_reading.py``. The reference page (``docs/recipes.md``)
and the epilog of ``roundpipe train --help`` are generated in ``recipe_reference.py`` from the
fields' ``help`` metadata, so they cannot drift from the dataclasses. Regenerate the page with
``python -m roundpipe.train.recipe --markdown > docs/recipes.md``.

This module is pure Python plus PyYAML; it must never import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from roundpipe.config import RunConfig, recipe_settings
from roundpipe.errors import ConfigError, RecipeError
from roundpipe.train.config import TrainConfig
from roundpipe.train.recipe_reading import Given, apply_override, check_nesting, read_dict, read_yaml
from roundpipe.train.recipe_reference import reference_markdown
from roundpipe.train.recipe_schema import (
    Mismatch,
    coerce,
    field_hints,
    group_fields,
    group_types,
    is_required,
    type_text,
    value_text,
    yaml_kind,
)

__all__ = ["config_from_dict", "dump_recipe", "load_recipe"]


def _build(given: dict[str, dict[str, Given]], source: str) -> TrainConfig:
    """Type-check every given value, fill defaults, refuse missing required keys, run ``check()``."""
    groups = {}
    for group, cls in group_types().items():
        values = {}
        for key, f in group_fields(group).items():
            g = given.get(group, {}).get(key)
            if g is None:
                if is_required(f):
                    raise RecipeError(f"{source}: {group}.{key} is required: {f.metadata['help']}")
                continue
            tp = field_hints(group)[key]
            check_nesting(g, f"{group}.{key}")
            try:
                values[key] = coerce(g.value, tp)
            except Mismatch:
                raise _type_error(f"{group}.{key}", tp, g) from None
            _check_number(values[key], f"{group}.{key}", g)
            _check_key(f, values[key], f"{group}.{key}", g)
            if group == "run":
                _check_run_setting(key, values[key], g)
        groups[group] = cls(**values)
    options = given.get("run", {}).get("options")
    if options is not None:
        _check_run_options(groups["run"].options, options.where)
    cfg = TrainConfig(**groups)
    try:
        cfg.check()
    except RecipeError as exc:  # a rule between keys: the line of the key to change, where given
        group, _, key = getattr(exc, "key", "").partition(".")
        at = given.get(group, {}).get(key)
        raise RecipeError(f"{at.where if at is not None else source}: {exc}") from None
    return cfg


def _check_key(f: dataclasses.Field, value: Any, dotted: str, given: Given) -> None:
    """The key's own rule (``config.py`` declares it beside the key), refused naming where it was given."""
    check = f.metadata.get("check")
    if check is None:
        return
    try:
        check(dotted, value)
    except RecipeError as exc:
        raise RecipeError(f"{given.where}: {exc}") from None


def _check_run_options(options: dict[str, Any], where: str) -> None:
    """run.options names RunConfig fields, other than those ``run:`` has keys of its own for."""
    own = {f.name for f in recipe_settings()}
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name not in own]
    for key in options:
        if key in own:
            raise RecipeError(f"{where}: run.options.{key} is set by run.{key}; set that instead")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = (
                f"did you mean run.options.{near[0]}?" if near else "run.options takes " + ", ".join(fields)
            )
            raise RecipeError(f"{where}: unknown key run.options.{key} (not a RunConfig field); {hint}")


def _check_run_setting(key: str, value: Any, given: Given) -> None:
    """A ``run:`` key that sets a RunConfig setting passes that setting's own check, as
    ``RunConfig`` declares it, and a refusal names where the value was given."""
    check = {f.name: f.metadata["check"] for f in recipe_settings()}.get(key)
    if check is None:
        return
    try:
        check(key, value)
    except ConfigError as exc:
        message = str(exc)
        message = f"run.{message}" if message.startswith(f"{key} ") else f"run.{key}: {message}"
        raise RecipeError(f"{given.where}: {message}") from None


def _check_number(value: Any, dotted: str, given: Given) -> None:
    """Refuse NaN in a float field (no setting means "not a number"), and an infinite run.epochs
    (a run of endless steps)."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, float) and math.isnan(v):
            raise RecipeError(f"{given.where}: {dotted} must be a number, got nan")
    if dotted == "run.epochs" and math.isinf(value):
        raise RecipeError(
            f"{given.where}: run.epochs must be finite, got {value}; set run.max_steps for a run of a "
            f"fixed number of steps"
        )


def _type_error(dotted: str, tp: Any, given: Given) -> RecipeError:
    shown = json.dumps(given.value) if isinstance(given.value, str) else value_text(given.value)
    got = f"{yaml_kind(given.value)} {shown if len(shown) <= 60 else shown[:57] + '...'}"
    if typing.get_origin(tp) is Literal:
        choices = [str(c) for c in typing.get_args(tp)]
        near = difflib.get_close_matches(str(given.value), choices, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        return RecipeError(f"{given.where}: {dotted} must be one of {', '.join(choices)}; got {got}{hint}")
    return RecipeError(f"{given.where}: {dotted} must be {type_text(tp)}; got {got}")


# ---------------------------------------------------------------------------------------------------
# Public API


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML recipe, apply ``--set`` overrides, check everything, and return the config.

    Args:
        path: the recipe file. Its top-level keys are TrainConfig's groups and the keys under each
            group that group's fields (docs/recipes.md lists them). A group written with no keys
            (``lora:`` followed only by comments) keeps its defaults.
        overrides: ``GROUP.KEY=VALUE`` strings applied in order after the file, each VALUE read as
            YAML (``run.max_steps=10``, ``lora.target_modules=[q_proj,v_proj]``,
            ``model.path=/x``). ``GROUP.KEY.SUB=VALUE`` sets one entry of a dict field
            (``run.options.head_shards=4``).

    Returns:
        The resolved TrainConfig: defaults filled in, ints given for float fields turned into floats,
        ``TrainConfig.check()`` passed.

    Raises:
        RecipeError: the file is missing, empty or not valid YAML; a key is unknown (the message
            suggests the nearest valid one); a value has the wrong type or is not one of a
            field's choices; a required key is missing; or a cross-field rule fails. The message
            starts with ``FILE:LINE`` for what the file says, ``--set OVERRIDE`` for an override,
            and ``FILE`` for what the file lacks.
    """
    path = Path(path)
    given = read_yaml(path)
    for override in overrides:
        apply_override(given, override)
    return _build(given, str(path))


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> TrainConfig:
    """Build a TrainConfig from nested plain values (``{"run": {"max_steps": 10}, ...}``).

    The same checks as ``load_recipe``, for Python callers; values are copied, so later changes to
    ``data`` do not reach the config.

    Args:
        data: group name -> mapping of field name -> value (None for a group keeps its defaults).
        source: what the messages name as the origin of the values.

    Raises:
        RecipeError: as ``load_recipe``, with ``source`` in place of the file and line.
    """
    return _build(read_dict(data, source), source)


class _RecipeDumper(yaml.SafeDumper):
    """Writes multi-line strings (the prompt templates) as ``|`` blocks, the way people write them."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RecipeDumper.add_representer(str, _represent_str)


def dump_recipe(cfg: TrainConfig) -> str:
    """The resolved config as a YAML recipe: every group and every key, in the dataclasses' order.

    Written beside checkpoints so a run can be read back and repeated: ``load_recipe`` of the text
    (or ``config_from_dict(yaml.safe_load(text))``) gives a TrainConfig equal to ``cfg``.

    Raises:
        RecipeError: a value that YAML cannot hold (e.g. an object in ``run.options``).
    """
    data = {group: dataclasses.asdict(getattr(cfg, group)) for group in group_types()}
    try:
        body = yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, allow_unicode=True, width=100)
        # PyYAML writes some line-break characters (U+0085, U+2028, U+2029) raw into a quoted
        # scalar, where they read back as a space: such a text is written with escapes instead.
        if repr(yaml.safe_load(body)) != repr(data):
            body = yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, allow_unicode=False, width=100)
    except yaml.representer.RepresenterError as exc:
        raise RecipeError(f"cannot write the config as YAML: {exc}") from None
    return f"# The resolved config of this run; `roundpipe train` reads it back.\n{body}"


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m roundpipe.train.recipe", description="Print the recipe reference."
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/recipes.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_usage(sys.stderr)
        return 2
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(_main())
