"""The LM head + loss cut into vocabulary shards ``head.0 .. head.{k-1}`` stays exact.

The backbone: for untied, tied, softcapped, LoRA-on-lm_head and all-linear-LoRA models and
k in {2, 3, 5} (5 does not divide the vocabulary), the layers give HF's loss and HF's gradients both
when one backward runs through the whole chain and when every layer is re-run on its own from a
detached saved input, on a device shell of its module, and fed the downstream input-gradient with
``torch.autograd.grad`` (as the runtime does). Around it: the packed hand-off tensor holds what the
docs say, no [tokens x vocab] logits are kept for backward, and bad settings are refused.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.tiny_models import VOCAB, make_batch, make_model, saved_vocab_shapes
from torch import nn
from torch.nn import functional as F

from roundpipe.errors import ConfigError, InputError, UnsupportedModel
from roundpipe.models import MicrobatchInputs, adapt_model
from roundpipe.models.adapter import HeadLayer, HeadShardLayer
from roundpipe.models.base import loss_positions
from roundpipe.models.head_shards import STATS, HeadTensors, vocab_ranges

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

HIDDEN = 64  # tiny_models' hidden size

# (family, tied, lora): untied, tied, softcapped, LoRA on lm_head (tied: LoRA over the embedding
# weight), modules_to_save head, and LoRA on every linear layer of the blocks (frozen head).
CASES = {
    "llama-untied": ("llama", False, None),
    "qwen3-tied": ("qwen3", True, None),
    "gemma2-softcap": ("gemma2", False, None),
    "llama-lora-head-tied": ("llama", True, ["q_proj", "lm_head"]),
    "gemma2-lora-all-linear": ("gemma2", True, "all-linear"),
}


def _inputs(batch: dict[str, torch.Tensor], positions: bool = False) -> MicrobatchInputs:
    found = loss_positions(batch["labels"]) if positions else None
    return MicrobatchInputs(batch["input_ids"], batch.get("attention_mask"), None, batch["labels"], found)


def _context(adapter, batch, chunk_tokens: int, dtype=torch.float32, positions: bool = False):
    ctx = adapter.build_context(adapter.context_module, _inputs(batch, positions), dtype)
    ctx.head_chunk_tokens = chunk_tokens
    return ctx


def _label_count(ctx) -> torch.Tensor:
    return (ctx.shift_labels != -100).sum()


def _trainable(model) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _reference(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's loss (``use_cache=False``) and the gradient of every trainable parameter."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in _trainable(model).items()}
    model.zero_grad(set_to_none=True)
    assert grads, "the model has no trainable parameters; the test would prove nothing"
    return loss.detach(), grads


def run_whole_chain(
    adapter, batch, chunk_tokens: int, positions: bool = False
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Mean loss with one backward through every layer; gradients keyed by ``id(parameter)``."""
    ctx = _context(adapter, batch, chunk_tokens, positions=positions)
    x = ctx.inputs.input_ids
    for layer in adapter.layers:
        x = layer.forward(layer.module, x, ctx)
    loss = x / _label_count(ctx)
    loss.backward()
    grads = {id(p): p.grad for p in adapter.model.parameters() if p.grad is not None}
    return loss.detach(), grads


