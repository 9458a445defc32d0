"""A recipe's sources read into ``{group: {key: Given}}``: each value with where it was given.

``read_yaml`` reads a YAML file node by node, so each value keeps its ``FILE:LINE`` and a key
given twice, a tag PyYAML cannot apply or a control character is an error naming the line;
``read_dict`` takes nested plain values (``config_from_dict``); ``apply_override`` applies one
``--set GROUP.KEY[.SUB]=VALUE``. Unknown groups and keys are refused here, as they are read;
the type checks come after, in ``recipe.py``. ``check_nesting`` refuses values that contain
themselves or nest deeper than ``MAX_DEPTH``, before anything recurses into them.

Pure Python plus PyYAML; never imports torch.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from roundpipe.errors import RecipeError
from roundpipe.train.recipe_schema import (
    field_default,
    field_hints,
    group_fields,
    group_types,
    union_arms,
    unknown_field,
    unknown_group,
    yaml_kind,
)

# Deeper values are refused: no field needs them, and the checks and messages recurse into them.
MAX_DEPTH = 100
# What PyYAML's constructors raise on a tagged value they cannot build (`!!int abc`, `!!int ""`,
# `!!bool abc`, `!!timestamp x`, an int of more than 4300 digits), besides YAMLError.
CONSTRUCT_ERRORS = (ValueError, TypeError, AttributeError, OverflowError, LookupError)


@dataclass
class Given:
    """One value a recipe sets, and where it was set (``recipe.yaml:12``, ``--set k=v``, ``<dict>``)."""

    value: Any
    where: str


def read_yaml(path: Path) -> dict[str, dict[str, Given]]:
    """A recipe file's values, each with its ``FILE:LINE``; RecipeError for a file that is missing,
    unreadable or not valid YAML, and for unknown or repeated keys."""
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
            f"nested more than {MAX_DEPTH} levels"
        ) from None
    finally:
        loader.dispose()


def _construct(loader: yaml.SafeLoader, node: yaml.Node, where: str) -> Any:
    """The Python value of ``node``; RecipeError where PyYAML's constructor fails with a bare
    exception (a tag it cannot apply: ``!!int abc``, ``!!timestamp 2020-13-01``)."""
    try:
        return loader.construct_document(node)
    except CONSTRUCT_ERRORS as exc:
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


def _read_root(loader: yaml.SafeLoader, path: Path) -> dict[str, dict[str, Given]]:
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
    except CONSTRUCT_ERRORS as exc:  # the scanner's own int(): `%YAML 1.<5000 digits>`
        raise RecipeError(
            f"{path}:{loader.get_mark().line + 1}: invalid YAML: {exc}; fix or delete what is there"
        ) from None
    if root is None:
        raise RecipeError(f"{path}: the recipe is empty; it needs at least data.train and model.path")
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{at(root)}: a recipe is a mapping of groups (model:, data:, run:, ...)")
    given: dict[str, dict[str, Given]] = {}
    for group, key_node, group_node in items(root, "a recipe"):
        if group not in group_types():
            raise unknown_group(group, at(key_node))
        given[group] = {}
        if isinstance(group_node, yaml.ScalarNode) and group_node.tag == "tag:yaml.org,2002:null":
            continue  # `lora:` with every key commented out: the defaults
        if not isinstance(group_node, yaml.MappingNode):
            raise RecipeError(
                f"{at(group_node)}: {group} must be a mapping of keys ({', '.join(list(group_fields(group))[:3])}, "
                f"...), got {yaml_kind(_construct(loader, group_node, at(group_node)))}"
            )
        for key, key_node, value_node in items(group_node, group):
            if key not in group_fields(group):
                raise unknown_field(group, key, at(key_node))
            given[group][key] = Given(_construct(loader, value_node, at(value_node)), at(value_node))
    return given


def read_dict(data: Mapping, source: str) -> dict[str, dict[str, Given]]:
    """Nested plain values (``config_from_dict``), copied, each given at ``source``; RecipeError for
    unknown keys and for values that contain themselves or nest too deep."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"{source}: a recipe is a mapping of groups, got {yaml_kind(data)}")
    given: dict[str, dict[str, Given]] = {}
    for group, body in data.items():
        if group not in group_types():
            raise unknown_group(group, source)
        given[group] = {}
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise RecipeError(f"{source}: {group} must be a mapping of keys, got {yaml_kind(body)}")
        for key, value in body.items():
            if key not in group_fields(group):
                raise unknown_field(group, key, source)
            check_nesting(Given(value, source), f"{group}.{key}")  # before deepcopy recurses into it
            given[group][key] = Given(copy.deepcopy(value), source)
    return given


def apply_override(given: dict[str, dict[str, Given]], override: str) -> None:
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
    if group not in group_types():
        raise unknown_group(group, where)
    if key not in group_fields(group):
        raise unknown_field(group, key, where)
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, *CONSTRUCT_ERRORS) as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{where}: the value is not valid YAML: {problem}") from None
    except RecursionError:
        raise RecipeError(
            f"{where}: the value is nested too deeply; no key takes a value nested more than "
            f"{MAX_DEPTH} levels"
        ) from None
    if sub:
        old = given.get(group, {}).get(key)
        base = old.value if old is not None else field_default(group_fields(group)[key])
        tp = field_hints(group)[key]
        takes_dict = any(typing.get_origin(a) is dict or a is dict for a in (union_arms(tp) or (tp,)))
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
    given.setdefault(group, {})[key] = Given(value, where)


def check_nesting(given: Given, dotted: str) -> None:
    """Refuse a value that contains itself (a YAML alias inside its own anchor, ``&a [*a]``) or
    nests more than ``MAX_DEPTH`` lists and mappings deep: the type checks, the messages and
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
            if height[id(value)] > MAX_DEPTH:
                raise RecipeError(
                    f"{given.where}: {dotted} is nested more than {MAX_DEPTH} lists or mappings deep; "
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
