"""Local data files -> records, offline, each record read on its own.

``read_records`` reads one file (JSON Lines, JSON, CSV, Parquet or plain text) into
``(where, fields)`` records, each named by its place in the file (``"data.jsonl line 3"``), so a
skip or an error can point at it. JSON and JSON Lines are parsed here, one record at a time with
``json.loads``: no schema is inferred across records, so one odd record cannot change how the
others read (a ``datasets`` reader typed a whole column as JSON and turned ``"16"`` into 16), and a
line that does not parse is one ``BadRecord`` with its line, not a failed file. CSV (every cell
text), Parquet and plain text go through ``datasets``' readers. A file that is not UTF-8 is refused
naming the line. What a record becomes is ``data.py``'s business.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

from roundpipe.errors import DataError

_FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read at all: ``where`` names it as records are named
    (``"data.jsonl line 4"``), ``location`` as an editor does (``"data/data.jsonl:4"``), ``reason``
    is what the report counts it under (``"not valid JSON"``) and ``detail`` what the parser said."""

    where: str
    location: str
    reason: str
    detail: str


@dataclass
class FileRecords:
    """What ``read_records`` found in one file: ``records`` as ``(where, fields)`` in file order,
    ``columns`` the fields they have, ``bad`` the records that could not be read."""

    records: list[tuple[str, dict]]
    columns: list[str]
    bad: list[BadRecord] = field(default_factory=list)


