"""The model adapter runs a HF causal LM layer by layer exactly as HF's own forward does.

The backbone: for every family, tied and untied embeddings, full and LoRA fine-tuning, left and
right padding, ``embed -> blocks -> head`` (with the context built from ``context_module``) gives
HF's loss and HF's gradients. Around it: layers only read the module they are handed, the chunked
head never keeps [tokens x vocab] logits for backward, and unsupported models are refused with a
message that says what to change.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.tiny_models import FAMILIES, VOCAB, make_batch, make_model, saved_vocab_shapes
from torch.nn import functional as F

from roundpipe.errors import ConfigError, InputError, UnsupportedModel
from roundpipe.models import MicrobatchInputs, adapt_model, chunked_lm_loss

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def _inputs(batch: dict[str, torch.Tensor], position_ids: torch.Tensor | None = None) -> MicrobatchInputs:
    return MicrobatchInputs(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=position_ids,
        labels=batch["labels"],
    )


def run_layers(
    adapter, inputs: MicrobatchInputs, *, chunk_tokens: int = 1024, modules=None, context_module=None
):
    """Mean loss of the layers run in sequence, as the runtime would on one device."""
    context_module = adapter.context_module if context_module is None else context_module
    ctx = adapter.build_context(context_module, inputs, torch.float32)
    ctx.head_chunk_tokens = chunk_tokens
    modules = [layer.module for layer in adapter.layers] if modules is None else modules
    x = inputs.input_ids
    for layer, module in zip(adapter.layers, modules):
        x = layer.forward(module, x, ctx)
    return x / (ctx.shift_labels != -100).sum()


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _reference(model, batch, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's loss and the gradients of every trainable parameter; leaves .grad cleared."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in _trainable(model).items()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_matches_hf(model, batch, *, chunk_tokens=1024, position_ids=None, **hf_kwargs) -> None:
    ref_loss, ref_grads = _reference(
        model, batch | ({"position_ids": position_ids} if position_ids is not None else {}), **hf_kwargs
    )
    assert ref_grads, "the model has no trainable parameters; the test would prove nothing"
    loss = run_layers(adapt_model(model), _inputs(batch, position_ids), chunk_tokens=chunk_tokens)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    for name, p in _trainable(model).items():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(
            p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    model.zero_grad(set_to_none=True)


# --- equivalence with HF -------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("lora", [None, "default"], ids=["full", "lora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_reproduce_hf_loss_and_grads(family, tied, lora, padding):
    model = make_model(family, tied=tied, lora=lora)
    _assert_matches_hf(model, make_batch(padding=padding), chunk_tokens=5)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "phi3", "gemma2", "gemma3_text"])
def test_layers_reproduce_hf_with_lora_on_all_linear(family, tied, padding):
    model = make_model(family, tied=tied, lora="all-linear")
    _assert_matches_hf(model, make_batch(padding=padding), chunk_tokens=7)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_layers_reproduce_hf_with_lora_on_embedding_and_head(family, tied):
    attention = "qkv_proj" if family == "phi3" else "q_proj"
    model = make_model(family, tied=tied, lora=[attention, "embed_tokens", "lm_head"])
    _assert_matches_hf(model, make_batch(), chunk_tokens=5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_layers_reproduce_hf_with_modules_to_save_head(tied):
    import peft

    model = make_model("qwen3", tied=tied)
    config = peft.LoraConfig(
        r=4, target_modules=["o_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    _assert_matches_hf(peft.get_peft_model(model, config), make_batch(), chunk_tokens=5)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text"])
def test_unpadded_batch_matches_hf(family):
    _assert_matches_hf(make_model(family), make_batch(padding=None), chunk_tokens=5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_given_position_ids_are_used(family):
    model = make_model(family)
    batch = make_batch(padding="left")
    # Not a constant shift of arange (rotary attention would not notice one): every gap doubles.
    position_ids = 2 * torch.arange(12).expand(6, -1)
    _assert_matches_hf(model, batch, position_ids=position_ids)
    # And they matter: the default arange positions give another loss.
    default = run_layers(adapt_model(model), _inputs(batch)).detach()
    given = run_layers(adapt_model(model), _inputs(batch, position_ids)).detach()
    assert not torch.allclose(default, given)


def test_packed_sequences_follow_hf_training_forward():
    """No attention mask + position ids that restart: HF (use_cache=False) masks per sequence."""
    model = make_model("mistral")
    batch = make_batch(padding=None)
    del batch["attention_mask"]
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(batch["input_ids"].shape[0], -1)
    _assert_matches_hf(model, batch, position_ids=position_ids, use_cache=False)


def test_bf16_run_stays_close_to_hf():
    model = make_model("gemma3_text", dtype=torch.bfloat16)
    batch = make_batch()
    with torch.no_grad():
        ref = model(**batch).loss.float()
        adapter = adapt_model(model)
        inputs = _inputs(batch)
        ctx = adapter.build_context(adapter.context_module, inputs, torch.bfloat16)
        x = inputs.input_ids
        for layer in adapter.layers:
            x = layer.forward(layer.module, x, ctx)
    assert x.dtype == torch.float32 and x.ndim == 0
    torch.testing.assert_close(x / (ctx.shift_labels != -100).sum(), ref, rtol=1e-2, atol=0)


# --- structure and ownership ---------------------------------------------------------------------


@pytest.mark.parametrize("lora", [None, "all-linear"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_layers_hold_the_models_own_modules(tied, lora):
    wrapped = make_model("llama", tied=tied, lora=lora, num_layers=3)
    adapter = adapt_model(wrapped)
    model = wrapped.get_base_model() if lora else wrapped
    assert adapter.model is model and adapter.config is model.config and adapter.family == "llama"
    assert [layer.name for layer in adapter.layers] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert [layer.index for layer in adapter.layers] == list(range(5))
    assert [layer.kind for layer in adapter.layers] == ["embed", "block", "block", "block", "head"]
    assert adapter.layers[0].module is model.model.embed_tokens  # llama adds nothing: no view
    assert all(adapter.layers[i + 1].module is block for i, block in enumerate(model.model.layers))
    assert adapter.layers[-1].module["norm"] is model.model.norm
    assert adapter.layers[-1].module["lm_head"] is model.lm_head
    assert adapter.context_module["layers"].view.rotary_emb is model.model.rotary_emb
    assert not list(adapter.context_module.parameters())
    in_layers = {id(p) for layer in adapter.layers for p in layer.module.parameters()}
    assert in_layers == {id(p) for p in model.parameters()}
    head_weight = adapter.layers[-1].module["lm_head"].weight
    embed_weight = adapter.layers[0].module.weight
    assert (head_weight is embed_weight) == tied


@pytest.mark.parametrize("lora", [None, "default"], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])
def test_layers_only_read_the_module_they_are_given(family, lora):
    """Run device shells (deep copies) after poisoning the model: results and grads stay exact."""
    wrapped = make_model(family, tied=True, lora=lora)
    batch = make_batch()
    ref_loss, ref_grads = _reference(wrapped, batch)
    adapter = adapt_model(wrapped)
    shells = [copy.deepcopy(layer.module) for layer in adapter.layers]
    context_shell = copy.deepcopy(adapter.context_module)
    with torch.no_grad():
        for t in [*wrapped.parameters(), *wrapped.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    loss = run_layers(adapter, _inputs(batch), chunk_tokens=5, modules=shells, context_module=context_shell)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert all(p.grad is None for p in wrapped.parameters())
    # Map every shell parameter back to the model's name; tied weights collect from two shells.
    grads: dict[str, torch.Tensor] = {}
    model = adapter.model
    for layer, shell in zip(adapter.layers, shells):
        own = dict(layer.module.named_parameters())
        for name, p in shell.named_parameters():
            if p.grad is not None:
                key = next(n for n, q in model.named_parameters() if q is own[name])
                grads[key] = grads.get(key, 0) + p.grad
    names = {n.removeprefix("base_model.model."): g for n, g in ref_grads.items()}
    assert grads.keys() == names.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, names[name], rtol=1e-4, atol=1e-6)


def _per_type(adapter, ctx, key: str) -> dict[str, list]:
    """What the context hands each attention type's layers under ``key``, by discovered type."""
    out: dict[str, list] = {}
    for layer in adapter.layers:
        if layer.kind == "block":
            out.setdefault(layer.attention_type, []).append(ctx.layer_inputs[layer.index - 1][1][key])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_context_hands_each_attention_type_its_own_mask(family):
    adapter = adapt_model(make_model(family))
    batch = make_batch(padding="left")
    ctx = adapter.build_context(adapter.context_module, _inputs(batch), torch.float32)
    masks = _per_type(adapter, ctx, "attention_mask")
    expected = {
        "llama": {"full_attention"},
        "qwen3": {"full_attention"},
        "qwen3_moe": {"full_attention"},
        "phi3": {"full_attention"},
        "mistral": {"sliding_attention"},
    }.get(family, {"full_attention", "sliding_attention"})
    assert set(masks) == expected
    for same_type in masks.values():  # one mask per type, shared by its layers (as in HF)
        assert all(m is same_type[0] for m in same_type)
    if set(masks) == {"full_attention", "sliding_attention"}:
        # The window (4) is shorter than the sequence (12), so the two masks really differ.
        assert not torch.equal(masks["full_attention"][0], masks["sliding_attention"][0])
    torch.testing.assert_close(ctx.position_ids, torch.arange(12)[None])
    expected_labels = torch.cat([batch["labels"][:, 1:], torch.full((6, 1), -100)], dim=1)
    assert torch.equal(ctx.shift_labels, expected_labels)