def run_layer_by_layer(adapter, batch, chunk_tokens: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The runtime's way: a no-grad forward that saves each layer's input (detached copies), then,
    from the last layer down, each layer re-run alone on a fresh device shell (a deep copy of its
    module) and differentiated with ``torch.autograd.grad`` fed the gradient its successor sent.
    The model's own tensors are poisoned with NaN first, so a layer that read anything but its
    shell would fail. Gradients are mapped back to the model's parameters by ``id``."""
    ctx = _context(adapter, batch, chunk_tokens)
    shells = [copy.deepcopy(layer.module) for layer in adapter.layers]
    with torch.no_grad():
        for t in [*adapter.model.parameters(), *adapter.model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    saved_inputs = []
    x = ctx.inputs.input_ids
    with torch.no_grad():
        for layer, shell in zip(adapter.layers, shells):
            saved_inputs.append(x.clone())
            x = layer.forward(shell, x, ctx)
    loss = x / _label_count(ctx)
    grad_output = 1.0 / _label_count(ctx).float()  # the runtime's gradient seed for the loss sum
    grads: dict[int, torch.Tensor] = {}
    for layer, shell, saved in reversed(list(zip(adapter.layers, shells, saved_inputs))):
        own = dict(layer.module.named_parameters())
        named = [(name, p) for name, p in shell.named_parameters() if p.requires_grad]
        x = saved.detach()
        wants_input = x.is_floating_point()
        x.requires_grad_(wants_input)
        inputs = ([x] if wants_input else []) + [p for _, p in named]
        if not inputs:
            continue
        y = layer.forward(shell, x, ctx)
        got = list(torch.autograd.grad([y], inputs, grad_outputs=[grad_output], allow_unused=True))
        if wants_input:
            grad_output = got.pop(0)
        for (name, _), g in zip(named, got):
            if g is not None:
                key = id(own[name])
                grads[key] = grads[key] + g if key in grads else g
    return loss, grads


def _case(case: str, shards: int):
    """The model of ``CASES[case]``, a batch, HF's loss and gradients, the adapter, parameter names."""
    family, tied, lora = CASES[case]
    model = make_model(family, tied=tied, lora=lora)
    batch = make_batch()
    reference = _reference(model, batch)
    names = {id(p): name for name, p in model.named_parameters()}
    return model, batch, reference, adapt_model(model, head_shards=shards), names


@pytest.mark.parametrize("run", [run_whole_chain, run_layer_by_layer], ids=["whole-chain", "layer-by-layer"])
@pytest.mark.parametrize("shards", [2, 3, 5])
@pytest.mark.parametrize("case", CASES)
def test_sharded_head_reproduces_hf_loss_and_grads(case, shards, run):
    model, batch, (ref_loss, ref_grads), adapter, names = _case(case, shards)
    assert [layer.name for layer in adapter.layers[-shards:]] == [f"head.{j}" for j in range(shards)]
    loss, grads = run(adapter, batch, chunk_tokens=7)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert {names[k] for k in grads} == set(ref_grads), "some trainable parameter got no gradient"
    for key, grad in grads.items():
        name = names[key]
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("case", ["llama-untied", "gemma2-softcap", "llama-lora-head-tied"])
def test_the_head_computes_only_tokens_with_a_label_and_gives_the_same_result(case, shards, monkeypatch):
    model, batch, (ref_loss, ref_grads), adapter, names = _case(case, shards)
    rows = []
    if shards == 1:
        lm_head = model.get_output_embeddings()
        lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    else:
        original = HeadTensors.logits

        def counting(self, hidden, softcap):
            rows.append(hidden.shape[0])
            return original(self, hidden, softcap)

        monkeypatch.setattr(HeadTensors, "logits", counting)
    loss_all, grads_all = run_whole_chain(adapter, batch, chunk_tokens=7)
    every = sum(rows)
    rows.clear()
    model.zero_grad(set_to_none=True)
    loss, grads = run_whole_chain(adapter, batch, chunk_tokens=7, positions=True)
    counted = int((batch["labels"][:, 1:] != -100).sum())
    tokens = batch["labels"].numel()
    assert counted < tokens * 0.8  # the batch has prompts and padding worth skipping
    assert sum(rows) * tokens == every * counted  # logits only for the label tokens, in every pass
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, loss_all, rtol=1e-6, atol=0)
    assert {names[k] for k in grads} == set(ref_grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[names[key]], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grad, grads_all[key], rtol=1e-5, atol=1e-7)


def test_loss_positions_name_the_tokens_whose_next_token_has_a_label():
    labels = torch.tensor([[-100, 5, 6, -100], [7, -100, 8, 9]])
    # row 0: position 0 predicts 5, 1 predicts 6; row 1: 1 predicts 8, 2 predicts 9 (flat 5, 6)
    assert loss_positions(labels).tolist() == [0, 1, 5, 6]


@pytest.mark.parametrize("run", [run_whole_chain, run_layer_by_layer], ids=["whole-chain", "layer-by-layer"])
def test_sharded_modules_to_save_head_reproduces_hf(run):
    import peft

    config = peft.LoraConfig(
        r=4, target_modules=["o_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    model = peft.get_peft_model(make_model("qwen3", tied=False), config)
    batch = make_batch(padding="right")
    ref_loss, ref_grads = _reference(model, batch)
    names = {id(p): name for name, p in model.named_parameters()}
    loss, grads = run(adapt_model(model, head_shards=3), batch, chunk_tokens=5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert {names[k] for k in grads} == set(ref_grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[names[key]], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 10_000])
def test_chunk_size_does_not_change_loss_or_grads(chunk_tokens):
    model = make_model("gemma2", lora=["lm_head"])
    batch = make_batch()
    ref_loss, ref_grads = _reference(model, batch)
    names = {id(p): name for name, p in model.named_parameters()}
    loss, grads = run_whole_chain(adapt_model(model, head_shards=3), batch, chunk_tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[names[key]], rtol=1e-4, atol=1e-6)


# --- the hand-off format ---------------------------------------------------------------------------


def test_packed_tensor_holds_normed_hidden_running_lse_and_target_logit():
    model = make_model("gemma2")
    adapter = adapt_model(model, head_shards=3)
    batch = make_batch()
    ctx = _context(adapter, batch, chunk_tokens=5)
    hidden = torch.randn(6, 12, HIDDEN, generator=torch.Generator().manual_seed(1))
    shard0, shard1, shard2 = adapter.layers[-3:]
    with torch.no_grad():
        normed = model.model.norm(hidden)
        logits = torch.tanh(model.lm_head(normed) / 30.0) * 30.0
        packed0 = shard0.forward(shard0.module, hidden, ctx)
        packed1 = shard1.forward(shard1.module, packed0, ctx)
        loss_sum = shard2.forward(shard2.module, packed1, ctx)
    labels = ctx.shift_labels
    for packed, stop in ((packed0, shard0.vocab_stop), (packed1, shard1.vocab_stop)):
        assert packed.shape == (6, 12, HIDDEN + STATS) and packed.dtype == torch.float32
        torch.testing.assert_close(packed[..., :HIDDEN], normed, rtol=0, atol=0)
        seen = logits[..., :stop].float()
        torch.testing.assert_close(packed[..., HIDDEN], torch.logsumexp(seen, dim=-1), rtol=1e-6, atol=1e-6)
        inside = (labels >= 0) & (labels < stop)
        target = seen.gather(-1, labels.clamp(0, stop - 1)[..., None]).squeeze(-1)
        torch.testing.assert_close(
            packed[..., HIDDEN + 1], torch.where(inside, target, 0.0), rtol=0, atol=1e-6
        )
    plain = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    assert loss_sum.shape == () and loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, plain, rtol=1e-5, atol=0)


def test_without_grad_the_shards_build_no_graph_and_give_the_same_loss():
    model = make_model("llama", lora=["lm_head"])
    adapter = adapt_model(model, head_shards=3)
    ctx = _context(adapter, make_batch(), chunk_tokens=5)
    hidden = torch.randn(6, 12, HIDDEN, requires_grad=True)

    def chain():
        x = hidden
        for layer in adapter.layers[-3:]:
            x = layer.forward(layer.module, x, ctx)
        return x

    with_grad = chain()
    with torch.no_grad():
        without = chain()
    assert without.grad_fn is None and with_grad.grad_fn is not None
    torch.testing.assert_close(without, with_grad.detach(), rtol=1e-6, atol=0)


def test_bf16_sharded_head_stays_close_to_hf():
    model = make_model("gemma3_text", dtype=torch.bfloat16)
    batch = make_batch()
    adapter = adapt_model(model, head_shards=3)
    with torch.no_grad():
        ref = model(**batch, use_cache=False).loss.float()
        ctx = _context(adapter, batch, chunk_tokens=5, dtype=torch.bfloat16)
        x = ctx.inputs.input_ids
        for layer in adapter.layers:
            x = layer.forward(layer.module, x, ctx)
    assert x.dtype == torch.float32 and x.ndim == 0
    torch.testing.assert_close(x / _label_count(ctx), ref, rtol=1e-2, atol=0)


# --- memory: no [tokens x vocab] logits kept for backward ------------------------------------------


@pytest.mark.parametrize("lora", [None, ["lm_head"]], ids=["full", "lora-head"])
@pytest.mark.parametrize("shards", [2, 3, 5])
def test_shards_save_no_logits_for_backward(shards, lora):
    adapter = adapt_model(make_model("gemma2", lora=lora), head_shards=shards)
    model = adapter.model
    ctx = _context(adapter, make_batch(), chunk_tokens=5)
    hidden = torch.randn(6, 12, HIDDEN, requires_grad=True)
    head_layers = adapter.layers[-shards:]
    vocab_sizes = {VOCAB} | {layer.vocab_stop - layer.vocab_start for layer in head_layers}
    assert HIDDEN not in vocab_sizes and HIDDEN + STATS not in vocab_sizes  # the detector can tell

    def sharded():
        x = hidden
        for layer in head_layers:
            x = layer.forward(layer.module, x, ctx)
        return x

    assert saved_vocab_shapes(sharded, vocab_sizes) == []

    # The detector works: plain autograd over one shard's logits keeps them alive for backward.
    def naive_shard():
        normed = model.model.norm(hidden)
        start, stop = head_layers[0].vocab_start, head_layers[0].vocab_stop
        weight = getattr(model.lm_head, "base_layer", model.lm_head).weight
        logits = F.linear(normed, weight[start:stop])
        return torch.logsumexp(logits.float(), dim=-1).sum()

    assert any(
        math.prod(shape) >= 72 * (VOCAB // shards) for shape in saved_vocab_shapes(naive_shard, vocab_sizes)
    )


# --- structure -------------------------------------------------------------------------------------


def test_one_shard_keeps_the_single_head_layer():
    model = make_model("llama", num_layers=1)
    for adapter in (adapt_model(model), adapt_model(model, head_shards=1)):
        assert [layer.name for layer in adapter.layers] == ["embed", "layers.0", "head"]
        assert type(adapter.layers[-1]) is HeadLayer and adapter.head_shards == 1


@pytest.mark.parametrize("lora", [None, ["lm_head"]], ids=["plain", "lora-head"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shards_hold_the_models_own_head_and_split_the_vocabulary(tied, lora):
    wrapped = make_model("qwen3", tied=tied, lora=lora, num_layers=1)
    adapter = adapt_model(wrapped, head_shards=5)
    model = adapter.model
    assert [layer.name for layer in adapter.layers] == ["embed", "layers.0"] + [f"head.{j}" for j in range(5)]
    assert [layer.index for layer in adapter.layers] == list(range(7))
    shards = adapter.layers[2:]
    assert all(type(layer) is HeadShardLayer and layer.kind == "head" for layer in shards)
    assert shards[0].module["norm"] is model.model.norm
    assert all("norm" not in layer.module for layer in shards[1:])
    assert all(layer.module["lm_head"] is model.lm_head for layer in shards)
    ranges = [(layer.vocab_start, layer.vocab_stop) for layer in shards]
    assert ranges == vocab_ranges(VOCAB, 5) == [(0, 52), (52, 103), (103, 154), (154, 205), (205, 256)]
    in_layers = {id(p) for layer in adapter.layers for p in layer.module.parameters()}
    assert in_layers == {id(p) for p in model.parameters()}
    embed_weight = adapter.layers[0].module.weight
    head_weights = [
        getattr(layer.module["lm_head"], "base_layer", layer.module["lm_head"]).weight for layer in shards
    ]
    assert all((w is embed_weight) == tied for w in head_weights)


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [0, -1, 2.5, True, VOCAB + 1])
def test_bad_shard_counts_are_refused(shards):
    with pytest.raises(ConfigError, match="head_shards"):
        adapt_model(make_model("llama", num_layers=1), head_shards=shards)


def test_as_many_shards_as_vocabulary_rows_is_allowed():
    adapter = adapt_model(make_model("llama", num_layers=1), head_shards=VOCAB)
    assert [layer.vocab_stop - layer.vocab_start for layer in adapter.layers[2:]] == [1] * VOCAB


def test_an_unsliceable_lm_head_is_refused_with_the_fix():
    model = make_model("llama", num_layers=1)
    model.lm_head = nn.Sequential(nn.Linear(HIDDEN, VOCAB, bias=False))
    with pytest.raises(UnsupportedModel, match="head_shards=1"):
        adapt_model(model, head_shards=2)
    adapt_model(model, head_shards=1)  # one head layer runs any module


def test_lora_dropout_on_the_head_is_refused():
    import peft

    config = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.1)
    model = peft.get_peft_model(make_model("llama", num_layers=1), config)
    with pytest.raises(UnsupportedModel, match="dropout"):
        adapt_model(model, head_shards=2)


def test_labels_outside_the_vocabulary_are_refused():
    adapter = adapt_model(make_model("llama", num_layers=1), head_shards=2)
    batch = make_batch()
    batch["labels"][0, 5] = VOCAB
    ctx = _context(adapter, batch, chunk_tokens=5)
    with pytest.raises(InputError, match="labels"):
        adapter.layers[2].forward(adapter.layers[2].module, torch.randn(6, 12, HIDDEN), ctx)


def test_a_shard_fed_the_wrong_tensor_says_what_it_expects():
    adapter = adapt_model(make_model("llama", num_layers=1), head_shards=2)
    ctx = _context(adapter, make_batch(), chunk_tokens=5)
    with pytest.raises(InputError, match="packed fp32"):
        adapter.layers[3].forward(adapter.layers[3].module, torch.randn(6, 12, HIDDEN), ctx)
