"""Training data: local files -> tokenized ``Sample``s -> the batches the pipeline trains on.

``load_data`` reads the recipe's ``data:`` files (JSON Lines, JSON, CSV, Parquet or plain text,
through the ``datasets`` readers, offline), renders each record in its format (text, instruction,
chat), tokenizes it, masks the tokens that carry no loss, and splits off the held-out set. Every
record read is either kept or counted under a skip reason in the ``DataReport``: nothing is lost
silently. ``Batches`` cuts the training samples into padded (or packed) batches, deterministically
and resumably; ``eval_batches`` does the same for evaluation, in order.

A batch is a dict of three ``[B, T]`` int64 tensors: ``input_ids``; ``labels``, unshifted (the
pipeline shifts them), ``-100`` where there is no loss; ``attention_mask``, 1 for a token and 0 for
right padding. Users' view of all this: ``docs/data.md``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import re
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from roundpipe.errors import CheckpointError, DataError
from roundpipe.train.config import DataConfig

IGNORE = -100  # the label of a token without loss
GROUP_WINDOW = 50  # group_by_length sorts windows of this many batches
EXAMPLES_PER_REASON = 3  # places named per skip reason in the report

_FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# Arrow's JSON reader takes at most 64 levels of nesting (deeper fails), and it crashes the process
# (a stack overflow, no exception) on some thousands: files nested deeper than this are refused first
# (``_check_json``, which also refuses the null records that crash it).
MAX_JSON_DEPTH = 100
_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_BRACKET_STEP = np.zeros(256, dtype=np.int8)  # byte -> change of the nesting depth
_BRACKET_STEP[[ord("["), ord("{")]], _BRACKET_STEP[[ord("]"), ord("}")]] = 1, -1
_NULL_AT_LINE_START = re.compile(rb"^[ \t\r]*null", re.MULTILINE)
_NULL_FIRST_ITEM = re.compile(rb"\s*\[\s*null")


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
        examples: per skip reason, the first few places (``"train.jsonl record 4"``).
        truncated: kept samples cut to ``max_length`` (``too_long: truncate``).
        max_length: the ``data.max_length`` the samples were held to.
        train: samples for training; eval: held-out samples.
        eval_source: where the held-out samples come from (a file, or a share of the train file).
        eval_in_train: held-out samples (from an eval file) identical to a training sample.
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
            f"kept {self.kept}: {self.train} for training, {self.eval} held out ({self.eval_source})"
            if self.eval
            else f"kept {self.kept}, all for training (nothing held out: set data.eval or data.eval_fraction)",
        ]
        for reason, count in sorted(self.skipped.items(), key=lambda item: -item[1]):
            lines.append(f"skipped {count}: {reason} (e.g. {', '.join(self.examples[reason])})")
        if self.truncated:
            lines.append(f"truncated {self.truncated} to max_length ({self.max_length} tokens)")
        if self.eval_in_train:
            lines.append(f"warning: {self.eval_in_train} held-out samples also appear in the training data")
        return "\n".join(lines)


@dataclass(frozen=True)
class DataSplits:
    """The result of ``load_data``: training and held-out samples, and the report."""

    train: list[Sample]
    eval: list[Sample]
    report: DataReport


# ---------------------------------------------------------------------------------------------
# Reading files


def _file_type(path: str, file_type: str) -> str:
    if file_type != "auto":
        return file_type
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FILE_TYPES:
        raise DataError(
            f"cannot tell the file type of {path} from its extension {ext!r}: name it "
            f"{', '.join(_FILE_TYPES)}, or set data.file_type (jsonl, json, csv, parquet, text)"
        )
    return _FILE_TYPES[ext]


def _check_utf8(path: str) -> None:
    """Raise DataError naming the line of the first byte sequence that is not UTF-8."""
    lines_before, carry = 0, b""
    with open(path, "rb") as file:
        while True:
            chunk = file.read(1 << 24)
            data = carry + chunk
            # A newline byte never occurs inside a multi-byte UTF-8 character, so cutting after the
            # last one never splits a character.
            cut = len(data) if not chunk else data.rfind(b"\n") + 1
            try:
                data[:cut].decode("utf-8")
            except UnicodeDecodeError as error:
                line = lines_before + data[: error.start].count(b"\n") + 1
                column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
                raise DataError(
                    f"{path} line {line}, byte {column}: not UTF-8 ({error.reason}, byte "
                    f"{data[error.start : error.start + 1]!r}). Save the file as UTF-8 "
                    f"(e.g. `iconv -f latin1 -t utf-8 in > out`)"
                ) from None
            if not chunk:
                return
            lines_before += data[:cut].count(b"\n")
            carry = data[cut:]


def _check_json(path: str) -> None:
    """Refuse, naming the line, the JSON that Arrow's JSON reader (under ``datasets``) crashes the
    whole process on instead of raising: values nested thousands deep (a stack overflow), and a
    record that is ``null`` (a block of JSON Lines that starts with one; a list of objects whose
    first item is one). Nesting beyond ``MAX_JSON_DEPTH`` is refused, deeper than any reader takes."""
    depth, lines_before, carry = 0, 0, b""
    first, null_first, has_object = True, False, False
    with open(path, "rb") as file:
        while True:
            chunk = file.read(1 << 24)
            if first:
                chunk = chunk.removeprefix(b"\xef\xbb\xbf")  # a BOM, which the reader drops
                first, null_first = False, bool(_NULL_FIRST_ITEM.match(chunk))
            data = carry + chunk
            # A JSON string never holds a raw newline, so cutting after one never splits a string.
            cut = len(data) if not chunk else data.rfind(b"\n") + 1
            # Brackets inside strings do not nest: drop the strings (the newlines stay where they were).
            part = _JSON_STRING.sub(b'""', data[:cut])
            steps = _BRACKET_STEP[np.frombuffer(part, dtype=np.uint8)]
            levels = np.cumsum(steps, dtype=np.int64) + depth  # the depth after each byte
            if levels.size and levels.max() > MAX_JSON_DEPTH:
                line = lines_before + part.count(b"\n", 0, int(levels.argmax())) + 1
                raise DataError(
                    f"{path} line {line}: the JSON nests more than {MAX_JSON_DEPTH} arrays or objects "
                    f"deep, which the JSON reader cannot take; flatten the record (a sample needs "
                    f"at most a list of messages)"
                )
            for null in _NULL_AT_LINE_START.finditer(part):
                at = null.end() - len(b"null")
                if levels[at] == 0:  # a record of its own, not a value inside one
                    line = lines_before + part.count(b"\n", 0, at) + 1
                    raise DataError(
                        f"{path} line {line}: a record is null, not a JSON object; delete the line "
                        f'(each record is an object such as {{"text": "..."}})'
                    )
            has_object = has_object or b"{" in part
            if levels.size:
                depth = int(levels[-1])
            if not chunk:
                break
            lines_before += data[:cut].count(b"\n")
            carry = data[cut:]
    if null_first and has_object:
        raise DataError(
            f"{path}: the first record of the list is null, not a JSON object; delete it "
            f'(each record is an object such as {{"text": "..."}})'
        )


@contextlib.contextmanager
def _quiet_datasets():
    """Silence the datasets library's progress bars and error logs (our DataError says it)."""
    import datasets

    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def read_records(
    path: str, file_type: str = "auto", text_field: str = "text"
) -> tuple[list[tuple[str, dict]], list[str]]:
    """Read a local data file into records, offline.

    Args:
        path: the file.
        file_type: ``auto`` (by extension), ``jsonl``, ``json`` (a list of records, or JSON Lines),
            ``csv`` (a header row; every column read as text), ``parquet`` or ``text`` (one record
            per non-blank line, under ``text_field``).
        text_field: the field a ``text`` file's lines go into.

    Returns:
        ``(records, columns)``: each record as ``(where, fields)``, ``where`` naming its place
        (``"data.jsonl record 3"``, ``"notes.txt line 7"``); ``columns`` the fields the file has.

    Raises:
        DataError: the file is missing, empty, not UTF-8, unreadable as ``file_type``, or holds no
            records. The message names the file.
    """
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path} (working directory: {os.getcwd()})")
    if not os.path.isfile(path):
        raise DataError(f"{path} is not a file: name one data file (.jsonl, .json, .csv, .parquet, .txt)")
    kind = _file_type(path, file_type)
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty: it holds no records")
    if kind != "parquet":
        _check_utf8(path)
    if kind in ("json", "jsonl"):
        _check_json(path)

    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="roundpipe-data-") as cache:
        # The cache lives only while the file is read: nothing lands in ~/.cache.
        try:
            if kind in ("json", "jsonl"):
                table = datasets.Dataset.from_json(path, cache_dir=cache)
            elif kind == "csv":
                with open(path, newline="", encoding="utf-8") as file:
                    header = next(csv.reader(file), [])
                strings = datasets.Features({name: datasets.Value("string") for name in header})
                table = datasets.Dataset.from_csv(
                    path, cache_dir=cache, features=strings, keep_default_na=False, na_values=[""]
                )
            elif kind == "parquet":
                table = datasets.Dataset.from_parquet(path, cache_dir=cache)
            elif kind == "text":
                table = datasets.Dataset.from_text(path, cache_dir=cache)
            else:
                raise DataError(
                    f"unknown data.file_type {kind!r}: use auto, jsonl, json, csv, parquet or text"
                )
            rows = table.to_list()
            columns = list(table.column_names)
        except DataError:
            raise
        except Exception as error:
            if "corresponds to no data" in str(error):
                raise DataError(f"{path} holds no records") from None
            reason = str(error).strip() or type(error).__name__
            raise DataError(
                f"cannot read {path} as {kind}: {reason}. Fix the file, or set data.file_type if "
                f"{kind} is the wrong type"
            ) from error

    name = os.path.basename(path)
    if kind == "text":
        records = [(f"{name} line {i}", {text_field: row["text"]}) for i, row in enumerate(rows, 1)]
        records = [(where, row) for where, row in records if row[text_field].strip()]
        columns = [text_field]
    else:
        records = [(f"{name} record {i}", row) for i, row in enumerate(rows, 1)]
    if not records:
        raise DataError(f"{path} holds no records")
    return records, columns


