"""Fuzzing what users hand roundpipe (issue 13, item 7): recipes, data files, schedule tables,
``RunConfig`` values and batches.

Each input either works or is refused with a ``RoundpipeError`` (RecipeError, DataError,
ScheduleError, ConfigError, InputError) whose message says what to change. Nothing may escape as a
bare KeyError, TypeError, ValueError, RecursionError, ..., nothing may crash the process, and
nothing may hang: every example runs under a SIGALRM bound. Inputs that once did one of these are
pinned with ``@example``. The strategies stay small, so the module runs in seconds.
"""

import torch

torch.set_num_threads(1)

import contextlib  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import typing  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.errors import (  # noqa: E402
    ConfigError,
    DataError,
    InputError,
    RecipeError,
    RoundpipeError,
    ScheduleError,
)
from roundpipe.schedule import POLICIES, Partition, ScheduleTable, Task, build_table, dry_run  # noqa: E402
from roundpipe.schedule.check import runs_forwards_first, validate_table  # noqa: E402
from roundpipe.train.batches import Batches  # noqa: E402
from roundpipe.train.config import DataConfig, TrainConfig  # noqa: E402
from roundpipe.train.data import IGNORE, load_data  # noqa: E402
from roundpipe.train.recipe import config_from_dict, dump_recipe, load_recipe  # noqa: E402
from roundpipe.train.tokenizer import byte_tokenizer  # noqa: E402

# ROUNDPIPE_FUZZ_SCALE=20 runs twenty times the examples, for a longer hunt than CI's.
SCALE = float(os.environ.get("ROUNDPIPE_FUZZ_SCALE", "1"))


def fuzz(n: int):
    """Hypothesis settings of a fuzz test: ``n`` examples (times ``SCALE``), no per-example deadline
    (a shared machine is slow at times; hangs are caught by ``bounded`` instead)."""
    return settings(
        max_examples=max(1, round(n * SCALE)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


BOUND_S = 30.0  # what one example may take before it counts as a hang


class Hang(Exception):
    """An example ran past ``BOUND_S``."""


@contextlib.contextmanager
def bounded(seconds: float = BOUND_S):
    """Raise ``Hang`` in the block once it has run ``seconds``; then put back whatever alarm (e.g.
    pytest-timeout's) was set before, less the time spent here."""

    def expire(signum, frame):
        raise Hang(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier:
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - start), 1e-3))


def outcome(call, *refusals: type[RoundpipeError]):
    """``(result, None)`` when ``call()`` works, ``(None, error)`` when it raises one of
    ``refusals`` with a message; any other exception (the bug being hunted) propagates."""
    assert all(issubclass(r, RoundpipeError) for r in refusals)
    with bounded():
        try:
            return call(), None
        except refusals as error:
            message = str(error)
            assert len(message.split()) >= 3, f"{type(error).__name__} says too little: {message!r}"
            return None, error


# =================================================================================================
# 1. Recipes: YAML text, plain dicts and --set overrides

HINTS = typing.get_type_hints(TrainConfig)
SCHEMA = {
    f.name: [g.name for g in dataclasses.fields(HINTS[f.name])] for f in dataclasses.fields(TrainConfig)
}
BASE = {"model": {"config": {"model_type": "llama"}}, "data": {"train": "train.jsonl"}}

words = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(),
    st.floats(),
    words,
    st.sampled_from(["auto", "fp32", "cosine", "chat", "skip", "1e-4", "all-linear", "<required>", "<<"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3),
    max_leaves=6,
)
groups = st.sampled_from(list(SCHEMA)) | words
RUN_OPTIONS = ["head_shards", "partition", "order", "prefetch", "watchdog_s", "round_size", "polcy"]


def typed(tp) -> st.SearchStrategy:
    """Values of annotation ``tp``, in range or just outside it (0 and negative counts, a choice
    misspelt), so that many recipes load and the checks after the type check run too."""
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-1, 40)
    if tp is float:
        return st.floats(-0.5, 2.0) | st.integers(0, 3) | st.sampled_from(["1e-4", ".5", "x1"])
    if tp is str:
        return words | st.sampled_from(["auto", "cpu:2", "run-1"])
    if tp is type(None):
        return st.none()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args) | st.sampled_from([str(a).upper() for a in args])
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    if origin is dict or tp is dict:
        return st.dictionaries(st.sampled_from(RUN_OPTIONS) | words, scalars, max_size=2)
    return st.one_of([typed(a) for a in args])  # a union


FIELD_TYPES = {group: typing.get_type_hints(HINTS[group]) for group in SCHEMA}  # group -> key -> annotation


@st.composite
def recipe_dicts(draw) -> dict:
    """The valid ``BASE`` with a few keys set, mostly to values of their type: known and unknown
    groups and keys, wrong types, out-of-range numbers, whole groups replaced, a required key
    dropped."""
    data = json.loads(json.dumps(BASE))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3, 5]))):
        group = draw(st.sampled_from(list(SCHEMA)) if draw(st.integers(0, 9)) else words)
        if draw(st.integers(0, 19)) == 0:
            data[group] = draw(values)
            continue
        if not isinstance(data.get(group), dict):
            data[group] = {}
        known = group in SCHEMA and draw(st.integers(0, 9)) > 0
        key = draw(st.sampled_from(SCHEMA[group]) if known else words)
        typed_ok = known and draw(st.integers(0, 4)) > 0
        data[group][key] = draw(typed(FIELD_TYPES[group][key]) if typed_ok else values)
    if draw(st.integers(0, 9)) == 0:
        data.pop(draw(st.sampled_from(["model", "data"])), None)
    return data


