"""Read a YAML recipe into a ``TrainConfig``, write one back, and document every key.

A recipe maps one to one onto ``roundpipe.train.config.TrainConfig``: each top-level key is a group
(``model:``, ``run:``, ...), each key under it one field of that group's dataclass. Nothing else is
accepted: an unknown key, a value of the wrong type or a missing required field is a
``RecipeError`` whose message names the dotted key, the file and line (``recipe.yaml:12``) and, for
an unknown key, the nearest valid one. ``--set GROUP.KEY=VALUE`` overrides apply on top of the file
and are checked the same way; their errors name the override instead of a line.

The reference page (``docs/recipes.md``) and the epilog of ``roundpipe train --help`` are generated
here from the fields' ``help`` metadata, so they cannot drift from the dataclasses. Regenerate the
page with ``python -m roundpipe.train.recipe --markdown > docs/recipes.md``.

This module is pure Python plus PyYAML; it must never import torch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from roundpipe.config import RunConfig, recipe_settings
from roundpipe.errors import ConfigError, RecipeError
from roundpipe.train.config import REQUIRED, TrainConfig

__all__ = ["config_from_dict", "dump_recipe", "help_epilog", "load_recipe", "reference_markdown"]

# PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string; a float field accepts it.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
# Deeper values are refused: no field needs them, and the checks and messages recurse into them.
_MAX_DEPTH = 100
# What PyYAML's constructors raise on a tagged value they cannot build (`!!int abc`, `!!int ""`,
# `!!bool abc`, `!!timestamp x`, an int of more than 4300 digits), besides YAMLError.
_CONSTRUCT_ERRORS = (ValueError, TypeError, AttributeError, OverflowError, LookupError)


@dataclass
class _Given:
    """One value a recipe sets, and where it was set (``recipe.yaml:12``, ``--set k=v``, ``<dict>``)."""

    value: Any
    where: str


# ---------------------------------------------------------------------------------------------------
# The schema, read off the dataclasses


@functools.cache
def _groups() -> dict[str, type]:
    """Group name -> its dataclass, in TrainConfig's field order."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


@functools.cache
def _fields(group: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(_groups()[group])}


@functools.cache
def _hints(group: str) -> dict[str, Any]:
    """Field name -> its evaluated annotation (config.py's annotations are strings)."""
    return typing.get_type_hints(_groups()[group])


def _group_help(group: str) -> str:
    return next(f for f in dataclasses.fields(TrainConfig) if f.name == group).metadata["help"]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is REQUIRED


# ---------------------------------------------------------------------------------------------------
# Types: checking a value against an annotation, and naming the annotation


class _Mismatch(Exception):
    """The value does not fit the annotation (internal; turned into a RecipeError by the caller)."""


