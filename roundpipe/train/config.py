"""TrainConfig: one training run, as a tree of small dataclasses that a YAML recipe maps onto.

Each group is one key of the recipe (``model:``, ``lora:``, ``data:``, ...), each field one key
under it. A field's ``help`` metadata is its documentation: ``roundpipe train --help`` and
``docs/recipes.md`` are generated from it (``roundpipe.train.recipe``), so the two cannot drift.
Fields whose default is ``REQUIRED`` must be given. Loading, type checks and the errors that name
the file and line live in ``roundpipe.train.recipe``; the checks here are the ones that need more
than one field. The ``run:`` keys that set a ``roundpipe.RunConfig`` setting (``run.policy``,
``run.dtype``, ...) are not written here: ``RunSection`` reads them off their declarations in
``roundpipe/config.py``, help and check included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal

from roundpipe.config import recipe_default, recipe_settings, recipe_type
from roundpipe.errors import RecipeError
from roundpipe.train.paths import check_run_paths

REQUIRED: Any = "<required>"  # the default of a field a recipe must set


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


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
    rank: int = _f(16, "LoRA rank r.")
    alpha: float = _f(32.0, "LoRA alpha (the update is scaled by alpha / rank).")
    dropout: float = _f(0.0, "Dropout on the LoRA input.")
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
    eval_fraction: float = _f(0.0, "Share of the training file held out for evaluation when `eval` is unset.")
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
    max_length: int = _f(1024, "Longest sample in tokens (after the template).")
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
        [20000, 500], "Training and held-out samples the synthetic task writes."
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
    batch_size: int = _f(8, "Sequences per forward/backward (one micro-step).")
    grad_accum: int = _f(1, "Micro-steps per optimizer step (effective batch = batch_size x grad_accum).")
    max_steps: int | None = _f(None, "Optimizer steps to run. Default: `epochs` over the training data.")
    epochs: float = _f(1.0, "Passes over the training data when `max_steps` is unset.")
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
    lr: float = _f(1e-4, "Peak learning rate (AdamW).")
    weight_decay: float = _f(
        0.0,
        "Decoupled weight decay (torch.optim.AdamW's), on every trainable parameter, norms and biases "
        "included; a parameter that got no gradient in a step is not decayed in it.",
    )
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient norm to this (null: no clipping).")


@dataclass
class ScheduleConfig:
    kind: Literal["constant", "linear", "cosine"] = _f("cosine", "Learning-rate shape after warm-up.")
    warmup_steps: int = _f(0, "Steps of linear warm-up from 0 to `optim.lr`.")
    min_lr_ratio: float = _f(0.0, "Final learning rate as a share of `optim.lr` (linear, cosine).")


@dataclass
class EvalConfig:
    every: int | None = _f(None, "Evaluate every N optimizer steps (and at the end). null: only at the end.")
    batch_size: int | None = _f(None, "Sequences per evaluation batch. Default: `run.batch_size`.")
    max_samples: int | None = _f(None, "Evaluate on at most this many held-out samples.")
    exact_match: bool = _f(
        False,
        "Also report exact match: the greedy answer equals the reference response (instruction and "
        "chat formats).",
    )
    show_samples: int = _f(
        0, "At the end, print this many held-out prompts with the model's answer and the reference."
    )
    max_new_tokens: int = _f(64, "Longest generated answer when showing samples.")


@dataclass
class CheckpointConfig:
    every: int | None = _f(
        None, "Write a checkpoint every N optimizer steps (null: only at the end and on a signal)."
    )
    keep_last: int = _f(2, "Keep this many newest checkpoints; older ones are deleted.")
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
    every: int = _f(1, "Log metrics every N optimizer steps.")
    progress: bool = _f(True, "Show a tqdm progress bar (loss, tokens/s, ETA, worker idle share).")
    tensorboard: bool | Literal["auto"] = _f(
        "auto", "Write TensorBoard events: true, false, or auto (when installed)."
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
        """Rules that span fields (types, required keys and each run setting's own check, as
        ``RunConfig`` declares it, are checked by the recipe loader)."""
        if (self.model.path is None) == (self.model.config is None):
            raise RecipeError(
                "set exactly one of model.path (a HF directory) and model.config (config numbers)"
            )
        if self.data.train == REQUIRED:  # ==, not `is`: a dumped and re-read "<required>" is another str
            raise RecipeError("data.train is required: the path of the training data file")
        self._check_data_files()
        for key, value in (
            ("run.batch_size", self.run.batch_size),
            ("run.grad_accum", self.run.grad_accum),
            ("data.max_length", self.data.max_length),
            ("checkpoint.keep_last", self.checkpoint.keep_last),
            ("logging.every", self.logging.every),
        ):
            if value < 1:
                raise RecipeError(f"{key} must be at least 1, got {value}")
        for key, value in (
            ("run.max_steps", self.run.max_steps),
            ("eval.every", self.eval.every),
            ("checkpoint.every", self.checkpoint.every),
        ):
            if value is not None and value < 1:
                raise RecipeError(f"{key} must be at least 1 or null, got {value}")
        if not 0.0 <= self.data.eval_fraction < 1.0:
            raise RecipeError(f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction}")
        if self.run.epochs <= 0:
            raise RecipeError(f"run.epochs must be positive, got {self.run.epochs}")
        self._check_optim()
        if self.lora.enabled and self.lora.rank < 1:
            raise RecipeError(f"lora.rank must be at least 1, got {self.lora.rank}")
        check_run_paths(self)  # nothing the run writes may lie outside its run directory

    def _check_data_files(self) -> None:
        """``data.train`` as a list: each entry a path, or a path and a positive weight."""
        if not isinstance(self.data.train, list):
            return
        if not self.data.train:
            raise RecipeError("data.train is an empty list: name at least one training data file")
        if self.data.synthetic is not None:
            raise RecipeError("data.synthetic writes one data.train file: data.train cannot be a list")
        for i, entry in enumerate(self.data.train):
            where = f"data.train[{i}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            unknown = sorted(set(entry) - {"path", "weight"})
            if unknown:
                raise RecipeError(f"{where}: unknown key {', '.join(unknown)}; an entry takes path, weight")
            if not isinstance(entry.get("path"), str) or not entry["path"]:
                raise RecipeError(
                    f"{where} needs a path (a data file or directory), e.g. {{path: a.jsonl, weight: 1}}"
                )
            weight = entry.get("weight", 1.0)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not (math.isfinite(weight) and weight > 0)
            ):
                raise RecipeError(f"{where}.weight must be a number > 0, got {weight!r}")

    def _check_optim(self) -> None:
        """What ``Pipeline.configure_optimizer`` (``optim.OptimizerConfig``) refuses, refused at load
        (this module does not import torch, so the rule is spelled out here; the loader has
        already refused NaN)."""
        o = self.optim
        finite = math.isfinite
        if not (finite(o.lr) and o.lr >= 0):
            raise RecipeError(f"optim.lr must be a finite number >= 0, got {o.lr}")
        if not (finite(o.weight_decay) and o.weight_decay >= 0):
            raise RecipeError(
                f"optim.weight_decay must be a finite number >= 0 (0: no decay), got {o.weight_decay}"
            )
        if len(o.betas) != 2 or not all(finite(b) and 0.0 <= b < 1.0 for b in o.betas):
            raise RecipeError(f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {o.betas}")
        if not (finite(o.eps) and o.eps > 0):
            raise RecipeError(f"optim.eps must be a finite number > 0, got {o.eps}")
        if o.max_grad_norm is not None and not (finite(o.max_grad_norm) and o.max_grad_norm > 0):
            raise RecipeError(
                f"optim.max_grad_norm must be a finite number > 0, or null not to clip, got {o.max_grad_norm}"
            )

    @property
    def output_dir(self) -> str:
        return self.run.output_dir or f"runs/{self.run.name}"