def test_gemma3_gets_one_rotary_table_per_attention_type():
    adapter = adapt_model(make_model("gemma3_text"))
    ctx = adapter.build_context(adapter.context_module, _inputs(make_batch()), torch.float32)
    tables = _per_type(adapter, ctx, "position_embeddings")
    full_cos, _ = tables["full_attention"][0]
    sliding_cos, _ = tables["sliding_attention"][0]
    assert not torch.allclose(full_cos, sliding_cos)


def test_context_follows_the_run_dtype():
    adapter = adapt_model(make_model("gemma2"))  # eager attention: additive float masks
    ctx = adapter.build_context(adapter.context_module, _inputs(make_batch()), torch.bfloat16)
    assert all(m[0].dtype == torch.bfloat16 for m in _per_type(adapter, ctx, "attention_mask").values())
    tables = _per_type(adapter, ctx, "position_embeddings").values()
    assert all(cos.dtype == torch.bfloat16 for (cos, _), *_ in tables)


def test_context_rejects_mismatched_inputs():
    adapter = adapt_model(make_model("llama"))
    batch = make_batch()
    bad = MicrobatchInputs(batch["input_ids"], batch["attention_mask"][:, :-1], None, batch["labels"])
    with pytest.raises(InputError, match="attention_mask"):
        adapter.build_context(adapter.context_module, bad, torch.float32)


