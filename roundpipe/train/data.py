"""Training data: local files -> tokenized ``Sample``s, every record accounted for.

``load_data`` reads the recipe's ``data:`` files (through ``data_files.read_records``), renders
each record in its format (text, instruction, chat), tokenizes it, masks the tokens that carry no
loss, and splits off the held-out set. Every record read is either kept or counted under a skip
reason in the ``DataReport``: nothing is lost silently. ``batches.py`` cuts the samples into the
batches the pipeline trains on. Users' view of all this: ``docs/data.md``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from roundpipe.errors import DataError
from roundpipe.train.chats import NAMED_TEMPLATES, BadChat, openai_messages, record_tools, sharegpt_messages
from roundpipe.train.config import DataConfig
from roundpipe.train.data_files import file_type_of, read_records

IGNORE = -100  # the label of a token without loss
EXAMPLES_PER_REASON = 3  # places named per skip reason in the report


@dataclass(frozen=True)
class Sample:
    """One tokenized training or evaluation sample.

    ``input_ids[:prompt_len]`` is the prompt and ``input_ids[prompt_len:]`` the answer (the
    response of an instruction, the last assistant turn of a chat, with its eos): exact match
    and generation feed the prompt and compare with the answer. Text samples have
    ``prompt_len == 0``. ``labels`` has the length of ``input_ids``: the token itself where it
    carries loss, ``-100`` where it does not.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_len: int


