"""Training data: files of every type and format -> Samples -> batches; every bad record accounted for."""

import torch

torch.set_num_threads(1)

import json  # noqa: E402
import random  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from roundpipe.errors import CheckpointError, DataError, RecipeError  # noqa: E402
from roundpipe.train.batches import Batches, eval_batches  # noqa: E402
from roundpipe.train.config import DataConfig, ModelConfig  # noqa: E402
from roundpipe.train.data import IGNORE, Sample, load_data  # noqa: E402
from roundpipe.train.tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_tokenizer, load_tokenizer  # noqa: E402

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue"},
    {"instruction": "Say hello.", "input": "", "output": "Hello there"},
    {"instruction": "Reverse the word.", "input": "stop", "output": "pots"},
]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "what is two plus three? it is five",
    "hello there, how are you today?",
    "you are a helpful assistant that answers briefly",
    "the capital of france is paris",
]


@pytest.fixture(scope="module")
def byte():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A small BPE tokenizer trained here, with a role-based chat template and no pad token."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(SENTENCES * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(ModelConfig(path=None, config=None, tokenizer=bpe_dir))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def cfg(train, **kw):
    return DataConfig(train=str(train), **kw)


def text_of(tokenizer, ids):
    return tokenizer.decode([i for i in ids if i != IGNORE])


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_maps_bytes_to_ids_and_round_trips_utf8(byte):
    assert (len(byte), byte.pad_token_id, byte.bos_token_id, byte.eos_token_id) == (
        259,
        PAD_ID,
        BOS_ID,
        EOS_ID,
    )
    assert byte("aé", add_special_tokens=False)["input_ids"] == [97, 0xC3, 0xA9]
    text = "naïve café — 日本語 ✓\n\ttabs and 🙂"
    ids = byte(text)["input_ids"]
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert byte.decode(ids, skip_special_tokens=True) == text


def test_byte_tokenizer_saves_and_loads_back(byte, tmp_path):
    byte.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Grüße, 世界"
    assert loaded(text)["input_ids"] == byte(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (PAD_ID, EOS_ID, 259)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == byte.apply_chat_template(chat, tokenize=False)
    via_recipe = load_tokenizer(ModelConfig(path=None, config=None, tokenizer=str(tmp_path)))
    assert via_recipe(text)["input_ids"] == byte(text)["input_ids"]


def test_load_tokenizer_gives_bytes_for_byte_or_a_config_model():
    assert len(load_tokenizer(ModelConfig(tokenizer="byte"))) == 259
    assert len(load_tokenizer(ModelConfig(config={"model_type": "llama"}))) == 259


def test_load_tokenizer_errors_say_what_to_set(tmp_path):
    with pytest.raises(RecipeError, match="not a directory"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "nowhere")))
    with pytest.raises(RecipeError, match="model.path.*cannot load a tokenizer"):
        load_tokenizer(ModelConfig(path=str(tmp_path)))  # a directory without tokenizer files
    with pytest.raises(RecipeError, match="set model.tokenizer"):
        load_tokenizer(ModelConfig())


def test_load_tokenizer_pads_with_eos_when_the_tokenizer_has_no_pad(bpe):
    assert bpe.pad_token_id is not None and bpe.pad_token_id == bpe.eos_token_id


# --- formats ------------------------------------------------------------------------------------


