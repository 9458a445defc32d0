"""A vocabulary shard of the LM head costs a device only its rows of the head.

With ``head_shards=k`` every shard layer's module holds the whole head, but a shard uses only rows
``[vocab_start, vocab_stop)`` of the head's weight, bias and LoRA B. The runtime uploads just those
rows, the shard computes from them, and its weight gradient comes back as those rows only, to be
added into the matching rows of the whole fp32 gradient on the CPU. Here: training still equals
plain PyTorch (untied, tied, LoRA on the head, several shards or the embedding in one stage, the
async optimizer), each shard's weights and gradients on a device are its slice's bytes, and a step
moves exactly that many fewer bytes than the same run uploading the whole head for every shard.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import (
    assert_same_run,
    pipeline_train,
    reference_train,
    reference_train_one_step_stale,
)
from support.tiny_models import VOCAB, make_batch, make_model

import roundpipe
from roundpipe.models import MicrobatchInputs, adapt_model
from roundpipe.models.adapter import HeadShardLayer
from roundpipe.models.head_shards import vocab_ranges

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS = 3
SHARDS = 4
HIDDEN = 64  # tiny_models' hidden size
FP32 = 4  # bytes per element: these runs are fp32, and gradients are fp32 always
NORM_BYTES = HIDDEN * FP32  # head.0 also holds the final norm (and returns its gradient)
LORA_RANK = 4  # tiny_models' LoRA rank


def _batch() -> dict[str, torch.Tensor]:
    return make_batch(batch=6, padding="right")


def _config(**overrides) -> dict:
    # roundpipe with one layer per stage (partition=None) unless a test cuts its own stages: what a
    # device holds and moves is counted per shard's own stage.
    config = dict(
        devices="cpu:2", num_microbatches=3, head_shards=SHARDS, head_chunk_tokens=5, policy="roundpipe",
        partition=None,
    )  # fmt: skip
    return config | overrides


def _whole_head_uploads(monkeypatch) -> None:
    """The runtime as it was: no layer declares row slices, so every shard uploads the whole head."""
    monkeypatch.setattr(HeadShardLayer, "row_slices", lambda self: {})


def _head_shards(pipe) -> list[HeadShardLayer]:
    return [layer for layer in pipe.adapter.layers if isinstance(layer, HeadShardLayer)]


def _forward_backward(pipe, batch: dict) -> None:
    pipe.forward_backward(batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"])


# --- training stays exact ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "tied", "lora", "partition"),
    [
        ("llama", False, None, None),
        ("qwen3", True, None, None),
        ("llama", False, ["q_proj", "lm_head"], None),
        ("llama", True, ["q_proj", "lm_head"], None),
        ("llama", False, None, (3, 4)),  # all four shards (four pieces of one weight) in one stage
        ("qwen3", True, None, (4, 3)),  # the tied embedding (whole) and head.0 (rows) in one stage
    ],
    ids=[
        "llama-untied",
        "qwen3-tied",
        "lora-head",
        "lora-head-tied",
        "shards-share-a-stage",
        "embed-and-shard",
    ],
)
def test_row_sliced_shards_train_like_plain_pytorch(family, tied, lora, partition):
    model = make_model(family, tied=tied, lora=lora)
    batch = _batch()
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, **_config(partition=partition))
    assert_same_run(got, want)


def test_a_modules_to_save_head_trains_like_plain_pytorch_and_each_shard_holds_rows_of_both_copies():
    import peft

    config = peft.LoraConfig(
        r=4, target_modules=["o_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    model = peft.get_peft_model(make_model("qwen3"), config)
    batch = _batch()
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, **_config())
    assert_same_run(got, want)
    with roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(**_config())) as pipe:
        held = [pipe.store.layer_bytes[s.index] for s in _head_shards(pipe)]
    # The frozen original head and the trained copy: each shard holds its rows of both.
    ranges = vocab_ranges(VOCAB, SHARDS)
    assert held == [
        2 * (stop - start) * HIDDEN * FP32 + (NORM_BYTES if j == 0 else 0)
        for j, (start, stop) in enumerate(ranges)
    ]


def test_row_sliced_shards_with_the_async_optimizer_train_like_plain_pytorch_one_step_late():
    model = make_model("qwen3", tied=True)
    batch = _batch()
    want = reference_train_one_step_stale(model, batch, 4)
    got = pipeline_train(model, batch, 4, **_config(optimizer_mode="async"))
    assert_same_run(got, want)


def test_a_shard_gives_the_same_loss_and_row_gradients_from_its_rows_as_from_the_whole_head():
    model = make_model("llama", lora=["lm_head"])
    adapter = adapt_model(model, head_shards=SHARDS)
    batch = _batch()
    inputs = MicrobatchInputs(batch["input_ids"], batch["attention_mask"], None, batch["labels"])
    ctx = adapter.build_context(adapter.context_module, inputs, torch.float32)
    ctx.head_chunk_tokens = 5
    packed = torch.randn(6, 12, HIDDEN + 2)
    shard = adapter.layers[-2]  # a middle shard: packed -> packed
    start, stop = shard.vocab_start, shard.vocab_stop
    slices = shard.row_slices()
    assert set(slices) == {"lm_head.base_layer.weight", "lm_head.lora_B.default.weight"}
    assert set(slices.values()) == {(start, stop)}

    whole = copy.deepcopy(shard.module)
    rows = copy.deepcopy(shard.module)
    for path in slices:
        owner, _, attr = path.rpartition(".")
        module = rows.get_submodule(owner)
        full = module._parameters[attr]
        module._parameters[attr] = torch.nn.Parameter(full.detach()[start:stop].clone(), full.requires_grad)

    outs, grads = [], []
    for module in (whole, rows):
        out = shard.forward(module, packed, ctx)
        params = [p for p in module.parameters() if p.requires_grad]
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), params))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    names = [n for n, p in whole.named_parameters() if p.requires_grad]
    for name, g_whole, g_rows in zip(names, *grads):
        if name in slices:
            assert g_rows.shape[0] == stop - start
            torch.testing.assert_close(g_rows, g_whole[start:stop], rtol=0, atol=0)
            assert not g_whole[:start].any() and not g_whole[stop:].any()
        else:
            torch.testing.assert_close(g_rows, g_whole, rtol=0, atol=0)


# --- what a device holds and what a step moves ------------------------------------------------------


def _shard_bytes(j: int, start: int, stop: int) -> int:
    """fp32 bytes of head.{j}'s slice of an untied, plain [VOCAB, HIDDEN] head (+ the norm in head.0)."""
    return (stop - start) * HIDDEN * FP32 + (NORM_BYTES if j == 0 else 0)