YAML_BITS = [
    "model:", "data:", "run:", "lora:", "options:", "train: t.jsonl", "config: {model_type: llama}",
    "\n", "  ", "\t", "- ", ": ", "[", "]", "{", "}", ",", "&a ", "*a", "!!int ", "!!float ", "!!binary ",
    "!!timestamp ", "!!set ", "!!python/object:os.system ", "<<: ", "? ", "'", '"', "#", "|", ">", "---",
    "...", "%YAML 1.1", "~", "null", ".nan", ".inf", "-.inf", "1e-4", "0x1F", "1_000", "yes", "abc",
    "9" * 5000, "\x00", "\x07", "\x85", "\ufeff", "é",
]  # fmt: skip
yaml_texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=60),
    st.lists(st.sampled_from(YAML_BITS), max_size=25).map("".join),
    st.builds(lambda d: yaml.safe_dump(d), recipe_dicts()),
    st.builds(  # a valid recipe with a few bits spliced in
        lambda d, cuts: _splice(yaml.safe_dump(d), cuts),
        recipe_dicts(),
        st.lists(st.tuples(st.integers(0, 200), st.sampled_from(YAML_BITS)), max_size=3),
    ),
)


def _splice(text: str, cuts: list[tuple[int, str]]) -> str:
    for at, bit in cuts:
        at = at % (len(text) + 1)
        text = text[:at] + bit + text[at:]
    return text


LAUGHS = "run:\n  options:\n    l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10)
)


def _checked_config(cfg: TrainConfig) -> None:
    """A loaded config passes its own checks and reads back from its dump to an equal config."""
    cfg.check()
    again = config_from_dict(yaml.safe_load(dump_recipe(cfg)))
    assert repr(again) == repr(cfg)  # repr, not ==: run.options may hold a NaN


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


@fuzz(40)
@given(recipe_dicts())
@example(
    {
        **BASE,
        "run": {
            "seed": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
        },
    }
)
@example({**BASE, "model": {"config": {"\x85": None}}})  # found: dumped raw in single quotes by
@example({**BASE, "data": {**BASE["data"], "prompt_template": "a\x85b"}})  # PyYAML, read back as a space
@example({**BASE, "run": {"epochs": math.nan}})  # found: loaded; the trainer's math.floor failed
@example({**BASE, "run": {"epochs": math.inf}})
@example({**BASE, "run": {"options": {"polcy": "1f1b"}}})  # found: loaded; the trainer's RunConfig(**
@example({**BASE, "run": {"options": {"seed": 3}}})  # options) then raised a bare TypeError
def test_recipe_dicts_load_or_raise_recipe_error(recipe_dir, data):
    cfg, error = outcome(lambda: config_from_dict(data), RecipeError)
    if error is not None:
        assert str(error).startswith("<dict>"), error
    else:
        _checked_config(cfg)
    path = recipe_dir / "dict.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg, error = outcome(lambda: load_recipe(path), RecipeError)
    if error is not None:
        assert str(error).startswith(str(path)), error
    else:
        _checked_config(cfg)


def _deep(n: int) -> dict:
    nested = cur = []
    for _ in range(n):
        cur.append([])
        cur = cur[0]
    return {**BASE, "run": {"options": {"partition": nested}}}


@pytest.mark.parametrize("depth", [150, 2000])
def test_recipe_dicts_nested_too_deep_are_a_recipe_error(depth):
    # Found: 2000 levels raised RecursionError (copy.deepcopy); 150 loaded.
    _, error = outcome(lambda: config_from_dict(_deep(depth)), RecipeError)
    assert "nested more than" in str(error)


@fuzz(50)
@given(st.one_of(yaml_texts, st.binary(max_size=40)))
@example(yaml.safe_dump(BASE) + "run:\n  name: a\x01b\n")  # found: yaml ReaderError escaped
@example(yaml.safe_dump(BASE) + "run:\n  seed: !!int abc\n")  # found: bare ValueError
@example(yaml.safe_dump(BASE) + "run:\n  name: !!timestamp 2020-13-45\n")  # found: bare ValueError
@example(yaml.safe_dump(BASE) + "run:\n  name: !!timestamp abc\n")  # found: bare AttributeError
@example(yaml.safe_dump(BASE) + "run:\n  host_ram_check: !!bool abc\n")  # found: bare KeyError
@example(yaml.safe_dump(BASE) + "run:\n  seed: !!int\n")  # found: bare IndexError
@example(yaml.safe_dump(BASE) + "run:\n  !!float abc : 1\n")  # found: bare ValueError (a key)
@example(yaml.safe_dump(BASE) + "run:\n  seed: 1" + "0" * 5000 + "\n")  # found: ValueError, 4300 digits
@example("%YAML 1." + "9" * 5000 + "\n---\n")  # found: ValueError from the YAML scanner's int()
@example(yaml.safe_dump(BASE) + "run:\n  seed: &a [*a]\n")  # found: RecursionError in the message
@example(yaml.safe_dump(BASE) + "run:\n  options: " + "[" * 600 + "]" * 600 + "\n")  # RecursionError
@example(yaml.safe_dump(BASE) + LAUGHS + "  seed: *l9\n")  # found: hang, 10**10 items in the message
def test_recipe_yaml_loads_or_raises_recipe_error(recipe_dir, text):
    path = recipe_dir / "text.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    cfg, error = outcome(lambda: load_recipe(path), RecipeError)
    if error is not None:
        assert str(path) in str(error), error
    else:
        _checked_config(cfg)