# ---------------------------------------------------------------------------------------------
# Records -> samples


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


def _messages(record: dict, name: str) -> list[dict]:
    value = record.get(name)
    if value is None:
        raise _Skip(f"missing field {name!r}")
    if isinstance(value, str):  # a CSV cell, or a JSON string holding the list
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for the parser
            raise _Skip(f"field {name!r} is not a list of messages") from None
    if not isinstance(value, list) or not value:
        raise _Skip(f"field {name!r} is not a list of messages")
    messages = []
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise _Skip("malformed message (each needs a string 'role' and 'content')")
        # Readers fill keys other records have with None; a template would render them.
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


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
        if cfg.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "format: chat needs a tokenizer with a chat template, and this one has none: use a "
                "tokenizer whose tokenizer_config.json (or chat_template.jinja) has one, or format: instruction"
            )
        # A packed sample must end with eos: it is what separates it from the next one in a row.
        self.tail = [self.eos] if cfg.add_eos or cfg.packing else []

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])

    def __call__(self, record: dict) -> tuple[list[int], list[int], int]:
        fmt = self.cfg.format
        if fmt == "text":
            ids = self.encode(_text(record, self.cfg.text_field), True) + self.tail
            return ids, list(ids), 0
        if fmt == "instruction":
            return self._instruction(record)
        if fmt == "chat":
            return self._chat(record)
        raise DataError(f"unknown data.format {fmt!r}: use text, instruction or chat")

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

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:
            raise _Skip(f"chat template error: {str(error)[:80]}") from None
        return self.encode(text, False)

    def _chat(self, record: dict) -> tuple[list[int], list[int], int]:
        messages = _messages(record, self.cfg.messages_field)
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if not turns:
            raise _Skip("no assistant turn")
        messages = messages[: turns[-1] + 1]  # what follows the last answer carries no loss
        ids = self._render(messages, False)
        # An assistant turn spans from the end of the conversation before it (with the generation
        # prompt, i.e. the assistant header) to the end of the conversation through it. Templates
        # that render a prefix differently inside the whole conversation are handled by keeping
        # only what the prefix and the whole share.
        spans = []
        for i in turns:
            start = _common_prefix(self._render(messages[:i], True), ids)
            end = _common_prefix(self._render(messages[: i + 1], False), ids)
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
}