# --- the chunked head ----------------------------------------------------------------------------


def _head_problem(seed: int = 0, lora_head: bool = False):
    model = make_model("gemma2", lora=["lm_head"] if lora_head else None, seed=seed)
    adapter = adapt_model(model)
    head = adapter.layers[-1]
    batch = make_batch(seed=seed)
    ctx = adapter.build_context(adapter.context_module, _inputs(batch), torch.float32)
    hidden = torch.randn(6, 12, 64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return model, head, ctx, hidden


@pytest.mark.parametrize("lora_head", [False, True], ids=["linear", "lora"])
def test_head_chunks_give_the_same_loss_and_grads_as_one_chunk(lora_head):
    model, head, ctx, hidden = _head_problem(lora_head=lora_head)
    results = []
    for chunk in (5, 72, 10_000):
        ctx.head_chunk_tokens = chunk
        hidden.grad = None
        model.zero_grad(set_to_none=True)
        loss = head.forward(head.module, hidden, ctx)
        loss.backward()
        grads = [p.grad.clone() for p in head.module.parameters() if p.requires_grad]
        results.append((loss.detach(), hidden.grad.clone(), grads))
    # The plain formula: full logits, softcap, fp32 cross-entropy sum.
    logits = head.module["lm_head"](head.module["norm"](hidden.detach()))
    logits = torch.tanh(logits / 30.0) * 30.0
    plain = F.cross_entropy(logits.float().reshape(-1, VOCAB), ctx.shift_labels.reshape(-1), reduction="sum")
    for loss, grad_hidden, grads in results:
        torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=0)
        torch.testing.assert_close(grad_hidden, results[0][1], rtol=1e-4, atol=1e-7)
        for g, g0 in zip(grads, results[0][2]):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("chunk", [5, 10_000])