@st.composite
def overrides(draw) -> str:
    """``GROUP.KEY[.SUB]=VALUE`` with known and unknown names, VALUE random YAML; or any text."""
    if draw(st.integers(0, 9)) == 0:
        return draw(words)
    group = draw(st.sampled_from(list(SCHEMA)) if draw(st.integers(0, 9)) else words)
    known = group in SCHEMA and draw(st.integers(0, 9)) > 0
    key = draw(st.sampled_from(SCHEMA[group]) if known else words)
    sub = draw(st.sampled_from([[]] * 6 + [["head_shards"], ["num_hidden_layers"], ["x", "y"], [""]]))
    if known and not sub and draw(st.integers(0, 2)):
        value = yaml.safe_dump(draw(typed(FIELD_TYPES[group][key])), default_flow_style=True)
        value = value.removesuffix("\n...\n").strip()
    else:
        value = draw(
            st.one_of(
                st.builds(lambda v: yaml.safe_dump(v, default_flow_style=True).strip(), values),
                st.lists(st.sampled_from(YAML_BITS), max_size=6).map("".join),
            )
        )
    return ".".join([group, key, *sub]) + draw(st.sampled_from(["=", "=", "=", ""])) + value


@fuzz(40)
@given(st.lists(overrides(), min_size=1, max_size=3))
@example(["run.seed=!!int x"])  # found: bare ValueError
@example(["model.path.head_shards=!!float "])  # found: bare IndexError
@example(["run.name=!!timestamp 2020-99-99"])  # found: bare ValueError
@example(["run.seed=&x [*x]"])  # found: RecursionError
@example(["run.max_steps=" + "[" * 600])  # found: RecursionError
@example(["run.options.a=&x [*x]"])  # loaded a value that contains itself
@example(["run.options.head_shards=4", "run.options.head_shards.x=1"])
def test_recipe_overrides_apply_or_raise_recipe_error(recipe_dir, sets):
    path = recipe_dir / "base.yaml"
    path.write_text(yaml.safe_dump(BASE), encoding="utf-8")
    cfg, error = outcome(lambda: load_recipe(path, sets), RecipeError)
    if error is not None:
        assert str(error).startswith((str(path), "--set ")), error
    else:
        _checked_config(cfg)


# =================================================================================================
# 2. Data files: every file type and format, broken in every way


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.sampled_from(["", " ", "\n", "hello", "{input}", "{instruction}", "\x00", "\u2028"]),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é ", "\n", "{"]), st.integers(500, 20_000)),
)
junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.lists(st.integers(), max_size=2))
messages = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | junk,
                    "content": texts | junk,
                },
                optional={"name": st.none() | texts},
            ),
            junk,
        ),
        max_size=4,
    ),
    junk,
    texts,
)
turns = st.lists(  # ShareGPT's {from, value}
    st.fixed_dictionaries(
        {
            "from": st.sampled_from(["human", "gpt", "system", "observation", "function_call", "x"]) | junk,
            "value": texts | junk,
        }
    )
    | junk,
    max_size=4,
)
FIELDS = ["text", "instruction", "input", "output", "messages", "conversations", "system", "tools", "other"]


prose = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).map(lambda t: t + "ok")
GOOD = {  # records each format reads, of one shape (a file's columns keep their types)
    "text": st.fixed_dictionaries({"text": prose}),
    "instruction": st.fixed_dictionaries(
        {"instruction": prose, "input": prose | st.just(""), "output": prose}
    ),
    "chat": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": prose}), max_size=2
    ).map(
        lambda head: {
            "messages": [*head, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        }
    ),
    "sharegpt": st.lists(st.fixed_dictionaries({"from": st.just("human"), "value": prose}), max_size=2).map(
        lambda head: {
            "conversations": [*head, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
        }
    ),
}
SPOILS = [None, "", "   ", 7, [], "{input}"]


@st.composite
def records(draw):
    """Any record: no object at all, or random fields of random values."""
    if draw(st.integers(0, 9)) == 0:
        return draw(junk | texts)
    record = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if name in ("messages", "conversations", "tools"):
            value = draw(messages | turns)
            record[name] = json.dumps(value) if draw(st.integers(0, 4)) == 0 else value
        else:
            record[name] = draw(texts | junk)
    return record


@st.composite
def rows_for(draw, fmt: str) -> list:
    """Half the time records of ``fmt`` with a few spoilt (a field dropped, emptied, nulled or of
    another type, a message list emptied); else random records."""
    if draw(st.booleans()):
        return draw(st.lists(records(), max_size=4))
    rows = draw(st.lists(GOOD[fmt], min_size=1, max_size=4))
    for i in draw(st.lists(st.integers(0, len(rows) - 1), max_size=2, unique=True)):
        key = draw(st.sampled_from(sorted(rows[i])))
        spoil = draw(st.sampled_from(["drop", *SPOILS]))
        if spoil == "drop":
            del rows[i][key]
        else:
            rows[i][key] = spoil
    return rows


def _csv(rows: list) -> str:
    names = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r)) or ["text"]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(names)
    for r in rows:
        cells = r if isinstance(r, dict) else {}
        writer.writerow(v if isinstance(v, str) else json.dumps(v) for v in (cells.get(n) for n in names))
    return out.getvalue()