def _samples_from_file(path: str, cfg: DataConfig, encoder: _Encoder, report: DataReport) -> list[Sample]:
    """Read one file into samples, counting every record in ``report``."""
    kind = _file_type(path, cfg.file_type)
    if kind == "text" and cfg.format != "text":
        raise DataError(
            f"{path} is a plain-text file (one sample per line), which only data.format: text reads; "
            f"for format {cfg.format} give a .jsonl, .json, .csv or .parquet file"
        )
    records, columns = read_records(path, kind, cfg.text_field)
    report.files[path] = len(records)
    report.read += len(records)
    report.max_length = cfg.max_length
    skipped_before = dict(report.skipped)
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
        missing = [key for key in _FIELD_KEYS[cfg.format] if f"missing field {getattr(cfg, key)!r}" in here]
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
    report = DataReport()
    train = _samples_from_file(cfg.train, cfg, encoder, report)
    if cfg.eval:
        held_out = _samples_from_file(cfg.eval, cfg, encoder, report)
        report.eval_source = f"from {cfg.eval}"
        seen = {sample.input_ids for sample in train}
        report.eval_in_train = sum(sample.input_ids in seen for sample in held_out)
    elif cfg.eval_fraction > 0:
        train, held_out = _hold_out(train, cfg.eval_fraction, seed)
        report.eval_source = f"{cfg.eval_fraction:.0%} of {cfg.train}, seed {seed}"
    else:
        held_out = []
    report.train, report.eval = len(train), len(held_out)
    return DataSplits(train=train, eval=held_out, report=report)


