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
    lines += comparison_markdown()
    return "\n".join(lines) + "\n"


# The same setting under axolotl's and LLaMA-Factory's documented config keys ("—": none), for
# readers coming from them; only keys roundpipe has (``comparison_markdown`` refuses any other).
ELSEWHERE: tuple[tuple[str, str, str], ...] = (
    ("model.path", "`base_model`", "`model_name_or_path`"),
    ("model.trust_remote_code", "`trust_remote_code`", "`trust_remote_code`"),
    ("lora.enabled", "`adapter: lora`", "`finetuning_type: lora`"),
    ("lora.rank", "`lora_r`", "`lora_rank`"),
    ("lora.alpha", "`lora_alpha`", "`lora_alpha`"),
    ("lora.dropout", "`lora_dropout`", "`lora_dropout`"),
    ("lora.target_modules", "`lora_target_modules` (`lora_target_linear: true`)", "`lora_target` (`all`)"),
    ("data.train", "`datasets[].path`", "`dataset` (names in `dataset_info.json`)"),
    ("data.format", "`datasets[].type` (`alpaca`, `chat_template`, `completion`)", "the dataset's `formatting` (`alpaca`, `sharegpt`)"),
    ("data.eval", "`test_datasets`", "`eval_dataset`"),
    ("data.eval_fraction", "`val_set_size`", "`val_size`"),
    ("data.max_length", "`sequence_len`", "`cutoff_len`"),
    ("data.packing", "`sample_packing`", "`packing`"),
    ("data.train_on_prompt", "`train_on_inputs`", "`train_on_prompt`"),
    ("run.output_dir", "`output_dir`", "`output_dir`"),
    ("run.seed", "`seed`", "`seed`"),
    ("run.dtype", "`bf16: true` / `fp16: true`", "`bf16: true` / `fp16: true`"),
    ("run.batch_size", "`micro_batch_size`", "`per_device_train_batch_size`"),
    ("run.grad_accum", "`gradient_accumulation_steps`", "`gradient_accumulation_steps`"),
    ("run.epochs", "`num_epochs`", "`num_train_epochs`"),
    ("run.max_steps", "`max_steps`", "`max_steps`"),
    ("optim.lr", "`learning_rate`", "`learning_rate`"),
    ("optim.weight_decay", "`weight_decay`", "`weight_decay`"),
    ("optim.max_grad_norm", "`max_grad_norm`", "`max_grad_norm`"),
    ("schedule.kind", "`lr_scheduler`", "`lr_scheduler_type`"),
    ("schedule.warmup_steps", "`warmup_steps`", "`warmup_steps`"),
    ("eval.every", "`eval_steps`", "`eval_steps`"),
    ("checkpoint.every", "`save_steps`", "`save_steps`"),
    ("checkpoint.keep_last", "`save_total_limit`", "`save_total_limit`"),
    ("checkpoint.export", "— (`axolotl merge-lora`)", "— (`llamafactory-cli export`)"),
    ("logging.every", "`logging_steps`", "`logging_steps`"),
    ("logging.tensorboard", "`use_tensorboard`", "`report_to: tensorboard`"),
    ("logging.wandb", "`wandb_project` (set)", "`report_to: wandb`"),
)  # fmt: skip


def comparison_markdown() -> list[str]:
    """The lines of the table of ``ELSEWHERE``; ValueError for a row whose key roundpipe lacks."""
    lines = [
        "",
        "## From axolotl and LLaMA-Factory",
        "",
        "The same setting under their config keys, for recipes written for them (— : no such key;",
        "the meanings match, the defaults may not).",
        "",
        "| roundpipe | axolotl | LLaMA-Factory |",
        "| --- | --- | --- |",
    ]
    for dotted, axolotl, llama_factory in ELSEWHERE:
        group, _, key = dotted.partition(".")
        if group not in group_types() or key not in group_fields(group):
            raise ValueError(f"the comparison table names {dotted}, which is no recipe key")
        lines.append(f"| `{dotted}` | {_cell(axolotl)} | {_cell(llama_factory)} |")
    return lines


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