def _json_value(text: str):
    """``json.loads``, with nesting too deep for the parser as a ValueError like any other."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as error:  # its message counts lines and characters from 1 and 0
        raise ValueError(f"{error.msg} at line {error.lineno}, column {error.colno}") from None


def _json_lines(path: str, lines: Iterable[bytes]) -> FileRecords:
    """One JSON object per line (``lines`` split at each ``\\n`` only); blank lines are no records,
    and a line that does not parse or is not an object is a ``BadRecord`` naming its line."""
    name, found = os.path.basename(path), FileRecords([], [])
    columns: dict[str, None] = {}
    for number, line in enumerate(lines, 1):
        line = line.removesuffix(b"\n")
        if number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")  # a BOM
        if not line.strip():
            continue
        where, location = f"{name} line {number}", f"{path}:{number}"
        try:
            value = _json_value(line.decode("utf-8"))
        except ValueError as error:
            detail = str(error).replace("at line 1, column", "at column")
            found.bad.append(BadRecord(where, location, "not valid JSON", detail))
            continue
        if not isinstance(value, dict):
            kind = "null" if value is None else type(value).__name__
            found.bad.append(BadRecord(where, location, "not a JSON object", f"a JSON {kind}"))
            continue
        columns.update(dict.fromkeys(value))
        found.records.append((where, value))
    found.columns = list(columns)
    return found


def _json_file(path: str, data: bytes) -> FileRecords:
    """A JSON list of objects, one JSON object, or (when the text is neither) JSON Lines."""
    text = data.decode("utf-8")
    if not text.lstrip().startswith("["):
        try:
            value = _json_value(text)
        except ValueError:
            return _json_lines(path, data.split(b"\n"))
        value = [value]
    else:
        try:
            value = _json_value(text)
        except ValueError as error:
            raise DataError(
                f"{path}: not valid JSON ({error}). A .json file holds one list of records; fix "
                f"it there, or write one record per line (.jsonl), where a broken line is skipped "
                f"with data.on_bad_record: skip"
            ) from None
    name, found = os.path.basename(path), FileRecords([], [])
    columns: dict[str, None] = {}
    for number, item in enumerate(value, 1):
        where = f"{name} record {number}"
        if not isinstance(item, dict):
            kind = "null" if item is None else type(item).__name__
            found.bad.append(
                BadRecord(where, f"{path} record {number}", "not a JSON object", f"a JSON {kind}")
            )
            continue
        columns.update(dict.fromkeys(item))
        found.records.append((where, item))
    found.columns = list(columns)
    return found


_DIRECTORY_FILES = (".parquet", ".arrow", ".jsonl", ".json", ".csv")  # what a data directory may hold


def file_type_of(path: str, file_type: str) -> str:
    """``file_type`` itself, ``directory`` for a directory, or for ``auto`` the type its extension
    names (DataError if none)."""
    if os.path.isdir(path):
        return "directory"
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


def _read_directory(path: str, text_field: str) -> FileRecords:
    """A dataset saved with ``datasets``' ``save_to_disk``, or a directory of data files of one type
    (``.parquet``, ``.arrow``, ``.jsonl``, ``.json`` or ``.csv``), read in name order."""
    name = os.path.basename(os.path.normpath(path))
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)))
        raise DataError(
            f"{path} holds a dataset with the splits {', '.join(splits)} (a DatasetDict saved with "
            f"save_to_disk): name one split's directory, e.g. {os.path.join(path, splits[0] if splits else 'train')}"
        )
    if os.path.exists(os.path.join(path, "state.json")):
        with _quiet_datasets() as datasets:
            try:
                table = datasets.load_from_disk(path)
                rows, columns = table.to_list(), list(table.column_names)
            except Exception as error:
                raise DataError(
                    f"cannot read {path} as a dataset saved with save_to_disk: {error}"
                ) from error
        if not rows:
            raise DataError(f"{path} holds no records")
        return FileRecords([(f"{name} record {i}", row) for i, row in enumerate(rows, 1)], columns)
    files = sorted(
        e for e in os.listdir(path) if os.path.isfile(os.path.join(path, e)) and not e.startswith(".")
    )
    kinds = sorted({os.path.splitext(e)[1].lower() for e in files} & set(_DIRECTORY_FILES))
    if len(kinds) != 1:
        found = f"files of the types {', '.join(kinds)}" if kinds else "no data files"
        raise DataError(
            f"{path} is a directory with {found}: a data directory is one saved with save_to_disk, or "
            f"holds files of one type ({', '.join(_DIRECTORY_FILES)}); name a file instead, or "
            f"move the others out"
        )
    merged = FileRecords([], [])
    columns: dict[str, None] = {}
    for entry in (e for e in files if e.lower().endswith(kinds[0])):
        part = os.path.join(path, entry)
        if kinds[0] == ".arrow":
            with _quiet_datasets() as datasets:
                try:
                    table = datasets.Dataset.from_file(part, in_memory=True)
                    rows = table.to_list()
                except Exception as error:
                    raise DataError(f"cannot read {part} as an Arrow file: {error}") from error
            found = FileRecords(
                [(f"{entry} record {i}", r) for i, r in enumerate(rows, 1)], table.column_names
            )
        else:
            found = read_records(part, "auto", text_field)
        merged.records += found.records
        merged.bad += found.bad
        columns.update(dict.fromkeys(found.columns))
    merged.columns = list(columns)
    if not merged.records and not merged.bad:
        raise DataError(f"{path} holds no records")
    return merged


def read_records(path: str, file_type: str = "auto", text_field: str = "text") -> FileRecords:
    """Read a local data file into records, offline.

    Args:
        path: the file.
        file_type: ``auto`` (by extension), ``jsonl``, ``json`` (a list of records, one record, or
            JSON Lines), ``csv`` (a header row; every column read as text), ``parquet`` or ``text``
            (one record per non-blank line, under ``text_field``).
        text_field: the field a ``text`` file's lines go into.

    Returns:
        ``FileRecords``: each record as ``(where, fields)``, ``where`` naming its place
        (``"data.jsonl line 3"``, ``"data.json record 3"``, ``"notes.txt line 7"``); the fields the
        file has; and the records that could not be read (a JSON Lines line that does not parse or
        is not an object; a list item that is not an object), which the caller counts or refuses.
        Blank lines are no records.

    Raises:
        DataError: the file is missing, empty, not UTF-8, unreadable as ``file_type``, or holds no
            records. The message names the file.
    """
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path} (working directory: {os.getcwd()})")
    if os.path.isdir(path):
        return _read_directory(path, text_field)
    if not os.path.isfile(path):
        raise DataError(f"{path} is not a file: name one data file (.jsonl, .json, .csv, .parquet, .txt)")
    kind = file_type_of(path, file_type)
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty: it holds no records")
    if kind != "parquet":
        _check_utf8(path)
    if kind in ("json", "jsonl"):
        with open(path, "rb") as file:  # a binary file's lines end at b"\n" only, as JSON Lines' do
            if kind == "jsonl":
                found = _json_lines(path, file)
            else:
                found = _json_file(path, file.read().removeprefix(b"\xef\xbb\xbf"))
        if not found.records and not found.bad:
            raise DataError(f"{path} holds no records")
        return found

    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="roundpipe-data-") as cache:
        # The cache lives only while the file is read: nothing lands in ~/.cache.
        try:
            if kind == "csv":
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
    return FileRecords(records, columns)