# ---------------------------------------------------------------------------------------------
# Batches


def _collate(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-pad ``(input_ids, labels)`` rows to ``length``: the batch dict the pipeline takes."""
    input_ids, labels, mask = [], [], []
    for ids, row_labels in rows:
        pad = length - len(ids)
        input_ids.append([*ids, *[pad_id] * pad])
        labels.append([*row_labels, *[IGNORE] * pad])
        mask.append([1] * len(ids) + [0] * pad)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.int64),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "attention_mask": torch.tensor(mask, dtype=torch.int64),
    }


def _pack(samples: Sequence[Sample], order: list[int], max_length: int) -> list[tuple[int, ...]]:
    """Greedy packing in ``order``: a sample goes into the current row if it fits, else opens the next."""
    rows, row, used = [], [], 0
    for index in order:
        n = len(samples[index].input_ids)
        if n > max_length:
            raise DataError(f"a sample of {n} tokens does not fit a packed row of max_length={max_length}")
        if row and used + n > max_length:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(index)
        used += n
    if row:
        rows.append(tuple(row))
    return rows


class Batches:
    """Endless, deterministic, resumable training batches of exactly ``batch_size`` rows.

    An epoch shuffles the rows with ``random.Random(seed + epoch)`` (no global RNG), drops the
    incomplete tail (``len(rows) % batch_size`` rows, different ones each epoch when shuffled), and
    cuts the rest into batches; epochs roll over forever and the caller decides when to stop. A
    batch is padded on the right to its longest row (``labels`` -100 and ``attention_mask`` 0 on
    padding).

    ``group_by_length``: the kept rows of an epoch are cut into windows of ``GROUP_WINDOW`` batches,
    each window sorted by length and cut into batches, and the batches shuffled (when ``shuffle``),
    so a batch holds samples of similar length.

    ``packing``: the samples (each ending with its eos) are packed once, in a seeded order, into rows
    of ``max_length`` positions; a sample is never split, and the rest of a row is padding. Each
    sample keeps its labels, except its first token, which nothing in the row before predicts
    (-100). Attention spans the whole row: a token sees the earlier samples of its row.
    ``group_by_length`` has no effect (every row is ``max_length`` long).

    The position is ``(epoch, position)``: the next batch is batch ``position`` of epoch ``epoch``,
    so ``epoch`` counts completed epochs. ``state_dict`` / ``load_state_dict`` carry it, and after
    loading, ``next()`` returns exactly the batches an uninterrupted run would have.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        group_by_length: bool = True,
        packing: bool = False,
        max_length: int | None = None,
        pad_id: int,
    ):
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        if packing and (max_length is None or max_length < 1):
            raise DataError("packing needs max_length: the length of a packed row (data.max_length)")
        self.samples = list(samples)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.group_by_length, self.packing, self.max_length, self.pad_id = (
            group_by_length and not packing,
            packing,
            max_length,
            pad_id,
        )
        if packing:
            order = list(range(len(self.samples)))
            if shuffle:
                random.Random(f"roundpipe-pack-{seed}").shuffle(order)
            self._rows = _pack(self.samples, order, max_length)
        else:
            self._rows = [(i,) for i in range(len(self.samples))]
        self._row_lengths = [sum(len(self.samples[i].input_ids) for i in row) for row in self._rows]
        if len(self._rows) < batch_size:
            what = "packed rows" if packing else "training samples"
            raise DataError(
                f"{len(self._rows)} {what} make no full batch of {batch_size}: lower run.batch_size, or "
                f"give more training data"
            )
        self._epoch, self._position = 0, 0
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, its batches of row indices)

    @property
    def epoch(self) -> int:
        """Epochs completed: the epoch the next batch comes from."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches already taken from the current epoch."""
        return self._position

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``rows // batch_size`` (the same every epoch)."""
        return len(self._rows) // self.batch_size

    def _batches_of(self, epoch: int) -> list[list[int]]:
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = random.Random(self.seed + epoch)
        order = list(range(len(self._rows)))
        if self.shuffle:
            rng.shuffle(order)
        size = self.batch_size
        order = order[: self.steps_per_epoch * size]
        if self.group_by_length:
            batches = []
            for start in range(0, len(order), GROUP_WINDOW * size):
                window = sorted(
                    order[start : start + GROUP_WINDOW * size], key=lambda r: -self._row_lengths[r]
                )
                batches += [window[k : k + size] for k in range(0, len(window), size)]
            if self.shuffle:
                rng.shuffle(batches)
        else:
            batches = [order[k : k + size] for k in range(0, len(order), size)]
        self._plan = (epoch, batches)
        return batches

    def _row(self, row: tuple[int, ...]) -> tuple[list[int], list[int]]:
        ids, labels = [], []
        for index in row:
            sample = self.samples[index]
            ids += sample.input_ids
            labels += sample.labels
            if self.packing:
                labels[len(ids) - len(sample.input_ids)] = IGNORE
        return ids, labels

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch: ``input_ids``, ``labels``, ``attention_mask``, each ``[batch_size, T]``
        int64, ``T`` the longest row of the batch (``max_length`` when packing)."""
        batch = self._batches_of(self._epoch)[self._position]
        self._position += 1
        if self._position == self.steps_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        rows = [self._row(self._rows[r]) for r in batch]
        length = self.max_length if self.packing else max(len(ids) for ids, _ in rows)
        return _collate(rows, length, self.pad_id)

    def _fingerprint(self) -> dict[str, Any]:
        lengths = b"".join(len(s.input_ids).to_bytes(4, "little") for s in self.samples)
        return {
            "samples": len(self.samples),
            "lengths_crc32": zlib.crc32(lengths),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "group_by_length": self.group_by_length,
            "packing": self.packing,
            "max_length": self.max_length if self.packing else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position (``epoch``, ``position``) and what it is valid for (``fingerprint``)."""
        return {"epoch": self._epoch, "position": self._position, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``.

        Raises:
            CheckpointError: the state was saved with other samples or batching settings, or its
                position lies outside an epoch.
        """
        saved = state.get("fingerprint")
        if saved is not None:
            ours = self._fingerprint()
            differ = [
                f"{key}: saved {saved.get(key)!r}, now {value!r}"
                for key, value in ours.items()
                if saved.get(key) != value
            ]
            if differ:
                raise CheckpointError(
                    f"the data position in this checkpoint belongs to other data or batching ({'; '.join(differ)}). "
                    f"Resume with the same data files, tokenizer, data settings, run.batch_size and run.seed, "
                    f"or start a new run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise CheckpointError(
                f"data position epoch {epoch}, batch {position} is outside an epoch of {self.steps_per_epoch} batches"
            )
        self._epoch, self._position = epoch, position


def eval_batches(
    samples: Sequence[Sample], batch_size: int, pad_id: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Evaluation batches over ``samples`` in order; the last one may be smaller.

    Each batch is the dict ``Batches.next`` returns, right-padded to its longest row.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    for start in range(0, len(samples), batch_size):
        rows = [(s.input_ids, s.labels) for s in samples[start : start + batch_size]]
        yield _collate(rows, max(len(ids) for ids, _ in rows), pad_id)