BROKEN_LINES = [
    "{",
    "not json",
    "",
    "   ",
    "\r",
    "[1, 2]",
    '"text"',
    "null",
    '{"text": "a"',
    "}{",
    "[" * 5000,
]

data_configs = st.fixed_dictionaries(
    {
        "format": st.sampled_from(["text", "instruction", "chat", "sharegpt"]),
        "max_length": st.sampled_from([1, 3, 16, 64, 1024, 1024]),
        "too_long": st.sampled_from(["skip", "truncate", "error"]),
        "add_eos": st.booleans(),
        "packing": st.booleans(),
        "train_on_prompt": st.booleans(),
        "eval_fraction": st.sampled_from([0.0, 0.0, 0.5]),
        "file_type": st.sampled_from(["auto"] * 8 + ["jsonl", "csv", "text"]),
        "on_bad_record": st.sampled_from(["error", "skip"]),
    }
)


@st.composite
def data_cases(draw) -> tuple[str, bytes, dict]:
    """(extension, content, data config): records written as the file type wants them (with broken
    lines), or binary junk."""
    options = draw(data_configs)
    ext = draw(st.sampled_from([".jsonl", ".jsonl", ".json", ".csv", ".txt", ".parquet"]))
    if ext == ".parquet" or draw(st.integers(0, 9)) == 0:
        return ext, draw(st.binary(max_size=64)), options
    rows = draw(rows_for(options["format"]))
    if ext == ".jsonl":
        lines = [json.dumps(r) for r in rows]
        for at, line in draw(
            st.lists(st.tuples(st.integers(0, 4), st.sampled_from(BROKEN_LINES)), max_size=3)
        ):
            lines.insert(at, line)
        text = "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n\n"]))
    elif ext == ".json":
        text = json.dumps(draw(st.sampled_from([rows, rows, rows[0] if rows else {}, {"data": rows}])))
    elif ext == ".csv":
        text = _csv(rows)
    else:
        lines = (r.get("text") if isinstance(r, dict) else r for r in rows)
        text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return ext, text.encode("utf-8"), options