def test_text_format_learns_every_token_and_ends_with_eos(byte, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": "déf"}])
    splits = load_data(cfg(path, format="text"), byte, seed=0)
    first = splits.train[0]
    assert first == Sample((BOS_ID, 97, 98, 99, EOS_ID), (BOS_ID, 97, 98, 99, EOS_ID), 0)
    no_eos = load_data(cfg(path, format="text", add_eos=False), byte, seed=0).train[1]
    assert no_eos.input_ids == (BOS_ID, *"déf".encode())


def test_instruction_format_masks_the_prompt_and_learns_answer_and_eos(bpe, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA[:2])
    data = cfg(path, format="instruction")
    with_input, no_input = load_data(data, bpe, seed=0).train
    prompt = bpe.decode(with_input.input_ids[: with_input.prompt_len])
    assert prompt == "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    assert bpe.decode(no_input.input_ids[: no_input.prompt_len]).endswith("Name a colour.\n\n### Response:\n")
    for sample, answer in ((with_input, "5"), (no_input, "Blue")):
        assert all(label == IGNORE for label in sample.labels[: sample.prompt_len])
        expected = bpe(answer, add_special_tokens=False)["input_ids"] + [bpe.eos_token_id]
        assert list(sample.labels[sample.prompt_len :]) == expected
        assert list(sample.input_ids[sample.prompt_len :]) == expected
    everything = load_data(cfg(path, format="instruction", train_on_prompt=True), bpe, seed=0).train[0]
    assert everything.labels == everything.input_ids


def test_instruction_template_fills_only_its_own_placeholders(byte, tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl", [{"instruction": "echo {input} {x}", "input": "", "output": "ok"}]
    )
    data = cfg(path, prompt_template_no_input="Q: {instruction} {json: 1}\nA: ")
    sample = load_data(data, byte, seed=0).train[0]
    assert byte.decode(sample.input_ids[: sample.prompt_len], skip_special_tokens=True) == (
        "Q: echo {input} {x} {json: 1}\nA: "
    )


def test_chat_labels_are_exactly_the_assistant_tokens(bpe, tmp_path):
    chat = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is two plus three?"},
        {"role": "assistant", "content": "it is five"},
        {"role": "user", "content": "the capital of france?"},
        {"role": "assistant", "content": "paris"},
        {"role": "user", "content": "thanks"},  # after the last answer: dropped
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    sample = load_data(cfg(path, format="chat"), bpe, seed=0).train[0]
    eos = bpe.eos_token_id
    learned = [label for label in sample.labels if label != IGNORE]
    expected = []
    for answer in ("it is five", "paris"):
        expected += bpe(answer, add_special_tokens=False)["input_ids"] + [eos]
    assert learned == expected
    rendered = bpe.apply_chat_template(chat[:5], tokenize=False)
    assert list(sample.input_ids) == bpe(rendered, add_special_tokens=False)["input_ids"]
    assert bpe.decode(sample.input_ids[sample.prompt_len :]) == "paris</s>"
    assert bpe.decode(sample.input_ids[: sample.prompt_len]).endswith(
        "<|user|>the capital of france?<|assistant|>"
    )
    whole = load_data(cfg(path, format="chat", train_on_prompt=True), bpe, seed=0).train[0]
    assert whole.labels == whole.input_ids == sample.input_ids


def test_chat_with_the_byte_tokenizer_learns_the_answer_and_its_eos(byte, tmp_path):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    sample = load_data(cfg(path, format="chat"), byte, seed=0).train[0]
    assert sample.input_ids[sample.prompt_len :] == (ord("4"), EOS_ID)  # the template's eos, not a second
    assert [label for label in sample.labels if label != IGNORE] == [ord("4"), EOS_ID]


# --- file types ---------------------------------------------------------------------------------


def _write(kind, path, records):
    if kind == "jsonl":
        write_jsonl(path, records)
    elif kind == "json":
        path.write_text(json.dumps(records), encoding="utf-8")
    elif kind == "csv":
        pd.DataFrame(records).to_csv(path, index=False)
    elif kind == "parquet":
        pd.DataFrame(records).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_every_file_type_gives_the_same_samples(byte, tmp_path, kind):
    reference = load_data(cfg(_write("jsonl", tmp_path / "ref.jsonl", ALPACA)), byte, seed=0).train
    path = _write(kind, tmp_path / f"data.{kind}", ALPACA)
    splits = load_data(cfg(path), byte, seed=0)
    assert splits.train == reference
    assert splits.report.read == splits.report.kept == len(ALPACA)


def test_csv_cells_stay_text(byte, tmp_path):
    path = tmp_path / "n.csv"
    path.write_text(
        'instruction,input,output\nWhat is 6*7?,,42\nSay NA,,NA\n"two\nlines",,None\n', encoding="utf-8"
    )
    samples = load_data(cfg(path), byte, seed=0).train
    answers = [byte.decode(s.input_ids[s.prompt_len :], skip_special_tokens=True) for s in samples]
    assert answers == ["42", "NA", "None"]


def test_chat_messages_read_from_parquet(byte, tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = _write("parquet", tmp_path / "c.parquet", [{"messages": chat}])
    sample = load_data(cfg(path, format="chat"), byte, seed=0).train[0]
    assert byte.decode(sample.input_ids[sample.prompt_len :], skip_special_tokens=True) == "hello"


def test_txt_file_is_one_sample_per_line_and_skips_blank_lines(byte, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\n\n   \nsecond ü\n", encoding="utf-8")
    splits = load_data(cfg(path, format="text"), byte, seed=0)
    assert [byte.decode(s.input_ids, skip_special_tokens=True) for s in splits.train] == [
        "first line",
        "second ü",
    ]
    assert splits.report.read == 2


def test_txt_file_with_another_format_is_refused(byte, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x\n", encoding="utf-8")
    with pytest.raises(DataError, match="only data.format: text"):
        load_data(cfg(path, format="instruction"), byte, seed=0)


def test_unknown_extension_asks_for_file_type(byte, tmp_path):
    path = tmp_path / "data.dat"
    path.write_text('{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="data.file_type"):
        load_data(cfg(path, format="text"), byte, seed=0)
    assert len(load_data(cfg(path, format="text", file_type="jsonl"), byte, seed=0).train) == 1


# --- bad data -----------------------------------------------------------------------------------


def test_missing_file_names_the_path(byte, tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DataError, match="absent.jsonl"):
        load_data(cfg(path), byte, seed=0)
    good = write_jsonl(tmp_path / "good.jsonl", ALPACA)
    with pytest.raises(DataError, match="eval_absent.jsonl"):
        load_data(cfg(good, eval=str(tmp_path / "eval_absent.jsonl")), byte, seed=0)


@pytest.mark.parametrize(
    "name, content", [("e.jsonl", ""), ("w.jsonl", "\n  \n"), ("l.json", "[]"), ("b.txt", "\n\n")]
)
def test_empty_file_names_the_file(byte, tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=f"{name}.*(empty|no records)"):
        load_data(cfg(path, format="text"), byte, seed=0)


def test_unparseable_json_names_the_file(byte, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.jsonl:2: not valid JSON \(Expecting value at column 10\)"):
        load_data(cfg(path, format="text"), byte, seed=0)
    listed = tmp_path / "broken.json"
    listed.write_text('[{"text": "a"},\n {"text": }]', encoding="utf-8")
    with pytest.raises(
        DataError, match=r"broken\.json: not valid JSON \(Expecting value at line 2, column 11\)"
    ):
        load_data(cfg(listed, format="text"), byte, seed=0)


def test_non_utf8_bytes_name_the_file_and_line(byte, tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin.jsonl line 2.*not UTF-8"):
        load_data(cfg(path, format="text"), byte, seed=0)
    csv_path = tmp_path / "latin.csv"
    csv_path.write_bytes(b"text\nok\nok\nna\xefve\n")
    with pytest.raises(DataError, match=r"latin.csv line 4"):
        load_data(cfg(csv_path, format="text"), byte, seed=0)


def test_record_missing_a_field_is_counted_not_lost(byte, tmp_path):
    records = [
        *ALPACA,
        {"instruction": "No answer here."},
        {"instruction": "Null answer.", "output": None},
        {"instruction": "Blank answer.", "output": "  "},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", records)
    splits = load_data(cfg(path), byte, seed=0)
    report = splits.report
    assert len(splits.train) == len(ALPACA)
    assert report.skipped == {"missing field 'output'": 2, "empty field 'output'": 1}
    assert report.read == report.kept + sum(report.skipped.values()) == 7
    assert "skipped 2: missing field 'output' (e.g. a.jsonl line 5, a.jsonl line 6)" in report.summary()


def test_every_record_missing_the_field_says_which_and_what_the_file_has(byte, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "response": "a"}] * 3)
    with pytest.raises(DataError) as caught:
        load_data(cfg(path), byte, seed=0)
    message = str(caught.value)
    assert "missing field 'output' (3)" in message
    assert "'instruction', 'response'" in message and "data.output_field" in message


@pytest.mark.parametrize("policy", ["skip", "truncate", "error"])
def test_too_long_sample_follows_the_policy(byte, tmp_path, policy):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "short"}, {"text": "x" * 40}])
    data = cfg(path, format="text", max_length=16, too_long=policy)
    if policy == "error":
        with pytest.raises(DataError, match="t.jsonl line 2 has 42 tokens.*max_length=16"):
            load_data(data, byte, seed=0)
        return
    splits = load_data(data, byte, seed=0)
    if policy == "skip":
        assert len(splits.train) == 1 and splits.report.skipped == {"longer than max_length (16 tokens)": 1}
    else:
        assert [len(s.input_ids) for s in splits.train] == [7, 16] and splits.report.truncated == 1
        assert splits.train[1].input_ids == (BOS_ID, *b"x" * 15)


def test_truncation_that_leaves_no_answer_is_a_counted_skip(byte, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [ALPACA[0], {"instruction": "y" * 100, "output": "z"}])
    splits = load_data(cfg(path, max_length=100, too_long="truncate"), byte, seed=0)
    assert len(splits.train) == 1 and splits.report.truncated == 0
    assert splits.report.skipped == {"prompt longer than max_length (100 tokens)": 1}


def test_bad_chats_are_counted_skips(byte, tmp_path):
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    records = [
        {"messages": good},
        {"messages": [{"role": "user", "content": "anyone?"}]},  # no assistant turn
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},  # no content
        {"messages": [{"content": "who am I"}, {"role": "assistant", "content": "x"}]},  # no role
        {"messages": "not a list"},
        {"other": 1},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    splits = load_data(cfg(path, format="chat"), byte, seed=0)
    assert len(splits.train) == 1
    assert splits.report.skipped == {
        "no assistant turn": 1,
        "malformed message (each needs a string 'role' and 'content')": 2,
        "field 'messages' is not a list of messages": 1,
        "missing field 'messages'": 1,
    }
    assert splits.report.read == 6


def test_chat_needs_a_chat_template(bpe_dir, tmp_path):
    plain = AutoTokenizer.from_pretrained(bpe_dir)
    plain.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(DataError, match="chat template"):
        load_data(cfg(path, format="chat"), plain, seed=0)


# --- held-out split -----------------------------------------------------------------------------


def test_held_out_split_is_disjoint_seeded_and_keeps_duplicates_together(byte, tmp_path):
    records = [{"text": f"sample {i}"} for i in range(40)] + [{"text": "twin"}] * 3
    path = write_jsonl(tmp_path / "t.jsonl", records)
    data = cfg(path, format="text", eval_fraction=0.25)
    first, again, other = (load_data(data, byte, seed=s) for s in (7, 7, 8))
    assert (
        11 <= len(first.eval) <= 13 and len(first.train) + len(first.eval) == 43
    )  # 25%, or a twin group more
    train_ids = {s.input_ids for s in first.train}
    assert not train_ids & {s.input_ids for s in first.eval}
    twin = byte("twin")["input_ids"] + [EOS_ID]
    assert sum(list(s.input_ids) == twin for s in first.train) in (0, 3)
    assert first.eval == again.eval and first.train == again.train
    assert first.eval != other.eval
    kept = f"kept 43: {len(first.train)} for training, {len(first.eval)} held out (25% of {path}, seed 7)"
    assert first.report.summary().splitlines()[1] == kept


def test_eval_file_is_used_as_given_and_overlap_is_reported(byte, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in "abcd"])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"text": "a"}, {"text": "z"}])
    splits = load_data(cfg(train, eval=held, format="text", eval_fraction=0.5), byte, seed=0)
    assert len(splits.train) == 4 and len(splits.eval) == 2
    assert splits.report.eval_in_train == 1 and splits.report.files == {train: 4, held: 2}