def _arms(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union annotation (``X | Y`` or ``Optional[X]``), else None."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(tp)
    return None


def _coerce(value: Any, tp: Any) -> Any:
    """Return ``value`` as annotation ``tp`` wants it, or raise ``_Mismatch``.

    bool is not an int; an int (or a YAML 1.1 string such as ``1e-4``) is accepted for a float and
    becomes a float; a tuple is accepted for a list and becomes a list. Union members are tried in
    the order they are written.
    """
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    arms = _arms(tp)
    if arms is not None:
        for arm in arms:
            try:
                return _coerce(value, arm)
            except _Mismatch:
                continue
        raise _Mismatch
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return value
        raise _Mismatch
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item = args[0] if args else Any
        return [_coerce(v, item) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _Mismatch
        return dict(value)
    raise TypeError(f"recipe.py cannot check the annotation {tp!r}; teach _coerce about it")


def _type_text(tp: Any) -> str:
    """A short name of an annotation for messages and docs: ``int or null``, ``fp32 | bf16``."""
    names = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", Any: "any"}
    if tp in names:
        return names[tp]
    arms = _arms(tp)
    if arms is not None:
        return " or ".join(_type_text(a) for a in arms)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        return f"list[{_type_text(args[0]) if args else 'any'}]"
    if origin is dict or tp is dict:
        return "dict"
    return getattr(tp, "__name__", str(tp))


def _value_text(value: Any, limit: int = 60) -> str:
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
        text = _joined("[", (_value_text(v, limit) for v in value), "]", limit)
    elif isinstance(value, Mapping):
        text = _joined("{", (f"{k}: {_value_text(v, limit)}" for k, v in value.items()), "}", limit)
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


def _kind(value: Any) -> str:
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


def _unknown_group(name: Any, where: str) -> RecipeError:
    groups = list(_groups())
    near = difflib.get_close_matches(str(name), groups, n=1)
    if near:
        hint = f"did you mean {near[0]}?"
    else:
        homes = [f"{g}.{name}" for g in groups if name in _fields(g)]
        if homes:
            hint = f"keys go under their group: did you mean {' or '.join(homes)}?"
        else:
            hint = "the top-level keys are the groups " + ", ".join(groups)
    return RecipeError(f"{where}: unknown key {name}; {hint}")


def _unknown_field(group: str, name: Any, where: str) -> RecipeError:
    name = str(name)
    near = difflib.get_close_matches(name, list(_fields(group)), n=1)
    if near:
        hint = f"did you mean {group}.{near[0]}?"
    else:
        others = [g for g in _groups() if g != group]
        homes = [f"{g}.{name}" for g in others if name in _fields(g)]
        if not homes:
            homes = [
                f"{g}.{m}" for g in others for m in difflib.get_close_matches(name, list(_fields(g)), n=1)
            ]
        if homes:
            hint = f"did you mean {' or '.join(homes)}?"
        else:
            hint = f"{group} takes " + ", ".join(_fields(group))
    return RecipeError(f"{where}: unknown key {group}.{name}; {hint}")


# ---------------------------------------------------------------------------------------------------
# Reading: YAML nodes (with lines), plain dicts and --set overrides, all into {group: {key: _Given}}


def _read_yaml(path: Path) -> dict[str, dict[str, _Given]]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM from Windows editors is not a key
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read the recipe {path}: {exc}") from None
    try:
        loader = yaml.SafeLoader(text)  # refuses control characters before it parses anything
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise RecipeError(
            f"{path}:{line}: invalid YAML: unacceptable character #x{exc.character:04x} (control "
            f"characters are not allowed); delete it, or write it as an escape in a double-quoted string"
        ) from None
    try:
        return _read_root(loader, path)
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_problem(exc, str(path))) from None
    except RecursionError:
        raise RecipeError(
            f"{path}: invalid YAML: nested too deeply for the parser; no recipe key takes a value "
            f"nested more than {_MAX_DEPTH} levels"
        ) from None
    finally:
        loader.dispose()


def _construct(loader: yaml.SafeLoader, node: yaml.Node, where: str) -> Any:
    """The Python value of ``node``; RecipeError where PyYAML's constructor fails with a bare
    exception (a tag it cannot apply: ``!!int abc``, ``!!timestamp 2020-13-01``)."""
    try:
        return loader.construct_document(node)
    except _CONSTRUCT_ERRORS as exc:
        shown = ""
        if isinstance(node, yaml.ScalarNode):
            text = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            shown = f" {node.tag.rsplit(':', 1)[-1]} {text!r}"
        raise RecipeError(
            f"{where}: invalid YAML: cannot read the value{shown} ({exc}); fix the value or drop its !!tag"
        ) from None


def _yaml_problem(exc: yaml.YAMLError, source: str) -> str:
    """``FILE:LINE: invalid YAML: ...`` from PyYAML's error (line and column are 0-based there)."""
    mark = getattr(exc, "problem_mark", None)
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None and context_mark is None:
        return f"{source}: invalid YAML: {problem}"
    line = f"{source}:{(mark or context_mark).line + 1}: invalid YAML: {problem}"
    if mark is not None:
        line += f" (column {mark.column + 1})"
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        line += f"; {context} that starts at line {context_mark.line + 1}"
    return line


def _read_root(loader: yaml.SafeLoader, path: Path) -> dict[str, dict[str, _Given]]:
    def at(node: yaml.Node) -> str:
        return f"{path}:{node.start_mark.line + 1}"

    def items(node: yaml.MappingNode, what: str):
        """(key, key node, value node) of a mapping; keys must be unique strings."""
        own = {id(k) for k, _ in node.value}  # keys written here, not merged in by `<<: *anchor`
        loader.flatten_mapping(node)  # merged keys come first, so the ones written here win
        seen: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = (
                _construct(loader, key_node, at(key_node)) if isinstance(key_node, yaml.ScalarNode) else None
            )
            if not isinstance(key, str):
                raise RecipeError(f"{at(key_node)}: the keys of {what} must be names, got {key_node.value!r}")
            if key in seen and id(key_node) in own and id(seen[key]) in own:
                first = seen[key].start_mark.line + 1
                dotted = key if what == "a recipe" else f"{what}.{key}"
                raise RecipeError(f"{at(key_node)}: {dotted} is given twice (first at line {first})")
            seen[key] = key_node
            yield key, key_node, value_node

    try:
        root = loader.get_single_node()
    except _CONSTRUCT_ERRORS as exc:  # the scanner's own int(): `%YAML 1.<5000 digits>`
        raise RecipeError(
            f"{path}:{loader.get_mark().line + 1}: invalid YAML: {exc}; fix or delete what is there"
        ) from None
    if root is None:
        raise RecipeError(f"{path}: the recipe is empty; it needs at least data.train and model.path")
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{at(root)}: a recipe is a mapping of groups (model:, data:, run:, ...)")
    given: dict[str, dict[str, _Given]] = {}
    for group, key_node, group_node in items(root, "a recipe"):
        if group not in _groups():
            raise _unknown_group(group, at(key_node))
        given[group] = {}
        if isinstance(group_node, yaml.ScalarNode) and group_node.tag == "tag:yaml.org,2002:null":
            continue  # `lora:` with every key commented out: the defaults
        if not isinstance(group_node, yaml.MappingNode):
            raise RecipeError(
                f"{at(group_node)}: {group} must be a mapping of keys ({', '.join(list(_fields(group))[:3])}, "
                f"...), got {_kind(_construct(loader, group_node, at(group_node)))}"
            )
        for key, key_node, value_node in items(group_node, group):
            if key not in _fields(group):
                raise _unknown_field(group, key, at(key_node))
            given[group][key] = _Given(_construct(loader, value_node, at(value_node)), at(value_node))
    return given


def _read_dict(data: Mapping, source: str) -> dict[str, dict[str, _Given]]:
    if not isinstance(data, Mapping):
        raise RecipeError(f"{source}: a recipe is a mapping of groups, got {_kind(data)}")
    given: dict[str, dict[str, _Given]] = {}
    for group, body in data.items():
        if group not in _groups():
            raise _unknown_group(group, source)
        given[group] = {}
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise RecipeError(f"{source}: {group} must be a mapping of keys, got {_kind(body)}")
        for key, value in body.items():
            if key not in _fields(group):
                raise _unknown_field(group, key, source)
            _check_nesting(_Given(value, source), f"{group}.{key}")  # before deepcopy recurses into it
            given[group][key] = _Given(copy.deepcopy(value), source)
    return given


def _apply_override(given: dict[str, dict[str, _Given]], override: str) -> None:
    """Apply one ``GROUP.KEY=VALUE`` (VALUE read as YAML) to ``given``, in place.

    ``GROUP.KEY.SUB=VALUE`` sets one entry of a dict field (``run.options.head_shards=4``,
    ``model.config.num_hidden_layers=2``), keeping the recipe's other entries.
    """
    where = f"--set {override}"
    name, eq, text = override.partition("=")
    parts = name.strip().split(".")
    if not eq or len(parts) < 2 or not all(parts):
        raise RecipeError(f"{where}: an override is GROUP.KEY=VALUE, e.g. run.max_steps=10")
    group, key, sub = parts[0], parts[1], parts[2:]
    if group not in _groups():
        raise _unknown_group(group, where)
    if key not in _fields(group):
        raise _unknown_field(group, key, where)
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, *_CONSTRUCT_ERRORS) as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{where}: the value is not valid YAML: {problem}") from None
    except RecursionError:
        raise RecipeError(
            f"{where}: the value is nested too deeply; no key takes a value nested more than "
            f"{_MAX_DEPTH} levels"
        ) from None
    if sub:
        old = given.get(group, {}).get(key)
        base = old.value if old is not None else _default(_fields(group)[key])
        tp = _hints(group)[key]
        takes_dict = any(typing.get_origin(a) is dict or a is dict for a in (_arms(tp) or (tp,)))
        if base is None and takes_dict:
            base = {}
        if not isinstance(base, dict):
            raise RecipeError(f"{where}: {group}.{key} is not a dict, so it has no key {'.'.join(sub)}")
        value_dict = inner = copy.deepcopy(base)
        for i, part in enumerate(sub[:-1]):
            inner = inner.setdefault(part, {})
            if not isinstance(inner, dict):
                dotted = ".".join([group, key, *sub[: i + 1]])
                raise RecipeError(f"{where}: {dotted} is not a dict, so it has no key {sub[i + 1]}")
        inner[sub[-1]] = value
        value = value_dict
    given.setdefault(group, {})[key] = _Given(value, where)


