"""The data formats people already have: ShareGPT, OpenAI-style messages (system prompts, tool calls),
Alpaca, plain text; datasets saved with ``save_to_disk``, directories of Parquet or Arrow files. Each
reads into the same samples as its plain equivalent, and trains through ``roundpipe train``."""

import torch

torch.set_num_threads(1)

import json  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from roundpipe.errors import DataError  # noqa: E402
from roundpipe.train.config import DataConfig  # noqa: E402
from roundpipe.train.data import IGNORE, load_data  # noqa: E402
from roundpipe.train.tokenizer import byte_tokenizer  # noqa: E402

CHATS = [
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "times 4?"},
        {"role": "assistant", "content": "20"},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
]
SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}

# A chat template that renders OpenAI tool calls, tool results and tool definitions (as Qwen's and
# Llama 3.1's do), on the byte tokenizer's role headers.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<call>{{ c['function'] | tojson }}</call>{% endfor %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte():
    return byte_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def sharegpt(chat):
    return [{"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]} for m in chat]


def learned(tokenizer, sample):
    """The learned tokens, as text (each run of learned tokens on its own)."""
    runs, run = [], []
    for token, label in zip(sample.input_ids, sample.labels):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run)), run.clear()
    return runs + ([tokenizer.decode(run)] if run else [])


def test_sharegpt_reads_as_the_same_conversation_in_openai_messages(byte, tmp_path):
    openai = write_jsonl(tmp_path / "o.jsonl", [{"messages": c} for c in CHATS])
    shared = write_jsonl(tmp_path / "s.jsonl", [{"conversations": sharegpt(c)} for c in CHATS])
    want = load_data(DataConfig(train=openai, format="chat"), byte, seed=0).train
    got = load_data(DataConfig(train=shared, format="sharegpt"), byte, seed=0).train
    assert got == want and len(got) == 2
    # A record-level system prompt (LLaMA-Factory's `system` column) is the same as a system turn.
    lifted = write_jsonl(
        tmp_path / "l.jsonl",
        [{"system": CHATS[0][0]["content"], "conversations": sharegpt(CHATS[0][1:])}],
    )
    assert load_data(DataConfig(train=lifted, format="sharegpt"), byte, seed=0).train == want[:1]