# --- batches ------------------------------------------------------------------------------------


def make_samples(n, seed=0, lo=2, hi=30):
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(lo, hi)
        ids = (1000 + i, *(100 + (i * 7 + k) % 50 for k in range(length - 1)))  # the first id names it
        prompt = rng.randint(0, length - 1)
        samples.append(Sample(ids, (IGNORE,) * prompt + ids[prompt:], prompt))
    return samples


def as_lists(batch):
    return {key: value.tolist() for key, value in batch.items()}


def test_batch_is_right_padded_with_masked_labels():
    samples = make_samples(8)
    batches = Batches(samples, 4, seed=0, shuffle=False, group_by_length=False, pad_id=0)
    batch = batches.next()
    assert all(t.dtype == torch.int64 and t.shape == batch["input_ids"].shape for t in batch.values())
    width = max(len(s.input_ids) for s in samples[:4])
    assert batch["input_ids"].shape == (4, width)
    for row, sample in enumerate(samples[:4]):
        n = len(sample.input_ids)
        assert batch["input_ids"][row, :n].tolist() == list(sample.input_ids)
        assert batch["labels"][row, :n].tolist() == list(sample.labels)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert batch["labels"][row, n:].eq(IGNORE).all() and batch["input_ids"][row, n:].eq(0).all()


