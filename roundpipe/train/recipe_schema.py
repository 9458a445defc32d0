"""A recipe's schema, read off the ``TrainConfig`` dataclasses: its groups and keys, the check of a
value against a key's annotation, and the names of types and values that messages and the
reference docs print.

``group_types`` / ``group_fields`` / ``field_hints`` are the schema (group -> dataclass, group ->
its fields, field -> its evaluated annotation); ``coerce`` checks a value against an annotation
(``Mismatch`` when it does not fit); ``type_text``, ``value_text`` and ``yaml_kind`` name an
annotation, a value and a value's type the way YAML writes them; ``unknown_group`` and
``unknown_field`` are the errors for a key the schema lacks, naming the nearest valid one.

Pure Python plus PyYAML; never imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from roundpipe.errors import RecipeError
from roundpipe.train.config import REQUIRED, TrainConfig

# PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string; a float field accepts it.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


# ---------------------------------------------------------------------------------------------------
# The schema, read off the dataclasses


@functools.cache
def group_types() -> dict[str, type]:
    """Group name -> its dataclass, in TrainConfig's field order."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


@functools.cache
def group_fields(group: str) -> dict[str, dataclasses.Field]:
    """Field name -> its dataclass field, for one group, in declaration order."""
    return {f.name: f for f in dataclasses.fields(group_types()[group])}


@functools.cache
def field_hints(group: str) -> dict[str, Any]:
    """Field name -> its evaluated annotation (config.py's annotations are strings)."""
    return typing.get_type_hints(group_types()[group])


def group_help(group: str) -> str:
    """The help text of a group (its ``TrainConfig`` field's metadata)."""
    return next(f for f in dataclasses.fields(TrainConfig) if f.name == group).metadata["help"]


def field_default(f: dataclasses.Field) -> Any:
    """The value a field takes when the recipe does not set it (a fresh one for a factory)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def is_required(f: dataclasses.Field) -> bool:
    """Whether a recipe must set this field (its default is ``REQUIRED``)."""
    return f.default is REQUIRED


# ---------------------------------------------------------------------------------------------------
# Types: checking a value against an annotation, and naming the annotation


class Mismatch(Exception):
    """The value does not fit the annotation (internal; turned into a RecipeError by the caller)."""


def union_arms(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union annotation (``X | Y`` or ``Optional[X]``), else None."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(tp)
    return None


def coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as annotation ``tp`` wants it, or raise ``Mismatch``.

    bool is not an int; an int (or a YAML 1.1 string such as ``1e-4``) is accepted for a float and
    becomes a float; a tuple is accepted for a list and becomes a list. Union members are tried in
    the order they are written.
    """
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        raise Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise Mismatch
    arms = union_arms(tp)
    if arms is not None:
        for arm in arms:
            try:
                return coerce(value, arm)
            except Mismatch:
                continue
        raise Mismatch
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return value
        raise Mismatch
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise Mismatch
        item = args[0] if args else Any
        return [coerce(v, item) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise Mismatch
        return dict(value)
    raise TypeError(f"recipe_schema.py cannot check the annotation {tp!r}; teach coerce about it")


def type_text(tp: Any) -> str:
    """A short name of an annotation for messages and docs: ``int or null``, ``fp32 | bf16``."""
    names = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", Any: "any"}
    if tp in names:
        return names[tp]
    arms = union_arms(tp)
    if arms is not None:
        return " or ".join(type_text(a) for a in arms)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        return f"list[{type_text(args[0]) if args else 'any'}]"
    if origin is dict or tp is dict:
        return "dict"
    return getattr(tp, "__name__", str(tp))


def value_text(value: Any, limit: int = 60) -> str:
    """A value as it would be written in YAML, cut to ``limit`` characters."""
    if value is REQUIRED:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = value and "\n" not in value and value == value.strip()
        if plain:
            try:
                plain = yaml.safe_load(value) == value and not value.startswith(("'", '"'))
            except yaml.YAMLError:
                plain = False
        text = value if plain else json.dumps(value)
    elif isinstance(value, (list, tuple)):
        text = _joined("[", (value_text(v, limit) for v in value), "]", limit)
    elif isinstance(value, Mapping):
        text = _joined("{", (f"{k}: {value_text(v, limit)}" for k, v in value.items()), "}", limit)
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _joined(opening: str, parts, closing: str, limit: int) -> str:
    """``opening + ", ".join(parts) + closing``, stopping once it is longer than ``limit`` (the caller
    cuts it there), so that a value sharing its parts many times over (YAML aliases) stays cheap."""
    text = opening
    for i, part in enumerate(parts):
        text += (", " if i else "") + part
        if len(text) > limit:
            return text
    return text + closing


def yaml_kind(value: Any) -> str:
    """The YAML name of a value's type, for 'got ...' in messages."""
    for cls, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if isinstance(value, cls):
            return name
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "dict"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------------
# Unknown keys and their nearest valid neighbours


def unknown_group(name: Any, where: str) -> RecipeError:
    """The error for a top-level key that is no group, naming the nearest group or the group the key
    belongs under."""
    groups = list(group_types())
    near = difflib.get_close_matches(str(name), groups, n=1)
    if near:
        hint = f"did you mean {near[0]}?"
    else:
        homes = [f"{g}.{name}" for g in groups if name in group_fields(g)]
        if homes:
            hint = f"keys go under their group: did you mean {' or '.join(homes)}?"
        else:
            hint = "the top-level keys are the groups " + ", ".join(groups)
    return RecipeError(f"{where}: unknown key {name}; {hint}")


def unknown_field(group: str, name: Any, where: str) -> RecipeError:
    """The error for a key that ``group`` lacks, naming the nearest key of it or of another group."""
    name = str(name)
    near = difflib.get_close_matches(name, list(group_fields(group)), n=1)
    if near:
        hint = f"did you mean {group}.{near[0]}?"
    else:
        others = [g for g in group_types() if g != group]
        homes = [f"{g}.{name}" for g in others if name in group_fields(g)]
        if not homes:
            homes = [
                f"{g}.{m}"
                for g in others
                for m in difflib.get_close_matches(name, list(group_fields(g)), n=1)
            ]
        if homes:
            hint = f"did you mean {' or '.join(homes)}?"
        else:
            hint = f"{group} takes " + ", ".join(group_fields(group))
    return RecipeError(f"{where}: unknown key {group}.{name}; {hint}")