def test_sharegpt_role_names_are_mapped_and_unknown_ones_counted(byte, tmp_path):
    records = [
        {"conversations": [{"from": "Human", "value": "q"}, {"from": "ChatGPT", "value": "16"}]},
        {"conversations": [{"from": "user", "value": "q"}, {"from": "model", "value": 16}]},
        {"conversations": [{"from": "narrator", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    splits = load_data(
        DataConfig(train=write_jsonl(tmp_path / "s.jsonl", records), format="sharegpt"), byte, seed=0
    )
    assert [learned(byte, s) for s in splits.train] == [["16</s>"], ["16</s>"]]
    assert set(splits.report.skipped) == {
        "unknown ShareGPT role 'narrator' (known: "
        + ", ".join(
            ["system", "human", "user", "gpt", "assistant", "model", "bot", "chatgpt", "function_call"]
            + ["tool", "function", "observation", "function_response", "ipython"]
        )
        + ")",
        "malformed message (each needs a string 'from' and 'value')",
    }


def test_openai_messages_keep_the_system_prompt_and_learn_only_the_answers(byte, tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": CHATS[0]}])
    sample = load_data(DataConfig(train=path, format="chat"), byte, seed=0).train[0]
    assert byte.decode(sample.input_ids, skip_special_tokens=True).startswith(
        "<|system|>\nAnswer with a number.\n<|user|>\n2 + 3?\n<|assistant|>\n5"
    )
    assert learned(byte, sample) == ["5</s>", "20</s>"]


def test_openai_content_given_as_text_parts_reads_as_its_text(byte, tmp_path):
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    chat = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
    ]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, CHATS[1][1]]
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": chat}, {"messages": image}])
    splits = load_data(DataConfig(train=path, format="chat"), byte, seed=0)
    plain = load_data(
        DataConfig(train=write_jsonl(tmp_path / "q.jsonl", [{"messages": CHATS[1]}]), format="chat"),
        byte,
        seed=0,
    )
    assert splits.train == plain.train
    assert splits.report.skipped == {"malformed message (each needs a string 'role' and 'content')": 1}


TOOL_CHAT = {
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    "messages": [
        {"role": "user", "content": "2 + 3?"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ],
}


def test_tool_calls_train_where_the_template_renders_them_and_are_counted_where_not(byte, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [TOOL_CHAT, {"messages": CHATS[1]}])
    tools = byte_tokenizer()
    tools.chat_template = TOOL_TEMPLATE
    splits = load_data(DataConfig(train=path, format="chat"), tools, seed=0)
    assert len(splits.train) == 2
    sample = splits.train[0]
    assert '<|tools|>\n[{"type": "function", "function": {"name": "add"' in byte.decode(
        sample.input_ids, skip_special_tokens=True
    )
    assert learned(byte, sample) == [
        '<call>{"name": "add", "arguments": {"a": 2, "b": 3}}</call></s>',
        "It is 5.</s>",
    ]
    # The byte tokenizer's own template has no tool calls: the record is counted, not rendered bare.
    plain = load_data(DataConfig(train=path, format="chat"), byte, seed=0)
    assert len(plain.train) == 1
    assert plain.report.skipped == {"tool definitions, which the chat template does not render": 1}
    # ShareGPT's function_call / observation turns are the same conversation.
    turns = [
        {"from": "human", "value": "2 + 3?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "It is 5."},
    ]
    shared = write_jsonl(
        tmp_path / "s.jsonl", [{"conversations": turns, "tools": json.dumps(TOOL_CHAT["tools"])}]
    )
    assert load_data(DataConfig(train=shared, format="sharegpt"), tools, seed=0).train == [sample]


ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "16"},
    {"instruction": "Say hello.", "input": "", "output": "Hello there"},
]


def test_a_save_to_disk_dataset_and_parquet_or_arrow_directories_read_as_the_file(byte, tmp_path):
    import datasets

    want = load_data(DataConfig(train=write_jsonl(tmp_path / "a.jsonl", ALPACA)), byte, seed=0).train
    table = datasets.Dataset.from_list(ALPACA)
    table.save_to_disk(str(tmp_path / "saved"))
    assert load_data(DataConfig(train=str(tmp_path / "saved")), byte, seed=0).train == want
    (tmp_path / "pq").mkdir()
    pd.DataFrame(ALPACA[:2]).to_parquet(tmp_path / "pq" / "part-0.parquet")
    pd.DataFrame(ALPACA[2:]).to_parquet(tmp_path / "pq" / "part-1.parquet")
    splits = load_data(DataConfig(train=str(tmp_path / "pq")), byte, seed=0)
    assert splits.train == want and splits.report.files == {str(tmp_path / "pq"): 3}
    arrows = sorted((tmp_path / "saved").glob("*.arrow"))
    assert arrows
    (tmp_path / "ar").mkdir()
    (tmp_path / "ar" / "data.arrow").write_bytes(arrows[0].read_bytes())
    assert load_data(DataConfig(train=str(tmp_path / "ar")), byte, seed=0).train == want


def test_a_dataset_dict_or_a_mixed_directory_asks_which_to_read(byte, tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"splits train .*dd/train"):
        load_data(DataConfig(train=str(tmp_path / "dd")), byte, seed=0)
    assert len(load_data(DataConfig(train=str(tmp_path / "dd" / "train")), byte, seed=0).train) == 3
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ALPACA)
    pd.DataFrame(ALPACA).to_parquet(tmp_path / "mixed" / "b.parquet")
    with pytest.raises(DataError, match=r"mixed is a directory with files of the types \.jsonl, \.parquet"):
        load_data(DataConfig(train=str(tmp_path / "mixed")), byte, seed=0)


# --- each format trains through `roundpipe train` -----------------------------------------------

TINY_MODEL = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
}


def _sharegpt_file(tmp_path):
    return write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": sharegpt(c)} for c in CHATS * 4]), {
        "format": "sharegpt"
    }