DEEP_JSON = '{"text": "hi", "x": ' + "[" * 10_000 + "]" * 10_000 + "}\n"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
TEXT = {"format": "text"}
MIXED_CHAT = "".join(
    json.dumps({"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "16"}]}) + "\n"
    for c in ["q", [1, 2], "r"]
)


@fuzz(15)
@given(data_cases())
@example((".jsonl", DEEP_JSON.encode(), TEXT))  # found: pyarrow segfault (process died)
@example((".jsonl", b"null\n[1, 2]", TEXT))  # found: pyarrow segfault (a null record)
@example((".json", b'[null, {"text": "a"}]', TEXT))  # found: pyarrow segfault
@example((".jsonl", (json.dumps({"messages": "[" * 100_000}) + "\n").encode(), {"format": "chat"}))
@example((".csv", ("messages\n" + "[" * 100_000 + "\n").encode(), {"format": "chat"}))  # RecursionError
@example((".jsonl", b'{"messages": []}\n{"messages": null}\n', {"format": "chat"}))
@example((".jsonl", (json.dumps({"messages": CHAT}) + "\n").encode(), {"format": "chat", "packing": True}))
@example(
    (".jsonl", (json.dumps({"text": "x" * 20_000}) + "\n").encode(), {"format": "text", "max_length": 3})
)
@example((".jsonl", b'{"text": "a"}\n\n{"text": \n\n{"text": "b"}\n', {**TEXT, "on_bad_record": "skip"}))
@example((".jsonl", MIXED_CHAT.encode(), {"format": "chat"}))  # found: one list content retyped the column
def test_data_files_load_or_raise_data_error(data_dir, tokenizer, case):
    ext, content, options = case
    path = data_dir / f"train{ext}"
    path.write_bytes(content)
    cfg = DataConfig(train=str(path), **options)
    splits, error = outcome(lambda: load_data(cfg, tokenizer, seed=0), DataError)
    if error is not None:
        return
    report = splits.report
    assert report.read == report.kept + sum(report.skipped.values())
    if ext == ".jsonl" and cfg.file_type in ("auto", "jsonl"):  # every line that is not blank is a record
        assert report.read == sum(1 for line in content.split(b"\n") if line.strip())
    assert report.kept == len(splits.train) + len(splits.eval) > 0
    for sample in splits.train + splits.eval:
        assert len(sample.input_ids) == len(sample.labels) <= cfg.max_length
        assert any(label != IGNORE for label in sample.labels)
        assert all(0 <= i < len(tokenizer) for i in sample.input_ids)
    batches = Batches(
        splits.train,
        1,
        seed=0,
        packing=cfg.packing,
        max_length=cfg.max_length,
        pad_id=tokenizer.pad_token_id,
    )
    batch = batches.next()
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape


# =================================================================================================
# 3. Schedule tables and partitions

bounds_values = st.one_of(
    st.lists(st.integers(-2, 8), max_size=6),
    st.lists(st.integers(1, 3), min_size=1, max_size=5).map(
        lambda s: [0, *(sum(s[: i + 1]) for i in range(len(s)))]
    ),
    st.lists(st.one_of(st.integers(0, 4), st.floats(0, 4), st.text(max_size=2), st.none()), max_size=4),
    st.tuples(st.integers(0, 3), st.integers(0, 5)),
    st.integers(),
    st.none(),
    st.text(max_size=4),
)


@fuzz(80)
@given(
    bounds_values, st.lists(st.one_of(st.integers(-1, 3), st.floats(0, 3), st.text(max_size=2)), max_size=4)
)
@example([0, 2, 1], [0])  # found: bare ValueError
@example([0, "1"], ["x"])  # found: bare TypeError / ValueError
@example(5, [])  # found: bare TypeError
def test_partitions_build_or_raise_schedule_error(bounds, sizes):
    part, error = outcome(lambda: Partition(bounds), ScheduleError)
    if error is None:
        hash(part)
        assert part.num_stages >= 1 and all(n > 0 for n in part.sizes())
        assert [part.stage_of(layer) for layer in range(part.num_layers)] == [
            s for s in range(part.num_stages) for _ in part.layers(s)
        ]
        _, error = outcome(lambda: part.stage_of(part.num_layers), ScheduleError)
        assert error is not None
    outcome(lambda: Partition.from_sizes(sizes), ScheduleError)


@st.composite
def partitions(draw, num_layers: int) -> Partition:
    cuts = draw(st.sets(st.integers(1, num_layers - 1), max_size=num_layers - 1)) if num_layers > 1 else set()
    return Partition((0, *sorted(cuts), num_layers))


_GOOD = build_table("1f1b", Partition.per_layer(2), Partition.per_layer(2), 2, 2)
TASK_KINDS = st.sampled_from(["F", "F", "B", "B", "I", "W", "X", ""])


@st.composite
def tables(draw) -> ScheduleTable:
    """A policy's table (or random rows) for random partitions, then shuffled about: tasks swapped,
    moved to other rows, dropped, duplicated, edited, added; counts and partitions that disagree."""
    layers = draw(st.integers(1, 4))
    forward = draw(partitions(layers))
    backward = draw(partitions(layers if draw(st.integers(0, 5)) else draw(st.integers(1, 4))))
    m = draw(st.sampled_from([1, 2, 3] * 3 + [0, -1, 10**9, 2.0, None, True]))
    num_devices = draw(st.integers(1, 3))
    rows = [[] for _ in range(num_devices)]
    policy = draw(st.sampled_from([None, "gpipe", "1f1b", "roundpipe", "interleaved", "hanayo", "zb"]))
    if policy and isinstance(m, int) and m >= 1 and m < 10 and forward.num_layers == backward.num_layers:
        with contextlib.suppress(ScheduleError):
            rows = [list(r) for r in build_table(policy, forward, backward, num_devices, m).devices]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 4]))):
        d = draw(st.integers(0, len(rows) - 1))
        op = draw(st.sampled_from(["swap", "move", "drop", "dup", "edit", "add", "row"]))
        row = rows[d]
        if op == "row":
            rows.append([])
        elif op == "add" or not row:
            task = Task(draw(TASK_KINDS), draw(st.integers(-1, 4)), draw(st.integers(-1, 3)), d)
            row.insert(draw(st.integers(0, len(row))), task)
        else:
            i = draw(st.integers(0, len(row) - 1))
            if op == "swap":
                j = draw(st.integers(0, len(row) - 1))
                row[i], row[j] = row[j], row[i]
            elif op == "move":
                to = draw(st.integers(0, len(rows) - 1))
                t = row.pop(i)
                keep = draw(st.booleans())  # also keep its old device: a task in the wrong row
                rows[to].append(t if keep else Task(t.kind, t.stage, t.microbatch, to))
            elif op == "drop":
                row.pop(i)
            elif op == "dup":
                row.insert(i, row[i])
            else:
                t = row[i]
                row[i] = dataclasses.replace(
                    t,
                    **draw(
                        st.sampled_from(
                            [{"kind": draw(TASK_KINDS)}, {"stage": draw(st.integers(-1, 4))}]
                            + [{"microbatch": draw(st.integers(-1, 3))}, {"device": draw(st.integers(0, 3))}]
                        )
                    ),
                )
    return ScheduleTable(tuple(tuple(r) for r in rows), forward, backward, m)


