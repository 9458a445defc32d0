"""Local data files -> records, offline: the ``datasets`` readers behind the checks they need.

``read_records`` reads one file (JSON Lines, JSON, CSV, Parquet or plain text) into
``(where, fields)`` records, each named by its place in the file (``"data.jsonl record 3"``), so a
skip or an error can point at it. Before a reader sees the bytes, a file that is not UTF-8 is
refused naming the line, and so is JSON that Arrow's reader would crash the process on instead of
raising (nesting thousands deep, null records). What a record becomes is ``data.py``'s business.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import tempfile

import numpy as np

from roundpipe.errors import DataError

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


def file_type_of(path: str, file_type: str) -> str:
    """``file_type`` itself, or for ``auto`` the type its extension names (DataError if none)."""
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
    kind = file_type_of(path, file_type)
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