def _openai_file(tmp_path):
    return write_jsonl(tmp_path / "openai.jsonl", [{"messages": c} for c in CHATS * 4]), {"format": "chat"}


def _saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_list(ALPACA * 3).save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved"), {"format": "instruction"}


def _two_files_mixed(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"first file {i}"} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"second file {i}"} for i in range(4)])
    return [a, {"path": b, "weight": 0.5}], {"format": "text"}


@pytest.mark.parametrize("make_data", [_sharegpt_file, _openai_file, _saved_dataset, _two_files_mixed])
def test_each_format_trains_through_roundpipe_train(tmp_path, capsys, make_data):
    from roundpipe.commands.train import main

    train, data_keys = make_data(tmp_path)
    recipe = {
        "model": {"config": TINY_MODEL, "tokenizer": "byte"},
        "data": {"train": train, "max_length": 128, **data_keys},
        "run": {"name": "fmt", "output_dir": str(tmp_path / "run"), "devices": "cpu:2", "batch_size": 4},
        "optim": {"lr": 1e-3},
        "logging": {"progress": False, "plots": False, "tensorboard": False},
    }
    recipe["run"].update(num_microbatches=2, max_steps=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    main([str(path)])
    out = capsys.readouterr().out
    assert "done: 2 steps" in out
    records = {"sharegpt": 8, "chat": 8, "instruction": 9, "text": 8}[data_keys["format"]]
    assert f"kept {records}, all for training" in out  # every record became a sample


# --- several files mixed by weight --------------------------------------------------------------


def test_files_are_mixed_by_weight_seeded_and_held_out_before_weighting(byte, tmp_path):
    from collections import Counter

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(4)])
    data = DataConfig(format="text", train=[{"path": a, "weight": 2}, {"path": b, "weight": 0.5}])
    splits = load_data(data, byte, seed=0)
    counts = Counter(byte.decode(s.input_ids, skip_special_tokens=True) for s in splits.train)
    assert {k: v for k, v in counts.items() if k.startswith("a")} == {f"a{i}": 2 for i in range(4)}
    picked = sorted(k for k in counts if k.startswith("b"))
    assert len(picked) == 2 and all(counts[k] == 1 for k in picked)
    assert splits.report.files == {a: 4, b: 4} and splits.report.read == 8
    assert f"mixed: {a} x2 -> 8 samples, {b} x0.5 -> 2 samples" in splits.report.summary()
    assert load_data(data, byte, seed=0).train == splits.train  # seeded
    held = load_data(DataConfig(format="text", eval_fraction=0.25, train=data.train), byte, seed=0)
    held_text = {byte.decode(s.input_ids, skip_special_tokens=True) for s in held.eval}
    train_text = {byte.decode(s.input_ids, skip_special_tokens=True) for s in held.train}
    assert len(held.eval) == 2 and not held_text & train_text  # one of each file, never trained on


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"train": [{"path": "a.jsonl", "weigth": 2}]},
            r"data.train\[0\]: unknown key weigth; an entry takes path, weight",
        ),
        (
            {"train": ["b.jsonl", {"path": "a.jsonl", "weight": 0}]},
            r"data.train\[1\].weight must be a number > 0, got 0",
        ),
        ({"train": [{"weight": 1}]}, r"data.train\[0\] needs a path"),
        ({"train": []}, "data.train is an empty list"),
        ({"train": ["a.jsonl"], "synthetic": "reverse"}, "data.train cannot be a list"),
    ],
)
def test_a_bad_files_entry_is_a_recipe_error_naming_it(data, message):
    from roundpipe.errors import RecipeError
    from roundpipe.train.recipe import config_from_dict

    recipe = {"model": {"config": TINY_MODEL}, "data": data}
    with pytest.raises(RecipeError, match=message):
        config_from_dict(recipe)