@dataclass
class DataReport:
    """What happened to every record read: ``read == kept + sum(skipped.values())``.

    Attributes:
        files: records read per file path.
        read: records read from all files (blank lines of a .txt file are not records).
        kept: samples built from them (``train + eval``).
        skipped: records dropped, per reason (e.g. ``"missing field 'output'"``).
        examples: per skip reason, the first few places (``"train.jsonl line 4"``).
        truncated: kept samples cut to ``max_length`` (``too_long: truncate``).
        max_length: the ``data.max_length`` the samples were held to.
        train: samples for training (an epoch's, after the files' weights); eval: held-out samples.
        eval_source: where the held-out samples come from (a file, or a share of the train file).
        eval_in_train: held-out samples identical to a training sample (from an eval file, or
            across the files of a ``data.train`` list).
        notes: other lines for the log (a named chat template left unused).
        mix: per ``data.train`` entry (a list of files), ``"PATH xWEIGHT -> N samples"``.
    """

    files: dict[str, int] = field(default_factory=dict)
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    truncated: int = 0
    max_length: int = 0
    train: int = 0
    eval: int = 0
    eval_source: str = ""
    eval_in_train: int = 0
    mix: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        """Count one record dropped for ``reason``, found at ``where``."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        places = self.examples.setdefault(reason, [])
        if len(places) < EXAMPLES_PER_REASON:
            places.append(where)

    def summary(self) -> str:
        """A few lines for the log: what was read and kept, then one line per skip reason."""
        sources = ", ".join(f"{n} from {path}" for path, n in self.files.items())
        lines = [
            f"read {self.read} records ({sources})",
            f"kept {self.kept}: {self.kept - self.eval} for training, {self.eval} held out ({self.eval_source})"
            if self.eval
            else f"kept {self.kept}, all for training (nothing held out: set data.eval or data.eval_fraction)",
        ]
        if self.mix:
            lines.append(f"mixed: {', '.join(self.mix)} ({self.train} training samples an epoch)")
        for reason, count in sorted(self.skipped.items(), key=lambda item: -item[1]):
            lines.append(f"skipped {count}: {reason} (e.g. {', '.join(self.examples[reason])})")
        if self.truncated:
            lines.append(f"truncated {self.truncated} to max_length ({self.max_length} tokens)")
        lines += self.notes
        if self.eval_in_train:
            lines.append(f"warning: {self.eval_in_train} held-out samples also appear in the training data")
        return "\n".join(lines)


@dataclass(frozen=True)
class DataSplits:
    """The result of ``load_data``: training and held-out samples, and the report."""

    train: list[Sample]
    eval: list[Sample]
    report: DataReport


class _Skip(Exception):
    """A record cannot become a sample; ``args[0]`` is the reason counted in the report."""


def _text(record: dict, name: str, required: bool = True) -> str:
    value = record.get(name)
    if value is None or (isinstance(value, float) and value != value):  # absent, null or NaN
        if required:
            raise _Skip(f"missing field {name!r}")
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _Skip(f"field {name!r} is not text")
    if required and not value.strip():
        raise _Skip(f"empty field {name!r}")
    return value


def _fill(template: str, values: dict[str, str]) -> str:
    # One pass, so an instruction that contains "{input}" stays as written.
    return re.sub(r"\{(instruction|input)\}", lambda m: values[m.group(1)], template)


def messages_field(cfg: DataConfig) -> str:
    """The field holding a conversation: ``data.messages_field``, else ``messages`` for
    ``format: chat`` and ``conversations`` for ``format: sharegpt``."""
    if cfg.messages_field:
        return cfg.messages_field
    return "conversations" if cfg.format == "sharegpt" else "messages"


def _messages(record: dict, cfg: DataConfig) -> list[dict]:
    name = messages_field(cfg)
    if record.get(name) is None:
        raise _Skip(f"missing field {name!r}")
    try:
        if cfg.format == "sharegpt":
            return sharegpt_messages(record, name)
        return openai_messages(record[name], name)
    except BadChat as bad:
        raise _Skip(bad.args[0]) from None


def _common_prefix(prefix: list[int], full: list[int]) -> int:
    if full[: len(prefix)] == prefix:
        return len(prefix)
    n = 0
    while n < len(prefix) and n < len(full) and prefix[n] == full[n]:
        n += 1
    return n


class _Encoder:
    """Turns one record into ``(input_ids, labels, prompt_len)`` in the recipe's format."""

    def __init__(self, cfg: DataConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.eos = tokenizer.eos_token_id
        if (cfg.add_eos or cfg.packing) and self.eos is None:
            raise DataError(
                "the tokenizer has no eos token, which data.add_eos (and packing) needs: set "
                "data.add_eos: false and data.packing: false, or use a tokenizer with an eos token"
            )
        self.notes: list[str] = []
        if cfg.format in ("chat", "sharegpt"):
            self._choose_template(tokenizer)
        self.template_text = str(getattr(tokenizer, "chat_template", "") or "")
        # A packed sample must end with eos: it is what separates it from the next one in a row.
        self.tail = [self.eos] if cfg.add_eos or cfg.packing else []

    def _choose_template(self, tokenizer) -> None:
        """The tokenizer's own chat template; else the one ``data.chat_template`` names, which the
        tokenizer then carries (so an export saves the template the model was trained with)."""
        named = self.cfg.chat_template
        if getattr(tokenizer, "chat_template", None):
            if named:
                self.notes.append(
                    f"data.chat_template {named} is not used: the tokenizer has its own chat template"
                )
            return
        if not named:
            raise DataError(
                f"format: {self.cfg.format} needs a chat template, and this tokenizer has none: set "
                f"data.chat_template: chatml (or {', '.join(n for n in NAMED_TEMPLATES if n != 'chatml')}) "
                f"to the format the model should learn, use a tokenizer whose tokenizer_config.json "
                f"(or chat_template.jinja) has one, or format: instruction"
            )
        tokenizer.chat_template = NAMED_TEMPLATES[named]

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])

    def __call__(self, record: dict) -> tuple[list[int], list[int], int]:
        fmt = self.cfg.format
        if fmt == "text":
            ids = self.encode(_text(record, self.cfg.text_field), True) + self.tail
            return ids, list(ids), 0
        if fmt == "instruction":
            return self._instruction(record)
        if fmt in ("chat", "sharegpt"):
            return self._chat(record)
        raise DataError(f"unknown data.format {fmt!r}: use text, instruction, chat or sharegpt")

    def _instruction(self, record: dict) -> tuple[list[int], list[int], int]:
        cfg = self.cfg
        instruction = _text(record, cfg.instruction_field)
        extra = _text(record, cfg.input_field, required=False)
        output = _text(record, cfg.output_field)
        template = cfg.prompt_template if extra.strip() else cfg.prompt_template_no_input
        prompt = self.encode(_fill(template, {"instruction": instruction, "input": extra}), True)
        answer = self.encode(output, False) + self.tail
        labels = (prompt if cfg.train_on_prompt else [IGNORE] * len(prompt)) + answer
        return prompt + answer, labels, len(prompt)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list | None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:
            raise _Skip(f"chat template error: {str(error)[:80]}") from None
        return self.encode(text, False)

    def _chat(self, record: dict) -> tuple[list[int], list[int], int]:
        messages = _messages(record, self.cfg)
        try:
            tools = record_tools(record)
        except BadChat as bad:
            raise _Skip(bad.args[0]) from None
        # A template that does not read tool calls or definitions would drop them without a word.
        if tools and "tools" not in self.template_text:
            raise _Skip("tool definitions, which the chat template does not render")
        if any("tool_calls" in m for m in messages) and "tool_calls" not in self.template_text:
            raise _Skip("tool calls, which the chat template does not render")
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if not turns:
            raise _Skip("no assistant turn")
        messages = messages[: turns[-1] + 1]  # what follows the last answer carries no loss
        ids = self._render(messages, False, tools)
        # An assistant turn spans from the end of the conversation before it (with the generation
        # prompt, i.e. the assistant header) to the end of the conversation through it. Templates
        # that render a prefix differently inside the whole conversation are handled by keeping
        # only what the prefix and the whole share.
        spans = []
        for i in turns:
            start = _common_prefix(self._render(messages[:i], True, tools), ids)
            end = _common_prefix(self._render(messages[: i + 1], False, tools), ids)
            spans.append((start, max(start, end)))
        prompt_len = spans[-1][0]
        if self.tail and self.eos not in ids[prompt_len:]:
            ids.append(self.eos)
            spans[-1] = (prompt_len, len(ids))
        if self.cfg.train_on_prompt:
            return ids, list(ids), prompt_len
        labels = [IGNORE] * len(ids)
        for start, end in spans:
            labels[start:end] = ids[start:end]
        return ids, labels, prompt_len