def test_head_saves_no_logits_for_backward(chunk):
    _, head, ctx, hidden = _head_problem()
    ctx.head_chunk_tokens = chunk
    assert saved_vocab_shapes(lambda: head.forward(head.module, hidden, ctx), {VOCAB}) == []

    # The detector works: the naive head keeps [tokens x vocab] logits alive for backward.
    def naive():
        logits = head.module["lm_head"](head.module["norm"](hidden))
        return F.cross_entropy(
            logits.float().reshape(-1, VOCAB), ctx.shift_labels.reshape(-1), reduction="sum"
        )

    assert any(math.prod(shape) >= 72 * VOCAB for shape in saved_vocab_shapes(naive, {VOCAB}))


def test_head_without_grad_builds_no_graph():
    _, head, ctx, hidden = _head_problem()
    ctx.head_chunk_tokens = 5
    with_grad = head.forward(head.module, hidden, ctx)
    with torch.no_grad():
        without = head.forward(head.module, hidden, ctx)
    assert without.grad_fn is None and with_grad.grad_fn is not None
    torch.testing.assert_close(without, with_grad.detach(), rtol=1e-6, atol=0)


def test_head_rejects_bad_chunk_size_and_missing_labels():
    _, head, ctx, hidden = _head_problem()
    ctx.head_chunk_tokens = 0
    with pytest.raises(ConfigError, match="head_chunk_tokens"):
        head.forward(head.module, hidden, ctx)
    ctx.head_chunk_tokens, ctx.shift_labels = 8, None
    with pytest.raises(InputError, match="labels"):
        head.forward(head.module, hidden, ctx)


def test_chunked_lm_loss_accepts_flat_tokens():
    lm_head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(9, 8)
    labels = torch.tensor([1, 2, -100, 4, 5, 6, -100, 8, 9])
    expected = F.cross_entropy(lm_head(hidden), labels, reduction="sum")
    torch.testing.assert_close(chunked_lm_loss(hidden, labels, lm_head, chunk_tokens=4), expected)


# --- refusals ------------------------------------------------------------------------------------


def _tiny_llama_config(**kwargs):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        **kwargs,
    )


def _assert_refused(model, *fragments: str) -> None:
    with pytest.raises(UnsupportedModel) as info:
        adapt_model(model)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_refuses_a_decoder_without_lm_head():
    import transformers

    _assert_refused(transformers.LlamaModel(_tiny_llama_config()), "no LM head", "AutoModelForCausalLM")


def test_refuses_a_sequence_classifier():
    import transformers

    model = transformers.LlamaForSequenceClassification(_tiny_llama_config(pad_token_id=0))
    _assert_refused(model, "AutoModelForCausalLM")


def test_refuses_an_unsupported_family():
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    _assert_refused(transformers.BertModel(config), "no LM head")
    config.is_decoder = True  # BERT's causal-LM head: its layers sit under encoder.layer, with no norm
    _assert_refused(transformers.BertLMHeadModel(config), "lacks", "ModuleList", "register_family")


def test_refuses_things_that_are_not_models():
    _assert_refused(object(), "not a Hugging Face model")


def test_qwen3_moe_with_router_logits_reads_its_load_balancing_loss_from_the_model():
    """``output_router_logits=True`` is trained with HF's auxiliary loss (tests/test_router_loss.py):
    the expert count, top-k and coefficient are the causal LM's own, the routers found per layer."""
    model = make_model("qwen3_moe")
    model.config.output_router_logits = True
    loss = adapt_model(model).router_loss
    assert (loss.num_experts, loss.top_k, loss.coef) == (
        model.num_experts,
        model.num_experts_per_tok,
        model.router_aux_loss_coef,
    )
    assert loss.routers == (("mlp.gate",),) * model.config.num_hidden_layers
    model.config.output_router_logits = False
    assert adapt_model(model).router_loss is None


def test_refuses_bidirectional_gemma3():
    model = make_model("gemma3_text")
    model.config.use_bidirectional_attention = True
    _assert_refused(model, "use_bidirectional_attention")


def test_refuses_prompt_learning_peft():
    import peft
    import transformers

    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    wrapped = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    _assert_refused(wrapped, "LoRA")