def _check_table(table: ScheduleTable) -> None:
    """validate, both dry runs and runs_forwards_first: each works or raises ScheduleError, and a
    table that validates also runs ready-first, and its text and JSON read back to it."""
    valid = {}
    for in_order in (True, False):
        _, error = outcome(lambda o=in_order: validate_table(table, in_order=o), ScheduleError)
        valid[in_order] = error is None
        order, error = outcome(lambda o=in_order: dry_run(table, in_order=o), ScheduleError)
        if valid[in_order]:
            assert error is None and sorted(order) == sorted(table.tasks())
        answer, _ = outcome(lambda o=in_order: runs_forwards_first(table, in_order=o), ScheduleError)
        assert answer in (True, False, None)
    if valid[True]:
        assert valid[False]
        text = table.to_text()
        assert (
            ScheduleTable.from_text(text, table.forward, table.backward, table.num_microbatches, table.policy)
            == table
        )
        assert ScheduleTable.from_json(table.to_json()) == table


@fuzz(80)
@given(tables())
@example(ScheduleTable(((Task("F", 0, 0),),), Partition((0, 1)), Partition((0, 1)), 10**9))  # found: hang
@example(ScheduleTable(((Task("F", "0", 0),),), Partition((0, 1)), Partition((0, 1)), 1))  # TypeError
@example(ScheduleTable((("F0.0",),), Partition((0, 1)), Partition((0, 1)), 1))  # found: AttributeError
@example(ScheduleTable((5,), Partition((0, 1)), Partition((0, 1)), 1))  # found: TypeError
@example(ScheduleTable(((),), (0, 1), Partition((0, 1)), 1))  # found: AttributeError
def test_schedule_tables_validate_or_raise_schedule_error(table):
    _check_table(table)


@fuzz(30)
@given(
    st.sampled_from([*POLICIES, "nope", None]),
    st.integers(1, 5),
    st.integers(-1, 4),
    st.integers(-1, 5),
    st.dictionaries(
        st.sampled_from(["start_device", "round_size", "virtual_stages", "waves", "bogus"]),
        st.none() | st.integers(-1, 4) | st.text(max_size=2),
        max_size=2,
    ),
)
def test_policy_tables_build_or_raise_schedule_error(policy, layers, devices, microbatches, options):
    part = Partition.per_layer(layers)
    table, _ = outcome(
        lambda: build_table(policy, part, part, devices, microbatches, **options), ScheduleError
    )
    if table is not None:
        _check_table(table)


TEXT_BITS = ["d0:", "d1:", "d2:", "d³:", "dx:", "d0", " ", "\n", "F0.0", "F1.0", "B0.0", "B1.1", "I0.0"]
TEXT_BITS += ["W0.0", "F٣.0", "X0.0", "F0", "F-1.0", ":", "F0.0.0"]


@fuzz(50)
@given(
    st.one_of(
        st.lists(st.sampled_from(TEXT_BITS), max_size=12).map(" ".join),
        st.text(max_size=20),
        st.none(),
    ),
    st.one_of(
        st.text(max_size=30),
        st.builds(json.dumps, values),
        st.builds(  # a good table's JSON with one field replaced
            lambda key, value: json.dumps({**_GOOD.to_dict(), key: value}),
            st.sampled_from(
                ["format", "forward", "backward", "devices", "num_microbatches", "options", "policy"]
            ),
            values,
        ),
        st.just("[" * 100_000),  # found: RecursionError
        st.just(json.dumps({**_GOOD.to_dict(), "num_microbatches": math.inf})),  # found: OverflowError
        st.just(json.dumps({**_GOOD.to_dict(), "devices": [[1]]})),  # found: AttributeError
    ),
)
@example("d³: F0.0", "{}")  # found: bare ValueError from int("³")
def test_schedule_text_and_json_parse_or_raise_schedule_error(text, data):
    part = Partition.per_layer(2)
    for parse in (
        lambda: ScheduleTable.from_text(text, part, part, 2),
        lambda: ScheduleTable.from_json(data),
    ):
        table, _ = outcome(parse, ScheduleError)
        if table is not None:
            _check_table(table)


# =================================================================================================
# 4. RunConfig values

# Valid values worth combining, beyond what a setting's declaration already says (its default and
# its choices): a setting without an entry here is fuzzed with those alone, so adding one to
# RunConfig needs no edit here.
MORE_GOOD_VALUES = {
    "devices": ["auto", "cpu:2", "cuda:0,1"],
    "num_microbatches": ["auto", 1, 4],
    "policy": ["auto", "roundpipe", "1f1b", "gpipe", "interleaved", "zb"],
    "dtype": ["fp32", "bf16", "fp16"],
    "order": ["strict", "ready"],
    "nan_policy": ["stop", "skip"],
    "optimizer_mode": ["sync", "async"],
    "device_capacity": [None, 1 << 30, 2.5e9],
    "head_chunk_tokens": [1, 1024],
    "head_shards": [1, 4],
    "prefetch": [True, False],
    "copy_chunk_bytes": [1 << 20],
    "weight_cache_bytes": [None, 0, 1 << 20],
    "data_parallel": ["auto", "off"],
    "optimizer_sharding": ["none", "nodes"],
    "dp_timeout_s": [1, 300.0],
    "dp_bucket_bytes": [1, 25 << 20],
    "watchdog_s": [1, 300.0, math.inf],
    "sanitize": [None, True, False],
    "seed": [0, 7],
    "policy_options": [{}, {"virtual_stages": 2}, {"round_size": 2}, {"start_device": 1}],
    "round_size": [None, 2],
    "partition": ["auto", None, (1, 2), [2, 2]],
    "backward_partition": [None, (1, 1, 1)],
    "schedule": [None, _GOOD],
    "host_memory": ["arena", "pinned", "pageable"],
    "fp16_accumulation": [False, True],
    "verify_model": [True, False],
}


