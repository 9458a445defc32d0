"""MoE models with ``output_router_logits=True``: the router load-balancing loss, added as HF adds it.

HF's loss is ``cross-entropy + coef * aux``, with ``aux`` over every MoE layer and every token of
the batch. The runtime splits it into one term per layer and microbatch on the batch's expert
counts, which every forward must have contributed before any backward: the planner keeps to
schedules that run so. A large coefficient makes the auxiliary gradient matter in these checks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import assert_exact, pipeline_train, reference_train
from support.tiny_models import VOCAB, make_batch

import roundpipe
from roundpipe.errors import ConfigError, UnsupportedModel
from roundpipe.models import adapt_model
from roundpipe.schedule import POLICIES, Partition
from roundpipe.schedule.check import runs_forwards_first

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

COEF = 0.5  # HF's default is 0.001-0.01: too small for a wrong auxiliary gradient to show
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, output_router_logits=True, router_aux_loss_coef=COEF,
)  # fmt: skip
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # shared experts, and a dense first layer: its MLP has no router and counts no rows
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}  # fmt: skip


def _moe_model(model_type: str, *, num_layers: int = 3, lora: bool = False, seed: int = 0):
    import transformers

    config = transformers.CONFIG_MAPPING[model_type](
        **_SIZES, **MOE[model_type], num_hidden_layers=num_layers
    )
    torch.manual_seed(seed)
    # The eager expert loop: the grouped-mm kernel takes no float64, which the exactness judge runs.
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, experts_implementation="eager"
    )
    model.train()
    if not lora:
        return model
    import peft

    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    return peft.get_peft_model(model, lora_config)


def _trains_exactly(model, batch, **config) -> None:
    plain = reference_train(model, batch, 3)
    exact = reference_train(copy.deepcopy(model).double(), batch, 3)
    got = pipeline_train(model, batch, 3, **config)
    assert_exact(got, plain, exact)


@pytest.mark.parametrize(
    "model_type", ["mixtral", *(pytest.param(m, marks=pytest.mark.slow) for m in MOE if m != "mixtral")]
)
def test_a_moe_model_with_its_router_loss_trains_exactly(model_type):
    """Three AdamW steps, left padding and -100 labels, two devices, four microbatches: losses equal
    plain fp32 PyTorch's (the auxiliary loss included), weights as close to float64 as plain fp32."""
    model = _moe_model(model_type)
    assert adapt_model(model).router_loss.coef == COEF
    _trains_exactly(model, make_batch(batch=4, padding="left"), devices="cpu:2", num_microbatches=4)


def test_the_router_loss_with_lora_trains_exactly():
    model = _moe_model("mixtral", lora=True)
    _trains_exactly(model, make_batch(batch=4, padding="left"), devices="cpu:2", num_microbatches=2)


@pytest.mark.parametrize("policy", ["1f1b", pytest.param("roundpipe", marks=pytest.mark.slow)])
def test_ready_order_runs_any_policy_with_the_router_loss_exactly(policy):
    """``order="ready"`` holds every backward until the batch's statistics are in, so a policy whose
    table interleaves forwards and backwards still runs, exactly."""
    model = _moe_model("qwen3_moe")
    _trains_exactly(
        model, make_batch(batch=4, padding="left"), devices="cpu:2", num_microbatches=4, policy=policy,
        partition=None, order="ready",
    )  # fmt: skip


def test_the_automatic_choice_keeps_to_policies_that_run_every_forward_first():
    model = _moe_model("mixtral")
    batch = make_batch(batch=4, padding="left")
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        assert POLICIES[pipe.last_plan.table.policy].forwards_first
        assert all(POLICIES[p["policy"]].forwards_first for p in pipe.plan.predictions)


def test_a_policy_that_runs_a_backward_before_the_last_forward_is_refused_in_strict_order():
    model = _moe_model("mixtral")
    batch = make_batch(batch=4, padding="left")
    config = roundpipe.RunConfig(devices="cpu:2", policy="1f1b", num_microbatches=4, partition=None)
    with roundpipe.wrap(model, config) as pipe, pytest.raises(ConfigError) as err:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
    message = str(err.value)
    assert (
        "router load-balancing loss" in message and "policy='gpipe'" in message and "order='ready'" in message
    )


def test_a_router_loss_the_layers_do_not_reproduce_is_refused_at_wrap_time(monkeypatch):
    """The wrap-time check compares the loss, auxiliary part included, with the model's own forward:
    a family whose formula differs is refused, not trained wrongly."""
    import transformers.models.mixtral.modeling_mixtral as mixtral

    original = mixtral.load_balancing_loss_func
    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda *a, **k: 3.0 * original(*a, **k))
    with pytest.raises(UnsupportedModel, match="loss"):
        roundpipe.wrap(_moe_model("mixtral"), roundpipe.RunConfig(devices="cpu:1"))


def test_a_family_whose_forward_adds_no_router_loss_gets_none():
    """DeepSeek-V3's modeling file has no load-balancing loss: its forward adds none, nor do we."""
    import transformers

    from roundpipe.models.tiny import tiny_config

    config = tiny_config(transformers.AutoConfig.for_model("deepseek_v3"))
    config.output_router_logits = True
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert adapt_model(model).router_loss is None


def test_routing_recorded_from_two_kinds_of_module_is_refused_with_the_setting_to_change():
    import transformers

    from roundpipe.models.tiny import tiny_config

    config = tiny_config(transformers.AutoConfig.for_model("jetmoe"))
    config.output_router_logits = True
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModel, match="output_router_logits = False"):
        adapt_model(model)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_only_gpipe_runs_every_forward_first_in_strict_order_and_ready_order_runs_them_all(devices):
    """The registry's ``forwards_first`` fact matches what the barrier dry run finds."""
    part = Partition.per_layer(2 * devices if devices > 1 else 2)
    for name, spec in POLICIES.items():
        if spec.even_devices and devices % 2:
            continue
        m = 4 * devices
        stages = spec.default_stages(devices)
        p = part if stages is None else Partition.from_sizes((1,) * stages)
        table = spec(p, p, devices, m)
        assert runs_forwards_first(table, in_order=True) == spec.forwards_first, name
        assert runs_forwards_first(table, in_order=False), name


def test_router_jitter_makes_the_blocks_random_so_recompute_replays_it():
    """Mixtral's router multiplies its input by uniform noise in training: the backward's recompute
    must draw the same noise as the forward did, as for dropout. Every layer in training mode runs
    seeded (its draws cannot be told from its module types); in eval mode none draws."""
    from roundpipe.models.random_draws import layers_that_draw

    model = _moe_model("mixtral")
    model.config.router_jitter_noise = 0.1
    adapter = adapt_model(model)
    assert layers_that_draw(adapter) == {layer.index for layer in adapter.layers}
    model.eval()
    adapter = adapt_model(model)
    assert not {layer.index for layer in adapter.layers if layer.kind == "block"} & layers_that_draw(adapter)