_FIELD_KEYS = {
    "text": ("text_field",),
    "instruction": ("instruction_field", "output_field"),
    "chat": ("messages_field",),
    "sharegpt": ("messages_field",),
}


def _samples_from_file(path: str, cfg: DataConfig, encoder: _Encoder, report: DataReport) -> list[Sample]:
    """Read one file into samples, counting every record in ``report``."""
    kind = file_type_of(path, cfg.file_type)
    if kind == "text" and cfg.format != "text":
        raise DataError(
            f"{path} is a plain-text file (one sample per line), which only data.format: text reads; "
            f"for format {cfg.format} give a .jsonl, .json, .csv or .parquet file"
        )
    found = read_records(path, kind, cfg.text_field)
    records, columns = found.records, found.columns
    if found.bad and cfg.on_bad_record == "error":
        first = found.bad[0]
        more = f" ({len(found.bad)} such records in the file)" if len(found.bad) > 1 else ""
        raise DataError(
            f"{first.location}: {first.reason} ({first.detail}){more}. Fix or delete the record, or "
            f"set data.on_bad_record: skip to skip such records (each is counted in the data report)"
        )
    report.files[path] = len(records) + len(found.bad)
    report.read += len(records) + len(found.bad)
    report.max_length = cfg.max_length
    skipped_before = dict(report.skipped)
    for bad in found.bad:
        report.skip(bad.reason, bad.where)
    samples = []
    for where, record in records:
        try:
            ids, labels, prompt_len = encoder(record)
            if len(ids) > cfg.max_length:
                if cfg.too_long == "error":
                    raise DataError(
                        f"{where} has {len(ids)} tokens, more than data.max_length={cfg.max_length} "
                        f"(file {path}). Raise data.max_length, or set data.too_long: skip (drop such "
                        f"samples) or truncate (cut them)"
                    )
                if cfg.too_long == "skip":
                    raise _Skip(f"longer than max_length ({cfg.max_length} tokens)")
                ids, labels = ids[: cfg.max_length], labels[: cfg.max_length]
                prompt_len = min(prompt_len, cfg.max_length)
                if all(label == IGNORE for label in labels):
                    raise _Skip(f"prompt longer than max_length ({cfg.max_length} tokens)")
                report.truncated += 1
            if all(label == IGNORE for label in labels):
                raise _Skip("no token to learn from (every label masked)")
        except _Skip as skip:
            report.skip(skip.args[0], where)
            continue
        samples.append(Sample(tuple(ids), tuple(labels), prompt_len))
    report.kept += len(samples)
    if not samples:
        here = {
            r: n - skipped_before.get(r, 0) for r, n in report.skipped.items() if n > skipped_before.get(r, 0)
        }
        reasons = "; ".join(f"{reason} ({n})" for reason, n in here.items())
        message = f"no usable sample in {path}: every record was skipped: {reasons}."
        field_of = {
            key: messages_field(cfg) if key == "messages_field" else getattr(cfg, key)
            for key in _FIELD_KEYS[cfg.format]
        }
        missing = [key for key, name in field_of.items() if f"missing field {name!r}" in here]
        if missing:
            message += (
                f" The file has the fields {', '.join(map(repr, columns))}: set "
                f"{' / '.join('data.' + key for key in missing)} to the field that holds it, or check "
                f"data.format ({cfg.format})."
            )
        raise DataError(message)
    return samples