def _declared_values(f: dataclasses.Field) -> list:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return [default, *(c for c in f.metadata["choices"] if c != default)]


GOOD_VALUES = {
    f.name: MORE_GOOD_VALUES.get(f.name) or _declared_values(f)
    for f in dataclasses.fields(roundpipe.RunConfig)
}
assert set(MORE_GOOD_VALUES) <= set(GOOD_VALUES), "an entry names no RunConfig setting"
junk_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(-1, 4) | st.text(max_size=1), max_size=3),
    st.lists(st.integers(1, 3), max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=4) | st.integers(0, 2), st.integers(0, 3), max_size=2),
    st.builds(object),
    st.just(b"fp32"),
    st.frozensets(st.integers(0, 2), max_size=2),
)


@st.composite
def run_config_kwargs(draw) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(GOOD_VALUES)), max_size=6, unique=True))
    return {
        name: draw(st.sampled_from(GOOD_VALUES[name]) if draw(st.integers(0, 2)) else junk_values)
        for name in names
    }


@fuzz(80)
@given(run_config_kwargs())
@example({"policy": []})  # found: bare TypeError (unhashable, looked up in a dict)
@example({"device_capacity": "1GB"})  # found: bare TypeError
@example({"watchdog_s": None})  # found: bare TypeError
@example({"watchdog_s": math.nan})  # found: accepted, a watchdog that never fires
@example({"partition": 5})  # found: bare TypeError
@example({"partition": {1: 2}})  # found: accepted, a dict as the partition
@example({"schedule": 5, "num_microbatches": 2})  # found: bare AttributeError
@example({"policy_options": [1]})  # found: bare TypeError
@example({"policy_options": {1: 2, "a": 3}})  # found: bare TypeError (sorting mixed keys)
@example({"round_size": 2, "policy_options": ["round_size"]})  # found: bare AttributeError
def test_run_configs_construct_or_raise_config_error(kwargs):
    config, _ = outcome(lambda: roundpipe.RunConfig(**kwargs), ConfigError)
    if config is None:
        return
    assert config.num_microbatches == "auto" or (
        isinstance(config.num_microbatches, int) and config.num_microbatches >= 1
    )
    for sizes in (config.partition, config.backward_partition):
        assert sizes in (None, "auto") or (isinstance(sizes, tuple) and all(n >= 1 for n in sizes))
    assert isinstance(config.policy_options, dict) and all(isinstance(k, str) for k in config.policy_options)
    assert config.watchdog_s > 0
    assert config.schedule is None or isinstance(config.schedule, ScheduleTable)


# =================================================================================================
# 5. Batches given to Pipeline.forward_backward

VOCAB = 256  # tiny_models.VOCAB
INT_DTYPES = [torch.int64, torch.int64, torch.int32]
ANY_DTYPES = [*INT_DTYPES, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool]


@pytest.fixture(scope="module")
def pipe():
    from support.tiny_models import make_model

    pipe = roundpipe.wrap(make_model("llama", num_layers=1), roundpipe.RunConfig(devices="cpu:1"))
    pipe.configure_optimizer(lr=1e-3)
    _still_trains(pipe)  # the first batch profiles the layers and makes the automatic choices
    yield pipe
    pipe.close()


def _still_trains(pipe) -> None:
    from support.tiny_models import make_batch

    batch = make_batch(batch=2, seq=6)
    out = pipe.forward_backward(batch["input_ids"], batch["labels"], batch["attention_mask"])
    pipe.step()
    assert math.isfinite(out.loss) and out.num_tokens > 0


@st.composite
def tensors(draw, shape, values, dtypes):
    dtype = draw(st.sampled_from(dtypes))
    data = draw(st.lists(values, min_size=math.prod(shape), max_size=math.prod(shape)))
    return torch.tensor(data, dtype=torch.int64).reshape(shape).to(dtype)


ids = st.integers(0, VOCAB - 1)
bad_ids = st.sampled_from([-1, VOCAB, VOCAB + 9, 2**40])
label_values = st.sampled_from([-100, -100]) | st.integers(0, VOCAB - 1)
bad_labels = st.sampled_from([-1, -7, -101, VOCAB, 2**40])
FAULTS = [
    "ids dtype", "ids shape", "empty", "ids range", "labels shape", "labels dtype", "labels range",
    "labels missing", "labels no tensor", "all ignored", "mask shape", "mask dtype", "mask values",
    "positions", "requires grad", "loss_tokens", "accumulate",
]  # fmt: skip