@pytest.mark.parametrize("group_by_length", [False, True])
def test_an_epoch_uses_each_sample_once_and_drops_only_the_tail(group_by_length):
    samples = make_samples(103)  # distinct first tokens identify samples
    batches = Batches(samples, 8, seed=3, group_by_length=group_by_length, pad_id=0)
    assert batches.steps_per_epoch == 12
    seen = []
    for _ in range(12):
        batch = batches.next()
        assert batch["input_ids"].shape[0] == 8
        for row, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
            seen.append(tuple(row[: sum(mask)]))
    assert batches.epoch == 1 and batches.position == 0
    assert len(set(seen)) == 96 and set(seen) <= {s.input_ids for s in samples}


def test_group_by_length_cuts_padding():
    samples = make_samples(400, lo=1, hi=200)

    def padding(group):
        batches = Batches(samples, 4, seed=1, group_by_length=group, pad_id=0)
        return sum(int((b["attention_mask"] == 0).sum()) for b in (batches.next() for _ in range(100)))

    assert padding(True) * 4 < padding(False)


def test_each_epoch_has_its_own_seeded_order():
    samples = make_samples(32)
    one = Batches(samples, 4, seed=5, pad_id=0)
    epoch0 = [as_lists(one.next()) for _ in range(8)]
    epoch1 = [as_lists(one.next()) for _ in range(8)]
    assert epoch0 != epoch1
    two = Batches(samples, 4, seed=5, pad_id=0)
    assert [as_lists(two.next()) for _ in range(8)] == epoch0


