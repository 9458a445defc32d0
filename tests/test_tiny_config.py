"""tiny_config: any causal-LM config shrinks to a model of well under 5M parameters that forwards,
of the same config class, keeping the family's kinds of layer; the input config is never touched."""

from __future__ import annotations

import copy

import pytest
import torch

from roundpipe.errors import ConfigError
from roundpipe.models.tiny import tiny_config

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MAX_PARAMS = 5_000_000
# One of each shape of family: llama-like, two MoE routings, MLA with group-limited routing, mixed
# sliding / full layers with per-layer-type rope, GPT-2 names (n_embd, n_head), an SSM, a hybrid.
FAMILIES = ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "gemma3_text", "gpt2", "mamba2", "jamba"]


def _default(model_type: str):
    import transformers

    return transformers.CONFIG_MAPPING[model_type]()


def _build_and_forward(config):
    """Count on the meta device first (a shrink that failed must not allocate gigabytes), then build
    and run a training forward + backward on 2 x 16 tokens."""
    import transformers

    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert count < MAX_PARAMS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(1, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_shrunk_family_builds_small_and_forwards(model_type):
    config = _default(model_type)
    tiny = tiny_config(config)
    assert type(tiny) is type(config)
    assert tiny.model_type == config.model_type
    assert tiny.vocab_size <= 512
    assert getattr(tiny, "max_position_embeddings", 64) >= 64  # SSMs have none
    _build_and_forward(tiny)


def test_the_input_config_is_never_modified():
    for model_type in ("llama", "deepseek_v3", "gemma3", "jamba"):  # gemma3: a composite config
        config = _default(model_type)
        before = copy.deepcopy(config.to_dict())
        tiny_config(config)
        assert config.to_dict() == before


def test_mixed_layers_keep_one_of_each_kind():
    gemma = tiny_config(_default("gemma3_text"))
    assert sorted(gemma.layer_types) == ["full_attention", "sliding_attention"]
    assert 0 < gemma.sliding_window < 16  # shorter than a test sequence: the window really applies
    deepseek = tiny_config(_default("deepseek_v3"))  # 3 dense layers, then MoE
    assert deepseek.first_k_dense_replace == 1 and deepseek.num_hidden_layers == 2
    jamba = tiny_config(_default("jamba"))  # attention every 8th layer, experts every 2nd
    assert sorted(jamba.layers_block_type) == ["attention", "mamba"]
    assert 1 in jamba.layers_num_experts and max(jamba.layers_num_experts) > 1


def test_mla_and_routing_stay_consistent():
    tiny = tiny_config(_default("deepseek_v3"))
    assert tiny.qk_head_dim == tiny.qk_nope_head_dim + tiny.qk_rope_head_dim
    assert tiny.kv_lora_rank < tiny.hidden_size and tiny.q_lora_rank < tiny.hidden_size
    assert tiny.n_routed_experts == 4 and tiny.n_routed_experts % tiny.n_group == 0
    assert tiny.topk_group <= tiny.n_group
    assert tiny.num_experts_per_tok <= tiny.topk_group * tiny.n_routed_experts // tiny.n_group


def test_gpt2_names_shrink_through_the_attribute_map():
    tiny = tiny_config(_default("gpt2"))
    assert (tiny.n_embd, tiny.n_layer, tiny.n_head) == (64, 2, 4)
    assert tiny.bos_token_id < 512 and tiny.eos_token_id < 512


def test_a_long_context_rope_keeps_its_shape():
    """Phi-3-128k: long-rope factor lists shrink to half the rotary dimension, and the original
    context keeps its ratio to the maximum so a short batch still takes the scaled path."""
    import transformers

    config = transformers.Phi3Config(
        hidden_size=3072, num_attention_heads=32, num_hidden_layers=32, intermediate_size=8192,
        vocab_size=32064, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
        pad_token_id=32000, eos_token_id=32000,
    )  # fmt: skip
    tiny = tiny_config(config)
    rope = tiny.rope_parameters
    assert (
        len(rope["short_factor"])
        == len(rope["long_factor"])
        == tiny.hidden_size // tiny.num_attention_heads // 2
    )
    assert rope["original_max_position_embeddings"] * 32 == tiny.max_position_embeddings
    assert tiny.pad_token_id == tiny.eos_token_id < 512  # the same id maps to the same place
    _build_and_forward(tiny)


def test_the_attention_implementation_is_carried_over():
    import transformers

    config = transformers.LlamaConfig()
    config._attn_implementation = "eager"
    assert tiny_config(config)._attn_implementation == "eager"


def test_what_cannot_be_shrunk_raises_config_error():
    import transformers

    with pytest.raises(ConfigError, match="PretrainedConfig"):
        tiny_config({"hidden_size": 4096})
    with pytest.raises(ConfigError, match="nothing to shrink"):
        tiny_config(transformers.PretrainedConfig())
    with pytest.raises(ConfigError, match="heads"):
        tiny_config(_default("llama"), hidden=60, heads=8)
    with pytest.raises(ConfigError, match="kv_heads"):
        tiny_config(_default("llama"), heads=4, kv_heads=3)


def test_a_family_rejecting_the_shrunk_values_raises_config_error():
    import transformers

    class Picky(transformers.LlamaConfig):
        def __post_init__(self, **kwargs):
            if self.hidden_size < 128:
                raise ValueError("hidden_size must be at least 128")
            super().__post_init__(**kwargs)

    with pytest.raises(ConfigError, match="could not shrink Picky.*at least 128"):
        tiny_config(Picky())