@st.composite
def batches(draw) -> dict:
    """A good batch (``[B, T]`` int ids in the vocabulary, labels with -100, a 0/1 mask), with up
    to three faults: ids of another dtype (float, bool, int16, ...) or shape (1-D, 3-D, empty),
    ids or labels outside the vocabulary (negative labels other than -100), labels and mask of
    another shape or dtype or no tensor at all, mask values other than 0/1, position ids of any
    kind, float tensors that require grad, odd ``loss_tokens``."""
    b, t = draw(st.integers(1, 3)), draw(st.integers(2, 6))
    count = draw(st.sampled_from([0, 1, 1, 1, 2, 3]))
    faults = draw(st.lists(st.sampled_from(FAULTS), min_size=count, max_size=count, unique=True))
    shape = (b, t)
    if "ids shape" in faults:
        shape = draw(st.sampled_from([(t,), (1, b, t), (b, t, 1), ()]))
    if "empty" in faults:
        shape = draw(st.sampled_from([(0, t), (b, 0), (0, 0)]))
    like = shape
    if "labels shape" in faults:
        like = draw(st.sampled_from([(b, t + 1), (b + 1, t), (t, b), (b * t,)]))
    dtype = (
        draw(st.sampled_from(ANY_DTYPES[3:])) if "ids dtype" in faults else draw(st.sampled_from(INT_DTYPES))
    )
    batch = {"input_ids": draw(tensors(shape, bad_ids if "ids range" in faults else ids, [dtype]))}
    labels = draw(
        tensors(like, bad_labels | label_values if "labels range" in faults else label_values, [torch.int64])
    )
    if "all ignored" in faults:
        labels = torch.full(like, -100)
    if "labels dtype" in faults:
        labels = labels.to(draw(st.sampled_from([torch.int32, torch.float32, torch.bool, torch.int16])))
    if "labels missing" in faults:
        labels = None
    if "labels no tensor" in faults:
        labels = draw(st.sampled_from([[[1, 2]], 3, "labels", labels.tolist() if labels is not None else []]))
    batch["labels"] = labels
    mask_like = draw(st.sampled_from([(b + 1, t), (b, t - 1)])) if "mask shape" in faults else like
    if draw(st.booleans()) or {"mask shape", "mask dtype", "mask values"} & set(faults):
        values = st.sampled_from([0, 1, 2, -1]) if "mask values" in faults else st.sampled_from([1, 1, 1, 0])
        mask_dtype = (
            torch.int64 if "mask dtype" not in faults else draw(st.sampled_from([torch.bool, torch.float32]))
        )
        batch["attention_mask"] = draw(tensors(mask_like, values, [mask_dtype]))
    if "positions" in faults:
        batch["position_ids"] = draw(
            st.sampled_from([torch.arange(t)[None], torch.arange(t).repeat(b, 1), torch.arange(t), [0, 1]])
            | tensors((1, t), st.integers(-3, 10**6), [torch.int64, torch.float32])
        )
    if "requires grad" in faults:
        for name in ("input_ids", "labels", "attention_mask"):
            value = batch.get(name)
            if torch.is_tensor(value) and draw(st.booleans()):
                batch[name] = value.float().requires_grad_()
    if "loss_tokens" in faults:
        batch["loss_tokens"] = draw(st.integers(-1, 100) | st.sampled_from([None, "7", 2.5]))
    if "accumulate" in faults:
        batch["accumulate"] = True
    return batch


def _mb(shape, labels=None, **extra):
    return {"input_ids": torch.ones(shape, dtype=torch.long), "labels": labels, **extra}


@fuzz(10)
@given(batches())
@example(_mb((0, 6), torch.ones(0, 6, dtype=torch.long)))  # found: bare RuntimeError from min()
@example(_mb((2, 0), torch.ones(2, 0, dtype=torch.long)))  # found: bare RuntimeError from min()
@example(_mb((2, 6), torch.ones(2, 6, dtype=torch.long), position_ids=[0, 1]))  # found: AttributeError
@example(_mb((2, 6), torch.ones(2, 6, dtype=torch.long, device="meta")))  # found: RuntimeError
@example(_mb((2, 6), torch.ones(2, 6, dtype=torch.long), attention_mask=torch.zeros(2, 6)))
@example({"input_ids": torch.ones(2, 6), "labels": torch.ones(2, 6).requires_grad_()})
@example(_mb((2, 6), torch.ones(2, 6).requires_grad_(), attention_mask=torch.ones(2, 6).requires_grad_()))
@example(_mb((2, 6), torch.full((2, 6), -7)))
@example(_mb((2, 6), torch.ones(2, 6, dtype=torch.long), attention_mask=torch.full((2, 6), 2)))
@example(_mb((2, 6), torch.ones(2, 6, dtype=torch.long), position_ids=torch.rand(1, 6) * 1e6))
def test_batches_train_or_raise_input_error_and_the_pipeline_goes_on(pipe, batch):
    out, _ = outcome(lambda: pipe.forward_backward(**batch), InputError)
    if out is not None:
        pipe.step()
    with bounded():
        _still_trains(pipe)
