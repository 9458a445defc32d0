"""Families outside the eight fixture families: discovered, verified at wrap time, trained exactly.

Granite scales the embedding, the residuals, the attention scores and the logits; Cohere scales
its logits; HyperCLOVA X multiplies where Granite divides. None of that is registered anywhere:
the embedding and logits views run the models' own forward code, and the wrap-time probe proves it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import assert_exact, pipeline_train, reference_train
from support.tiny_models import VOCAB, make_batch, make_model

import roundpipe
from roundpipe.errors import UnsupportedModel
from roundpipe.models import adapt_model
from roundpipe.models.verify import verify_adapter

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
SCALED = {
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3),
    "cohere": dict(logit_scale=0.25),
    "hyperclovax": dict(embedding_multiplier=2.0, residual_multiplier=0.7, logits_scaling=0.5, attention_multiplier=0.3),
}  # fmt: skip


def _scaled_model(model_type: str, *, tied: bool, lora: bool = False, seed: int = 0):
    import transformers

    config = transformers.CONFIG_MAPPING[model_type](**_SIZES, **SCALED[model_type], tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    if not lora:
        return model
    import peft

    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"
    )  # fmt: skip
    return peft.get_peft_model(model, lora_config)


def _assert_trains_exactly(model, batch) -> None:
    """Three AdamW steps on two virtual devices against plain fp32 and float64 PyTorch."""
    plain = reference_train(model, batch, 3)
    exact = reference_train(copy.deepcopy(model).double(), batch, 3)
    got = pipeline_train(
        model, batch, 3, devices="cpu:2", num_microbatches=2, policy="roundpipe", partition=None
    )
    assert_exact(got, plain, exact)


@pytest.mark.parametrize("model_type", list(SCALED))
def test_discovery_finds_the_views_a_scaling_family_needs(model_type):
    adapter = adapt_model(_scaled_model(model_type, tied=False))
    assert adapter.layout.logits == "custom"  # every one of them scales its logits
    assert adapter.layout.embedding == ("plain" if model_type == "cohere" else "view")
    verify_adapter(adapter)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", list(SCALED))
def test_scaling_families_train_exactly(model_type, tied):
    """Three AdamW steps, left padding and -100 labels, on two virtual devices: losses equal plain
    fp32 PyTorch, weights no further from float64 than twice plain fp32 is."""
    model = _scaled_model(model_type, tied=tied)
    batch = make_batch(batch=4, padding="left")
    _assert_trains_exactly(model, batch)


def test_a_scaling_family_with_lora_trains_exactly():
    model = _scaled_model("granite", tied=True, lora=True)
    batch = make_batch(batch=4, padding="left")
    _assert_trains_exactly(model, batch)


def _patched_forward(monkeypatch, model, change):
    """Replace ``model.model``'s forward by one that calls the original through ``change``."""
    base = model.model
    original = base.forward
    monkeypatch.setattr(base, "forward", lambda *args, **kwargs: change(base, original, *args, **kwargs))


def _wrap(model):
    return roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", policy="roundpipe", partition=None))


def test_a_forward_changed_on_purpose_is_refused_naming_the_first_layer(monkeypatch):
    """Llama's forward made to number positions 0, 2, 4, ... (rotary attention is blind to a shift,
    not to a stretch): every layer's rotary tables differ from the ones the layers get, and the
    probe names the first layer that disagrees."""

    def shifted(base, original, *args, input_ids=None, **kwargs):
        kwargs["position_ids"] = 2 * torch.arange(input_ids.shape[1])[None]
        return original(*args, input_ids=input_ids, **kwargs)

    model = make_model("llama", num_layers=3)
    _patched_forward(monkeypatch, model, shifted)
    with pytest.raises(UnsupportedModel, match=r"layer layers\.0 \(LlamaDecoderLayer\) is the first") as info:
        _wrap(model)
    assert "register_family" in str(info.value)


def test_between_layer_changes_are_named_too(monkeypatch):
    """A forward that doubles what layer 1 hands to layer 2."""

    def doubled(base, original, *args, **kwargs):
        handle = base.layers[1].register_forward_hook(lambda m, a, out: out * 2)
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()

    model = make_model("llama", num_layers=3)
    _patched_forward(monkeypatch, model, doubled)
    with pytest.raises(UnsupportedModel, match=r"layers\.1 .*what layers\.2 receives"):
        _wrap(model)


def test_verify_model_false_probes_a_tiny_model_of_the_same_class():
    model = make_model("qwen3", lora="all-linear")
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", verify_model=False)) as pipe:
        assert pipe.verified == "tiny model"
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1")) as pipe:
        assert pipe.verified == "model"


def _tiny(model_type: str, seed: int = 0):
    import transformers

    from roundpipe.models.tiny import tiny_config

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(transformers.CONFIG_MAPPING[model_type]())
    )
    return model.train()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["olmo_hybrid", "lfm2", "mamba"])
def test_linear_attention_and_state_space_layers_train_exactly(model_type):
    """Training runs whole sequences through every layer, so no recurrent state crosses a
    microbatch: hybrids (OLMo-hybrid: linear attention + attention; LFM2: short convolutions +
    attention) and a pure state-space model (Mamba) train exactly like plain PyTorch."""
    model = _tiny(model_type)
    batch = make_batch(batch=4, padding="left", vocab=int(model.config.vocab_size))
    _assert_trains_exactly(model, batch)


def test_layers_handed_values_computed_from_the_hidden_states_are_refused_by_argument():
    """Zamba hands each layer the original embeddings as well: the context, built on zeros, cannot."""
    with pytest.raises(
        UnsupportedModel, match=r"computes decoder layer 0's argument .* from the hidden states"
    ):
        adapt_model(_tiny("zamba"))