@pytest.mark.parametrize(
    "options",
    [dict(), dict(group_by_length=False), dict(shuffle=False), dict(packing=True, max_length=64)],
    ids=["grouped", "shuffled", "in-order", "packed"],
)
def test_resume_gives_exactly_the_uninterrupted_batches(options):
    samples = make_samples(50)
    straight = Batches(samples, 4, seed=11, pad_id=0, **options)
    steps = straight.steps_per_epoch
    taken = steps - 2  # resume two batches before the epoch boundary
    for _ in range(taken):
        straight.next()
    state = json.loads(json.dumps(straight.state_dict()))
    expected = [as_lists(straight.next()) for _ in range(steps)]
    resumed = Batches(samples, 4, seed=11, pad_id=0, **options)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (0, taken)
    assert [as_lists(resumed.next()) for _ in range(steps)] == expected
    assert resumed.epoch == straight.epoch == 1


def test_state_from_other_data_is_refused():
    state = Batches(make_samples(20), 4, seed=0, pad_id=0).state_dict()
    with pytest.raises(CheckpointError, match="batch_size: saved 4, now 2"):
        Batches(make_samples(20), 2, seed=0, pad_id=0).load_state_dict(state)
    with pytest.raises(CheckpointError, match="lengths_crc32"):
        Batches(make_samples(20, seed=1), 4, seed=0, pad_id=0).load_state_dict(state)


def test_too_few_samples_for_one_batch_is_an_error():
    with pytest.raises(DataError, match="no full batch of 8"):
        Batches(make_samples(5), 8, seed=0, pad_id=0)


