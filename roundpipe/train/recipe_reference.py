"""The recipe reference, generated from the dataclasses so it cannot drift from them:
``reference_markdown`` is ``docs/recipes.md`` (``python -m roundpipe.train.recipe --markdown``
prints it), ``help_epilog`` the key list at the end of ``roundpipe train --help``.

Pure Python plus PyYAML; never imports torch.
"""

from __future__ import annotations

import textwrap

from roundpipe.train.recipe_schema import (
    field_default,
    field_hints,
    group_fields,
    group_help,
    group_types,
    is_required,
    type_text,
    value_text,
)


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
        "wrong type or out of its range (a negative `optim.lr`, a share outside [0, 1)), a missing",
        "required key and an optional package a key asks for but is not installed are errors that",
        "name the key, the file and line; the whole recipe is checked before any data or model is",
        "read. Override any",
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
    for group in group_types():
        lines += ["", f"## {group}", "", group_help(group), "", "| key | type | default | description |"]
        lines += ["| --- | --- | --- | --- |"]
        for key, f in group_fields(group).items():
            default = (
                "**required**" if is_required(f) else f"`{_cell(value_text(field_default(f), limit=10**9))}`"
            )
            lines.append(
                f"| `{key}` | {_cell(type_text(field_hints(group)[key]))} | {default} | {_cell(f.metadata['help'])} |"
            )
    return "\n".join(lines) + "\n"


def help_epilog() -> str:
    """Plain text for the epilog of ``roundpipe train --help``: every ``group.key (type, default): help``.

    Lines are pre-wrapped at 100 columns, so the parser must keep them as they are
    (``argparse.RawDescriptionHelpFormatter``).
    """
    out = ["recipe keys (docs/recipes.md has the same list; override any with --set GROUP.KEY=VALUE):"]
    for group in group_types():
        out += ["", f"{group}: {group_help(group)}"]
        for key, f in group_fields(group).items():
            default = "required" if is_required(f) else f"default {value_text(field_default(f), limit=40)}"
            head = f"{group}.{key} ({type_text(field_hints(group)[key])}, {default}): "
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