def test_each_shard_holds_about_a_quarter_of_the_head():
    model = make_model("llama")
    with roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(devices="cpu:2", head_shards=1)) as pipe:
        unsharded = pipe.store.layer_bytes[-1]
    assert unsharded == VOCAB * HIDDEN * FP32 + NORM_BYTES
    with roundpipe.wrap(model, roundpipe.RunConfig(**_config())) as pipe:
        shards = _head_shards(pipe)
        ranges = vocab_ranges(VOCAB, SHARDS)
        assert [(s.vocab_start, s.vocab_stop) for s in shards] == ranges
        held = [pipe.store.layer_bytes[s.index] for s in shards]
    assert held == [_shard_bytes(j, *r) for j, r in enumerate(ranges)]
    assert sum(held) == unsharded  # the shards split the head; nothing is held twice
    for nbytes in held:
        assert abs(nbytes - unsharded / SHARDS) <= NORM_BYTES


def _traced_forward_backward(pipe, batch: dict) -> list[list[tuple]]:
    """One forward + backward with every device's memory ledger recording; the traces per device."""
    for dev in pipe.backend.devices:
        dev.ledger.trace = []
    _forward_backward(pipe, batch)
    return [dev.ledger.trace for dev in pipe.backend.devices]


def _events(trace, op: str, what: str) -> list[int]:
    return [nbytes for o, w, nbytes, _ in trace if o == op and w == what]


def test_devices_reserve_and_return_only_each_shards_rows():
    with roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(**_config())) as pipe:
        traces = _traced_forward_backward(pipe, _batch())
        shards = _head_shards(pipe)
    for j, shard in enumerate(shards):
        expected = _shard_bytes(j, shard.vocab_start, shard.vocab_stop)
        # One backward stage per layer: the gradient of head.j comes down tagged with its layer range.
        grad_tag = f"grads:{range(shard.index, shard.index + 1)}"
        weights = [n for trace in traces for n in _events(trace, "reserve", f"weights:{shard.name}")]
        grads = [n for trace in traces for n in _events(trace, "release", grad_tag)]
        assert weights and grads, f"{shard.name} was never uploaded or never sent its gradient back"
        assert set(weights) == {expected}, f"{shard.name}: weight reservations {weights}"
        assert set(grads) == {expected}, f"{shard.name}: gradient downloads {grads}"


@pytest.mark.parametrize(
    ("family", "tied", "lora"),
    [("llama", False, None), ("qwen3", True, None), ("llama", False, ["q_proj", "lm_head"])],
    ids=["llama-untied", "qwen3-tied", "lora-head"],
)
def test_a_step_moves_only_the_rows_a_shard_uses(family, tied, lora, monkeypatch):
    """Against the same run uploading the whole head for every shard: each upload of head.j sends
    ``VOCAB - rows_j`` fewer rows of every row-sliced tensor, and each gradient download of head.j
    returns ``VOCAB - rows_j`` fewer rows of every trainable row-sliced tensor."""
    model = make_model(family, tied=tied, lora=lora)
    batch = _batch()
    # Elements per vocabulary row of the row-sliced tensors: the head weight [V, H], plus LoRA B [V, r].
    row_elems = HIDDEN + (LORA_RANK if lora else 0)
    trainable_row_elems = LORA_RANK if lora else HIDDEN  # with LoRA the base head is frozen

    def run():
        with roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(**_config())) as pipe:
            traces = _traced_forward_backward(pipe, batch)
            stats = pipe.stats()["devices"]
            shards = _head_shards(pipe)
        uploads = [{s.name: len(_events(t, "reserve", f"weights:{s.name}")) for s in shards} for t in traces]
        downloads = [
            {s.name: len(_events(t, "release", f"grads:{range(s.index, s.index + 1)}")) for s in shards}
            for t in traces
        ]
        return stats, uploads, downloads

    stats, uploads, downloads = run()
    with monkeypatch.context() as patch:
        _whole_head_uploads(patch)
        stats_whole, uploads_whole, downloads_whole = run()

    assert uploads == uploads_whole and downloads == downloads_whole, "the same schedule either way"
    assert all(sum(u.values()) > 0 for u in uploads), "every device runs some shard"
    missing_rows = {
        f"head.{j}": VOCAB - (stop - start) for j, (start, stop) in enumerate(vocab_ranges(VOCAB, SHARDS))
    }
    for i, (dev, dev_whole) in enumerate(zip(stats, stats_whole)):
        saved_up = sum(n * missing_rows[name] * row_elems * FP32 for name, n in uploads[i].items())
        saved_down = sum(
            n * missing_rows[name] * trainable_row_elems * FP32 for name, n in downloads[i].items()
        )
        assert dev["bytes_to_device"] == dev_whole["bytes_to_device"] - saved_up
        assert dev["bytes_to_host"] == dev_whole["bytes_to_host"] - saved_down