def _hold_out(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Split off ``fraction`` of the samples, seeded. Identical samples land on the same side,
    so a duplicate never carries a held-out sample into training. Both sides keep file order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        groups.setdefault(sample.input_ids, []).append(index)
    keys = list(groups)
    random.Random(f"roundpipe-eval-split-{seed}").shuffle(keys)
    want = max(1, round(fraction * len(samples)))
    held: set[int] = set()
    for key in keys:
        if len(held) >= want:
            break
        held.update(groups[key])
    if len(held) >= len(samples):
        raise DataError(
            f"data.eval_fraction={fraction} leaves no training sample out of {len(samples)}: lower "
            f"data.eval_fraction, or give a separate data.eval file"
        )
    train = [s for i, s in enumerate(samples) if i not in held]
    held_out = [s for i, s in enumerate(samples) if i in held]
    return train, held_out


def load_data(cfg: DataConfig, tokenizer, seed: int) -> DataSplits:
    """Read, render, tokenize and split the recipe's data.

    Args:
        cfg: the ``data:`` section (files, format, fields, templates, length rules).
        tokenizer: a Hugging Face tokenizer (``roundpipe.train.tokenizer.load_tokenizer``).
        seed: seeds the held-out split (``run.seed``).

    Returns:
        ``DataSplits``: ``train``, in file order; ``eval``, from ``cfg.eval`` when set, else a
        seeded ``cfg.eval_fraction`` of the training file that never appears in ``train``
        (empty when the fraction is 0); and the ``DataReport`` that accounts for every record.

    Raises:
        DataError: a file is missing, empty, not UTF-8 or unreadable; every record of a file was
            skipped (the message lists the reasons and, for a missing field, the fields the file
            has); a sample is too long under ``too_long: error``; the tokenizer lacks what the
            format needs (an eos token, a chat template).
    """
    encoder = _Encoder(cfg, tokenizer)
    report = DataReport(notes=list(encoder.notes))
    sources = train_files(cfg)
    mixing = isinstance(cfg.train, list)
    parts = [_samples_from_file(path, cfg, encoder, report) for path, _ in sources]
    held_out: list[Sample] = []
    if cfg.eval:
        held_out = _samples_from_file(cfg.eval, cfg, encoder, report)
        report.eval_source = f"from {cfg.eval}"
    elif cfg.eval_fraction > 0:
        for i, part in enumerate(parts):  # from each file, before its weight repeats a sample
            parts[i], held = _hold_out(part, cfg.eval_fraction, seed)
            held_out += held
        names = ", ".join(path for path, _ in sources)
        report.eval_source = f"{cfg.eval_fraction:.0%} of {names}, seed {seed}"
    train: list[Sample] = []
    for (path, weight), part in zip(sources, parts):
        mixed = _weighted(part, weight, f"roundpipe-mix-{seed}-{path}") if mixing else part
        if mixing:
            report.mix.append(f"{path} x{weight:g} -> {len(mixed)} samples")
        train += mixed
    if not train:
        raise DataError(
            f"data.train's weights leave no training sample ({'; '.join(report.mix)}): raise the weights"
        )
    if held_out:
        seen = {sample.input_ids for sample in train}
        report.eval_in_train = sum(sample.input_ids in seen for sample in held_out)
    report.train, report.eval = len(train), len(held_out)
    return DataSplits(train=train, eval=held_out, report=report)


def train_files(cfg: DataConfig) -> list[tuple[str, float]]:
    """``data.train`` as ``(path, weight)`` pairs: one file of weight 1, or the list's entries."""
    if isinstance(cfg.train, str):
        return [(cfg.train, 1.0)]
    entries = [{"path": e} if isinstance(e, str) else e for e in cfg.train]
    return [(e["path"], float(e.get("weight", 1.0))) for e in entries]


def _weighted(samples: list[Sample], weight: float, seed: str) -> list[Sample]:
    """``weight`` times the samples: ``int(weight)`` copies of each, then a seeded choice of the
    remaining fraction of them (each at most once), in file order."""
    whole = int(weight)
    extra = round((weight - whole) * len(samples))
    picks = sorted(random.Random(seed).sample(range(len(samples)), extra))
    return samples * whole + [samples[i] for i in picks]