def _build(given: dict[str, dict[str, _Given]], source: str) -> TrainConfig:
    """Type-check every given value, fill defaults, refuse missing required keys, run ``check()``."""
    groups = {}
    for group, cls in _groups().items():
        values = {}
        for key, f in _fields(group).items():
            g = given.get(group, {}).get(key)
            if g is None:
                if _is_required(f):
                    raise RecipeError(f"{source}: {group}.{key} is required: {f.metadata['help']}")
                continue
            tp = _hints(group)[key]
            _check_nesting(g, f"{group}.{key}")
            try:
                values[key] = _coerce(g.value, tp)
            except _Mismatch:
                raise _type_error(f"{group}.{key}", tp, g) from None
            _check_number(values[key], f"{group}.{key}", g)
            if group == "run":
                _check_run_setting(key, values[key], g)
        groups[group] = cls(**values)
    options = given.get("run", {}).get("options")
    if options is not None:
        _check_run_options(groups["run"].options, options.where)
    cfg = TrainConfig(**groups)
    try:
        cfg.check()
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None
    return cfg


def _check_nesting(given: _Given, dotted: str) -> None:
    """Refuse a value that contains itself (a YAML alias inside its own anchor, ``&a [*a]``) or
    nests more than ``_MAX_DEPTH`` lists and mappings deep: the type checks, the messages and
    ``copy.deepcopy`` would recurse into either without end. Each container is visited once, so a
    value that shares its parts many times over (aliases of aliases) costs what its text does."""
    height: dict[int, int] = {}  # id of a finished container -> lists and mappings deep, itself included
    keep = []  # the containers whose ids are in `height`, kept alive so that no id is reused
    open_ids: set[int] = set()  # containers on the current path
    stack: list[tuple[Any, bool]] = [(given.value, False)]
    while stack:
        value, leaving = stack.pop()
        if not isinstance(value, (list, tuple, Mapping)) or (not leaving and id(value) in height):
            continue
        children = list(value.values()) if isinstance(value, Mapping) else list(value)
        if leaving:
            open_ids.discard(id(value))
            below = [height.get(id(c), 0) for c in children if isinstance(c, (list, tuple, Mapping))]
            height[id(value)] = 1 + max(below, default=0)
            keep.append(value)
            if height[id(value)] > _MAX_DEPTH:
                raise RecipeError(
                    f"{given.where}: {dotted} is nested more than {_MAX_DEPTH} lists or mappings deep; "
                    f"no key takes such a value"
                )
            continue
        if id(value) in open_ids:
            raise RecipeError(
                f"{given.where}: {dotted} contains itself (an alias *name inside the anchor &name it "
                f"refers to); write the value out instead"
            )
        open_ids.add(id(value))
        stack.append((value, True))
        stack.extend((c, False) for c in children)


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