def test_packing_fills_rows_of_max_length_without_splitting_samples():
    samples = make_samples(40, lo=3, hi=20)
    batches = Batches(samples, 2, seed=0, packing=True, max_length=48, pad_id=0)
    by_first_id = {s.input_ids[0]: s for s in samples}
    found = 0
    for _ in range(batches.steps_per_epoch):
        batch = batches.next()
        assert batch["input_ids"].shape == (2, 48)
        keys = ("input_ids", "labels", "attention_mask", "position_ids")
        for ids, labels, mask, positions in zip(*(batch[k].tolist() for k in keys)):
            used = sum(mask)
            assert mask == [1] * used + [0] * (48 - used)
            start = 0
            while start < used:  # walk the row sample by sample
                sample = by_first_id[ids[start]]
                end = start + len(sample.input_ids)
                assert tuple(ids[start:end]) == sample.input_ids
                assert labels[start] == IGNORE and labels[start + 1 : end] == list(sample.labels[1:])
                # each sample's positions restart at 0: the model masks attention per sample
                assert positions[start:end] == list(range(end - start))
                start, found = end, found + 1
            assert start == used  # a row holds whole samples only
            assert positions[used:] == list(range(48 - used))  # the padding: a sequence of its own
    assert found >= 30


def test_eval_batches_keep_order_and_the_short_last_batch():
    samples = make_samples(7)
    batches = list(eval_batches(samples, 3, pad_id=0))
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 1]
    last = batches[-1]
    assert last["input_ids"][0, : len(samples[6].input_ids)].tolist() == list(samples[6].input_ids)
    assert last["input_ids"].shape[1] == len(samples[6].input_ids)


# --- records are read one by one (issue 24) -----------------------------------------------------


def test_one_odd_record_does_not_change_how_the_others_are_read(byte, tmp_path):
    """A record whose content is not text must not retype the column for every other record: the
    answers stay the strings they are ("16" is not 16), and only the odd record is skipped."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"{i} + {i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(50)
    ]
    odd = {"messages": [{"role": "user", "content": [1, 2]}, {"role": "assistant", "content": "3"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [*chats[:20], odd, *chats[20:]])
    splits = load_data(cfg(path, format="chat"), byte, seed=0)
    assert len(splits.train) == 50
    answers = [byte.decode(s.input_ids[s.prompt_len :], skip_special_tokens=True) for s in splits.train]
    assert answers == [str(2 * i) for i in range(50)]
    reason = "malformed message (each needs a string 'role' and 'content')"
    assert splits.report.skipped == {reason: 1}
    assert splits.report.examples[reason] == ["c.jsonl line 21"]


def test_blank_jsonl_lines_are_ignored_and_a_broken_line_is_named_by_file_and_line(byte, tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"text": "one"}\n\n   \n{"text": \n{"text": "two"}\n[1, 2]\n\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.jsonl:4: not valid JSON.*data\.on_bad_record: skip"):
        load_data(cfg(path, format="text"), byte, seed=0)
    splits = load_data(cfg(path, format="text", on_bad_record="skip"), byte, seed=0)
    assert [byte.decode(s.input_ids, skip_special_tokens=True) for s in splits.train] == ["one", "two"]
    report = splits.report
    assert report.skipped == {"not valid JSON": 1, "not a JSON object": 1}
    assert report.examples == {"not valid JSON": ["b.jsonl line 4"], "not a JSON object": ["b.jsonl line 6"]}
    assert report.read == 4 == report.kept + sum(report.skipped.values())
    blank_only = tmp_path / "fine.jsonl"
    blank_only.write_text('\n{"text": "one"}\n\n{"text": "two"}\n\n', encoding="utf-8")
    assert len(load_data(cfg(blank_only, format="text"), byte, seed=0).train) == 2
    windows = tmp_path / "bom.jsonl"  # a BOM and CRLF line ends, as Windows editors save
    windows.write_bytes(b'\xef\xbb\xbf{"text": "one"}\r\n\r\n{"text": "two"}\r\n')
    assert len(load_data(cfg(windows, format="text"), byte, seed=0).train) == 2