# --- a named chat template for a tokenizer without one ------------------------------------------


def test_a_named_template_serves_a_tokenizer_without_one_and_never_overrides_the_models(byte, tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": CHATS[0]}])
    bare = byte_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match="data.chat_template: chatml"):
        load_data(DataConfig(train=path, format="chat"), bare, seed=0)
    splits = load_data(DataConfig(train=path, format="chat", chat_template="chatml"), bare, seed=0)
    sample = splits.train[0]
    assert bare.decode(sample.input_ids, skip_special_tokens=True).startswith(
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    assert learned(bare, sample) == ["5<|im_end|>\n", "20<|im_end|>\n</s>"]
    assert "<|im_start|>" in bare.chat_template  # the tokenizer carries it on, so an export saves it
    llama = byte_tokenizer()
    llama.chat_template = None
    sample = load_data(DataConfig(train=path, format="chat", chat_template="llama3"), llama, seed=0).train[0]
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>" in llama.decode(sample.input_ids)
    # The model's own template wins, and the report says the named one went unused.
    own = load_data(DataConfig(train=path, format="chat", chat_template="chatml"), byte, seed=0)
    assert own.train == load_data(DataConfig(train=path, format="chat"), byte, seed=0).train
    assert (
        "data.chat_template chatml is not used: the tokenizer has its own chat template"
        in own.report.summary()
    )


@pytest.mark.parametrize("name", ["chatml", "qwen", "llama3", "mistral", "gemma"])
def test_every_named_template_learns_exactly_the_answers(tmp_path, name):
    tool_turn = [*CHATS[1][:1], {"role": "tool", "content": "x"}, CHATS[1][1]]
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": c} for c in [*CHATS, tool_turn]])
    bare = byte_tokenizer()
    bare.chat_template = None
    splits = load_data(DataConfig(train=path, format="chat", chat_template=name), bare, seed=0)
    answers = [[bare.decode(t, skip_special_tokens=True) for t in learned_ids(s)] for s in splits.train[:2]]
    assert [[a.strip() for a in sample] for sample in answers][0][0].startswith("5")
    assert [len(a) for a in answers] == [2, 1]
    assert answers[0][1].startswith("20") and answers[1][0].startswith("hi")
    system_shown = "Answer with a number." in bare.decode(splits.train[0].input_ids)
    assert system_shown  # the system prompt is never dropped, even where the template folds it in
    # A role the template has no place for is counted, not dropped from the conversation unsaid.
    if name in ("mistral", "gemma"):
        assert len(splits.train) == 2 and [*splits.report.skipped][0].startswith("chat template error")
    else:
        assert len(splits.train) == 3 and not splits.report.skipped


def learned_ids(sample):
    runs, run = [], []
    for token, label in zip(sample.input_ids, sample.labels):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def test_an_empty_tool_calls_list_is_no_tool_call(byte, tmp_path):
    """OpenAI exports write ``"tool_calls": []`` (or null) on plain answers: they train as plain answers."""
    chat = [CHATS[1][0], {**CHATS[1][1], "tool_calls": []}]
    nulled = [CHATS[1][0], {**CHATS[1][1], "tool_calls": None}]
    path = write_jsonl(
        tmp_path / "e.jsonl", [{"messages": chat}, {"messages": nulled}, {"messages": CHATS[1]}]
    )
    splits = load_data(DataConfig(train=path, format="chat"), byte, seed=0)
    assert len(splits.train) == 3 and splits.train[0] == splits.train[1] == splits.train[2]
