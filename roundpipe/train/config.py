"""TrainConfig: one training run, as a tree of small dataclasses that a YAML recipe maps onto.

Each group is one key of the recipe (``model:``, ``lora:``, ``data:``, ...), each field one key
under it. A field's ``help`` metadata is its documentation: ``roundpipe train --help`` and
``docs/recipes.md`` are generated from it (``roundpipe.train.recipe``), so the two cannot drift.
Fields whose default is ``REQUIRED`` must be given. A field's ``check`` metadata is its own rule
(a range, an optional package it needs); ``TrainConfig.check`` runs those and the rules between
fields. Loading, type checks and the errors that name the file and line live in
``roundpipe.train.recipe``, which runs each key's rule as it reads the key, so a whole recipe is
checked before anything is loaded. The ``run:`` keys that set a ``roundpipe.RunConfig`` setting (``run.policy``,
``run.dtype``, ...) are not written here: ``RunSection`` reads them off their declarations in
``roundpipe/config.py``, help and check included.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal

from roundpipe.config import recipe_default, recipe_settings, recipe_type
from roundpipe.errors import RecipeError
from roundpipe.train.paths import check_run_paths

REQUIRED: Any = "<required>"  # the default of a field a recipe must set

# A key's own rule: ``check(dotted_key, value)`` raises RecipeError("{dotted_key} must ...").
Check = Callable[[str, Any], None]


def _f(default, help: str, check: Check | None = None, **kw):
    metadata = {"help": help, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


# ---------------------------------------------------------------------------------------------------
# The rules of single keys (the loader runs each where the key is given, naming its line)


def _at_least(low: int, *, null: bool = False) -> Check:
    def check(key: str, value: Any) -> None:
        if value is None and null:
            return
        if value < low:
            raise RecipeError(f"{key} must be at least {low}{' or null' if null else ''}, got {value}")

    return check


def _finite(low: float, *, strict: bool, note: str = "", null: bool = False) -> Check:
    """A finite number > ``low`` (``strict``) or >= it; ``null`` allowed when ``null``; ``note``
    is added to the message (what 0 or null means)."""

    def check(key: str, value: Any) -> None:
        if value is None and null:
            return
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            bound = f"{'>' if strict else '>='} {low:g}"
            raise RecipeError(f"{key} must be a finite number {bound}{note}, got {value}")

    return check


def _share(*, one: bool) -> Check:
    """A number in [0, 1) (or [0, 1] with ``one``)."""

    def check(key: str, value: Any) -> None:
        if not (0.0 <= value <= 1.0 if one else 0.0 <= value < 1.0):
            raise RecipeError(f"{key} must be in [0, 1{']' if one else ')'}, got {value}")

    return check


def _betas(key: str, value: Any) -> None:
    if len(value) != 2 or not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in value):
        raise RecipeError(f"{key} must be two numbers in [0, 1), e.g. [0.9, 0.999], got {value}")


def _two_counts(key: str, value: Any) -> None:
    if len(value) != 2 or not all(c >= 1 for c in value):
        raise RecipeError(f"{key} must be two counts >= 1 [train, eval], got {value}")


def package_installed(name: str) -> bool:
    """Whether the package ``name`` can be imported (found without importing it)."""
    return name in sys.modules or importlib.util.find_spec(name) is not None


def _extra(package: str, extra: str, *, off: str = "auto") -> Check:
    """``true`` needs the optional package (``pip install 'roundpipe[EXTRA]'``); ``off`` is the
    value that does without it (``auto`` uses it when it is there)."""

    def check(key: str, value: Any) -> None:
        if value is True and not package_installed(package):
            raise RecipeError(
                f"{key} is true but {package} is not installed: pip install 'roundpipe[{extra}]', "
                f"or set {key}: {off}"
            )

    return check


def _refuse(key: str, message: str) -> RecipeError:
    """A refusal of a rule between keys; ``key`` is the one to change (the loader names its line)."""
    err = RecipeError(message)
    err.key = key  # type: ignore[attr-defined]
    return err


@dataclass
class ModelConfig:
    path: str | None = _f(
        None,
        "Local Hugging Face model directory (config.json + safetensors shards). The weights are "
        "read straight into roundpipe's parameter store, without a second copy in host RAM.",
    )
    config: dict[str, Any] | None = _f(
        None,
        "Instead of `path`: build a model from config numbers with random weights (demos, tests). "
        "`model_type` names the HF family (e.g. qwen3, llama); the other keys are that config's "
        "fields (hidden_size, num_hidden_layers, ...).",
    )
    tokenizer: str | None = _f(
        None,
        "Tokenizer directory, or `byte` for the built-in byte-level tokenizer (259 ids: 256 bytes, "
        "pad, bos, eos). Default: the model directory's tokenizer; `byte` for a `config:` model.",
    )
    trust_remote_code: bool = _f(
        False, "Run the model directory's own Python code (off unless you trust the directory)."
    )


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "Train LoRA adapters (through peft) instead of every weight.")
    rank: int = _f(16, "LoRA rank r.", _at_least(1))
    alpha: float = _f(32.0, "LoRA alpha (the update is scaled by alpha / rank).", _finite(0, strict=True))
    dropout: float = _f(0.0, "Dropout on the LoRA input.", _share(one=False))
    target_modules: list[str] | str = _f(
        "all-linear", "Module names to adapt (e.g. [q_proj, v_proj]), or `all-linear`."
    )


@dataclass
class DataConfig:
    train: str | list[str | dict[str, Any]] = _f(
        REQUIRED,
        "Training data file (.jsonl, .json, .csv, .parquet or .txt), a dataset directory written by "
        "`save_to_disk`, or a directory of .parquet / .arrow / .jsonl / .json / .csv files. Several "
        "mixed by weight: a list of {path, weight} (or plain paths, weight 1); weight 2 repeats each "
        "sample of that file twice an epoch, 0.5 takes a seeded half of them.",
    )
    eval: str | None = _f(None, "Held-out data (same kinds). Default: split off `eval_fraction`.")
    eval_fraction: float = _f(
        0.0, "Share of the training file held out for evaluation when `eval` is unset.", _share(one=False)
    )
    format: Literal["text", "instruction", "chat", "sharegpt"] = _f(
        "instruction",
        "text: one `text` field per sample; instruction: `instruction` / `input` / `output` "
        "(Alpaca style); chat: `messages`, a list of {role, content} (OpenAI style, tool calls "
        "included), rendered with the tokenizer's chat template; sharegpt: `conversations`, a list "
        "of {from, value} (human, gpt, system, ...), rendered the same way.",
    )
    file_type: Literal["auto", "jsonl", "json", "csv", "parquet", "text"] = _f(
        "auto", "How to read the files; `auto` goes by the extension."
    )
    text_field: str = _f("text", "Field holding the text (format: text).")
    instruction_field: str = _f("instruction", "Field holding the instruction (format: instruction).")
    input_field: str = _f("input", "Field holding the optional input (format: instruction).")
    output_field: str = _f("output", "Field holding the response (format: instruction).")
    chat_template: Literal["chatml", "qwen", "llama3", "mistral", "gemma"] | None = _f(
        None,
        "Chat template by name for a tokenizer without one (a base model's); the tokenizer's own "
        "template is always used when it has one (format: chat, sharegpt).",
    )
    messages_field: str | None = _f(
        None,
        "Field holding the conversation. Default: `messages` (format: chat), `conversations` (format: sharegpt).",
    )
    prompt_template: str = _f(
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Prompt of the instruction format; `{instruction}` and `{input}` are filled in.",
    )
    prompt_template_no_input: str = _f(
        "### Instruction:\n{instruction}\n\n### Response:\n",
        "Prompt of the instruction format for samples with an empty input.",
    )
    train_on_prompt: bool = _f(
        False,
        "Also compute the loss on prompt tokens (default: only on the response, where the format has one).",
    )
    max_length: int = _f(1024, "Longest sample in tokens (after the template).", _at_least(1))
    too_long: Literal["skip", "truncate", "error"] = _f(
        "skip", "What to do with a longer sample: skip it (counted and logged), cut it, or stop."
    )
    on_bad_record: Literal["error", "skip"] = _f(
        "error",
        "A record that cannot be read at all (a JSON Lines line that is not valid JSON or not an "
        "object): stop naming its file:line, or skip it (counted and named in the report).",
    )
    add_eos: bool = _f(True, "End every sample with the tokenizer's end-of-sequence token.")
    packing: bool = _f(False, "Pack samples into rows of `max_length` tokens; attention stays within each.")
    group_by_length: bool = _f(True, "Batch samples of similar length together (less padding).")
    shuffle: bool = _f(True, "Shuffle the training samples every epoch (seeded by `run.seed`).")
    synthetic: str | None = _f(
        None,
        "Generate a built-in task into the `train` and `eval` files first, if they are missing "
        "(demos): `reverse` (reverse a string of letters, instruction format; the eval prompts "
        "never occur in the training file). Both files must lie inside the run directory.",
    )
    synthetic_samples: list[int] = _f(
        [20000, 500], "Training and held-out samples the synthetic task writes.", _two_counts
    )


@dataclass
class _RunLoop:
    """The keys of ``run:`` that belong to the training loop; ``RunSection`` adds the run settings."""

    name: str = _f(
        "run",
        "Name of the run. The default output directory is runs/NAME, so then it must be a plain name "
        "(no `/`, `\\`, `:` or `..`).",
    )
    output_dir: str | None = _f(
        None,
        "Where checkpoints, metrics, plots and exports go. Default: runs/NAME. The run writes nowhere "
        "else: a symlink in it that leads outside is refused.",
    )
    batch_size: int = _f(8, "Sequences per forward/backward (one micro-step).", _at_least(1))
    grad_accum: int = _f(
        1, "Micro-steps per optimizer step (effective batch = batch_size x grad_accum).", _at_least(1)
    )
    max_steps: int | None = _f(
        None, "Optimizer steps to run. Default: `epochs` over the training data.", _at_least(1, null=True)
    )
    epochs: float = _f(
        1.0, "Passes over the training data when `max_steps` is unset.", _finite(0, strict=True)
    )
    host_ram_check: bool = _f(True, "Refuse to start when the run needs more host RAM than is available.")
    options: dict[str, Any] = _f(
        {}, "Further `roundpipe.RunConfig` fields (e.g. {head_shards: 4, partition: [2, 3, 3]})."
    )


def _run_section() -> type:
    """``RunSection``: ``_RunLoop``'s keys with, after ``output_dir``, a key for every run setting a
    recipe sets (``roundpipe.config.recipe_settings``), its type, default and help read off the
    setting's declaration in ``RunConfig``."""
    own = [
        (f.name, f.type, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
        for f in fields(_RunLoop)
    ]
    settings = [
        (f.name, recipe_type(f), _f(recipe_default(f), f.metadata["recipe"])) for f in recipe_settings()
    ]
    at = [name for name, _, _ in own].index("output_dir") + 1
    section = make_dataclass("RunSection", own[:at] + settings + own[at:], namespace={"__module__": __name__})
    section.__doc__ = "The ``run:`` group: how and how long to run."
    return section


RunSection = _run_section()


@dataclass
class OptimConfig:
    lr: float = _f(1e-4, "Peak learning rate (AdamW).", _finite(0, strict=False))
    weight_decay: float = _f(
        0.0,
        "Decoupled weight decay (torch.optim.AdamW's), on every trainable parameter, norms and biases "
        "included; a parameter that got no gradient in a step is not decayed in it.",
        _finite(0, strict=False, note=" (0: no decay)"),
    )
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.", _betas)
    eps: float = _f(1e-8, "AdamW epsilon.", _finite(0, strict=True))
    max_grad_norm: float | None = _f(
        1.0,
        "Clip the global gradient norm to this (null: no clipping).",
        _finite(0, strict=True, note=", or null not to clip", null=True),
    )
    state_dtype: Literal["fp32", "bf16", "int8"] = _f(
        "fp32",
        "AdamW's two moments on the host: fp32 (8 bytes a parameter), bf16 (4) or int8 (8-bit blocks "
        "of 256, as bitsandbytes' 8-bit Adam: 2.03); the master stays fp32 (docs/quantization.md).",
    )


@dataclass
class ScheduleConfig:
    kind: Literal["constant", "linear", "cosine"] = _f("cosine", "Learning-rate shape after warm-up.")
    warmup_steps: int = _f(0, "Steps of linear warm-up from 0 to `optim.lr`.", _at_least(0))
    min_lr_ratio: float = _f(
        0.0, "Final learning rate as a share of `optim.lr` (linear, cosine).", _share(one=True)
    )


@dataclass
class EvalConfig:
    every: int | None = _f(
        None,
        "Evaluate every N optimizer steps (and at the end). null: only at the end.",
        _at_least(1, null=True),
    )
    batch_size: int | None = _f(
        None, "Sequences per evaluation batch. Default: `run.batch_size`.", _at_least(1, null=True)
    )
    max_samples: int | None = _f(
        None, "Evaluate on at most this many held-out samples.", _at_least(1, null=True)
    )
    exact_match: bool = _f(
        False,
        "Also report exact match: the greedy answer equals the reference response (instruction and "
        "chat formats).",
    )
    show_samples: int = _f(
        0,
        "At the end, print this many held-out prompts with the model's answer and the reference.",
        _at_least(0),
    )
    max_new_tokens: int = _f(64, "Longest generated answer when showing samples.", _at_least(1))


@dataclass
class CheckpointConfig:
    every: int | None = _f(
        None,
        "Write a checkpoint every N optimizer steps (null: only at the end and on a signal).",
        _at_least(1, null=True),
    )
    keep_last: int = _f(2, "Keep this many newest checkpoints; older ones are deleted.", _at_least(1))
    on_signal: bool = _f(True, "On SIGINT / SIGTERM finish the current step, write a checkpoint and stop.")
    at_end: bool = _f(True, "Write a checkpoint when the run completes.")
    on_error: bool = _f(
        True,
        "When a step fails, write a checkpoint of the last completed step if the failure left it intact "
        "(it did not come half-way through an optimizer update), then stop with the error.",
    )
    export: Literal["auto", "adapter", "merged", "both", "none"] = _f(
        "auto",
        "What to export at the end: adapter (peft format), merged (save_pretrained safetensors), "
        "both, none; auto: the adapter for LoRA, the full model otherwise.",
    )


@dataclass
class LoggingConfig:
    every: int = _f(1, "Log metrics every N optimizer steps.", _at_least(1))
    progress: bool = _f(True, "Show a tqdm progress bar (loss, tokens/s, ETA, worker idle share).")
    tensorboard: bool | Literal["auto"] = _f(
        "auto",
        "Write TensorBoard events: true, false, or auto (when installed). true needs the `tensorboard` "
        "extra, checked when the recipe loads.",
        _extra("tensorboard", "tensorboard"),
    )
    wandb: bool = _f(
        False,
        "Log the metrics to Weights & Biases (the `wandb` extra, checked when the recipe loads), "
        "with the resolved recipe as the run's config. Online or offline is wandb's own setting "
        "(`WANDB_MODE=offline`, `wandb offline`); roundpipe does not override it.",
        _extra("wandb", "wandb", off="false"),
    )
    trackio: bool = _f(
        False,
        "Log the metrics to trackio (the `trackio` extra, checked when the recipe loads), with the "
        "resolved recipe as the run's config. trackio keeps them on this machine (`TRACKIO_DIR`); "
        "roundpipe never asks it to sync to a Space.",
        _extra("trackio", "trackio", off="false"),
    )
    project: str = _f(
        "roundpipe", "Project name of the wandb and trackio runs (each run is named `run.name`)."
    )
    plots: bool = _f(True, "At the end draw the loss curve and one step's timeline (PNG, Chrome trace).")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "What to train."})
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapters (peft)."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training and evaluation data."})
    run: RunSection = field(default_factory=RunSection, metadata={"help": "How and how long to run."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "The AdamW optimizer."})
    schedule: ScheduleConfig = field(
        default_factory=ScheduleConfig, metadata={"help": "Learning-rate schedule."}
    )
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Evaluation on held-out data."})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "Checkpoints and exports."}
    )
    logging: LoggingConfig = field(
        default_factory=LoggingConfig, metadata={"help": "Progress, metrics, plots."}
    )

    def check(self) -> None:
        """Every key's own rule (its ``check`` metadata), then the rules between keys. The recipe
        loader runs the first as it reads each key, naming the key's line; a refusal of the second
        carries ``.key``, the key to change, whose line the loader names."""
        for group in fields(self):
            section = getattr(self, group.name)
            for f in fields(section):
                check = f.metadata.get("check")
                if check is not None:
                    check(f"{group.name}.{f.name}", getattr(section, f.name))
        if (self.model.path is None) == (self.model.config is None):
            raise RecipeError(
                "set exactly one of model.path (a HF directory) and model.config (config numbers)"
            )
        if self.data.train == REQUIRED:  # ==, not `is`: a dumped and re-read "<required>" is another str
            raise RecipeError("data.train is required: the path of the training data file")
        self._check_data_files()
        if self.checkpoint.export in ("adapter", "both") and not self.lora.enabled:
            raise _refuse(
                "checkpoint.export",
                f"checkpoint.export: {self.checkpoint.export} needs lora.enabled: true (a full fine-tune "
                "has no adapter); export: merged, or enable LoRA",
            )
        if self.data.synthetic is not None and self.data.eval is None:
            raise _refuse(
                "data.synthetic", "data.synthetic writes a held-out file too: set data.eval to its path"
            )
        check_run_paths(self)  # nothing the run writes may lie outside its run directory

    def _check_data_files(self) -> None:
        """``data.train`` as a list: each entry a path, or a path and a positive weight (a refusal
        names data.train's line)."""
        if not isinstance(self.data.train, list):
            return
        if not self.data.train:
            raise _refuse("data.train", "data.train is an empty list: name at least one training data file")
        if self.data.synthetic is not None:
            raise _refuse(
                "data.train", "data.synthetic writes one data.train file: data.train cannot be a list"
            )
        for i, entry in enumerate(self.data.train):
            where = f"data.train[{i}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            unknown = sorted(set(entry) - {"path", "weight"})
            if unknown:
                raise _refuse(
                    "data.train", f"{where}: unknown key {', '.join(unknown)}; an entry takes path, weight"
                )
            if not isinstance(entry.get("path"), str) or not entry["path"]:
                raise _refuse(
                    "data.train",
                    f"{where} needs a path (a data file or directory), e.g. {{path: a.jsonl, weight: 1}}",
                )
            weight = entry.get("weight", 1.0)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not (math.isfinite(weight) and weight > 0)
            ):
                raise _refuse("data.train", f"{where}.weight must be a number > 0, got {weight!r}")

    @property
    def output_dir(self) -> str:
        return self.run.output_dir or f"runs/{self.run.name}"