def _check_run_setting(key: str, value: Any, given: _Given) -> None:
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


def _check_number(value: Any, dotted: str, given: _Given) -> None:
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


def _type_error(dotted: str, tp: Any, given: _Given) -> RecipeError:
    shown = json.dumps(given.value) if isinstance(given.value, str) else _value_text(given.value)
    got = f"{_kind(given.value)} {shown if len(shown) <= 60 else shown[:57] + '...'}"
    if typing.get_origin(tp) is Literal:
        choices = [str(c) for c in typing.get_args(tp)]
        near = difflib.get_close_matches(str(given.value), choices, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        return RecipeError(f"{given.where}: {dotted} must be one of {', '.join(choices)}; got {got}{hint}")
    return RecipeError(f"{given.where}: {dotted} must be {_type_text(tp)}; got {got}")


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
    given = _read_yaml(path)
    for override in overrides:
        _apply_override(given, override)
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
    return _build(_read_dict(data, source), source)


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
    data = {group: dataclasses.asdict(getattr(cfg, group)) for group in _groups()}
    try:
        body = yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, allow_unicode=True, width=100)
    except yaml.representer.RepresenterError as exc:
        raise RecipeError(f"cannot write the config as YAML: {exc}") from None
    return f"# The resolved config of this run; `roundpipe train` reads it back.\n{body}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """docs/recipes.md: every recipe key with its type, default and help, one table per group.

    Generated from the dataclasses in ``roundpipe.train.config`` (whose ``run:`` settings are read
    off ``roundpipe.config.RunConfig``); a test keeps the checked-in page equal to this text. The
    text ends with one newline.
    """
    lines = [
        "# Recipe reference",
        "",
        "<!-- Generated from roundpipe/train/config.py and, for the run settings, roundpipe/config.py;",
        "     do not edit. Regenerate with",
        "     .venv/bin/python -m roundpipe.train.recipe --markdown > docs/recipes.md -->",
        "",
        "`roundpipe train RECIPE.yaml` reads a YAML recipe whose top-level keys are the groups below",
        "and whose keys under each group are that group's fields. An unknown key, a value of the",
        "wrong type and a missing required key are errors that name the file and line. Override any",
        "key from the command line with `--set GROUP.KEY=VALUE`, the value read as YAML",
        "(`--set run.max_steps=10`, `--set lora.target_modules=[q_proj,v_proj]`); `--set",
        "run.options.head_shards=4` sets one entry of a dict. Types: `int`; `float` (an int is",
        "accepted); `str`; `bool` (`true` / `false`); `null`; `list[...]`; `dict` (a mapping).",
        "",
        "```yaml",
        "model:",
        "  path: /models/Qwen3-0.6B",
        "lora:",
        "  enabled: true",
        "data:",
        "  train: data/train.jsonl",
        "run:",
        "  max_steps: 100",
        "```",
    ]
    for group in _groups():
        lines += ["", f"## {group}", "", _group_help(group), "", "| key | type | default | description |"]
        lines += ["| --- | --- | --- | --- |"]
        for key, f in _fields(group).items():
            default = (
                "**required**" if _is_required(f) else f"`{_cell(_value_text(_default(f), limit=10**9))}`"
            )
            lines.append(
                f"| `{key}` | {_cell(_type_text(_hints(group)[key]))} | {default} | {_cell(f.metadata['help'])} |"
            )
    return "\n".join(lines) + "\n"


def help_epilog() -> str:
    """Plain text for the epilog of ``roundpipe train --help``: every ``group.key (type, default): help``.

    Lines are pre-wrapped at 100 columns, so the parser must keep them as they are
    (``argparse.RawDescriptionHelpFormatter``).
    """
    out = ["recipe keys (docs/recipes.md has the same list; override any with --set GROUP.KEY=VALUE):"]
    for group in _groups():
        out += ["", f"{group}: {_group_help(group)}"]
        for key, f in _fields(group).items():
            default = "required" if _is_required(f) else f"default {_value_text(_default(f), limit=40)}"
            head = f"{group}.{key} ({_type_text(_hints(group)[key])}, {default}): "
            out.append(
                textwrap.fill(
                    head + f.metadata["help"],
                    width=100,
                    initial_indent="  ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                )
            )
    return "\n".join(out) + "\n"


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
