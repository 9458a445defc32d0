"""Packing without attention across samples: a packed row trains exactly like its samples unpacked.

A packed row carries position ids that restart at every sample and goes to the model without an
attention mask (``batches.model_inputs``); transformers then masks attention per sample. The
reference for everything is the samples unpacked, each its own right-padded row: the loss is the
mean over the same label tokens (a sample's first token predicts nothing in either form), so the
losses and gradients must agree.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support.tiny_models import FAMILIES, SLIDING_WINDOW, make_model

import roundpipe
from roundpipe.errors import ConfigError
from roundpipe.models.adapter import packing_refusal_of
from roundpipe.train.batches import Batches, model_inputs
from roundpipe.train.data import IGNORE, Sample
from roundpipe.train.tokenizer import EOS_ID

torch.set_num_threads(1)

# llama: full attention (sdpa); mistral: a sliding window on every layer (sdpa); gemma2: sliding and
# full layers alternating, eager attention (additive masks) and logit softcapping.
PACKING_FAMILIES = ["llama", "mistral", "gemma2"]
# every other test family, with CI's slow tests: per-layer-type rotary tables (gemma3), a window on
# some layers only (qwen2), a mixture of experts (qwen3_moe), fused projections (phi3)
ALL_FAMILIES = PACKING_FAMILIES + [
    pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f not in PACKING_FAMILIES
]
MAX_LENGTH = 24


def _samples(n: int = 9, seed: int = 0) -> list[Sample]:
    """Samples of 3..11 tokens (longer than the sliding window), some with a prompt without loss."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(3, 11)
        ids = tuple(rng.randrange(3, 100) for _ in range(length))
        prompt = rng.randint(0, length // 2)
        samples.append(Sample(ids, (IGNORE,) * prompt + ids[prompt:], prompt))
    return samples


def _packed_and_unpacked(samples: list[Sample]) -> tuple[dict, dict]:
    """One batch of every packed row, and one of every sample on its own row, right-padded."""
    packer = Batches(samples, 1, seed=0, shuffle=False, packing=True, max_length=MAX_LENGTH, pad_id=0)
    rows = packer.steps_per_epoch
    packed = Batches(samples, rows, seed=0, shuffle=False, packing=True, max_length=MAX_LENGTH, pad_id=0)
    unpacked = Batches(samples, len(samples), seed=0, shuffle=False, group_by_length=False, pad_id=0)
    return packed.next(), unpacked.next()


def _hf_loss_and_grads(model, **inputs) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _roundpipe_loss_and_grads(model, inputs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, policy="roundpipe", partition=None)
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        out = pipe.forward_backward(**inputs)
        grads = {e.name: e.grad.clone() for e in pipe.store.entries if e.trainable}
    return out.loss, grads


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def _block_mask(position_ids: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The oracle, from first principles: ``[b, 1, T, T]`` additive mask where a query sees the keys
    of its own sample (a new one starts wherever the position is 0) at or before it, and within
    ``window`` of it."""
    sample = (position_ids == 0).cumsum(-1)
    q, k = torch.arange(position_ids.shape[1])[:, None], torch.arange(position_ids.shape[1])[None, :]
    allowed = (sample[:, :, None] == sample[:, None, :]) & (k <= q)
    if window is not None:
        allowed &= k > q - window
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


@pytest.mark.parametrize("family", PACKING_FAMILIES)
def test_hf_with_a_block_diagonal_mask_on_the_packed_rows_equals_the_samples_unpacked(family):
    """The oracle checked: the HF model on the packed rows with their position ids and an explicit
    per-sample causal (sliding-window) mask gives the unpacked samples' loss and gradients; and so
    does transformers' own per-sample masking, with no attention mask (what the trainer passes).
    With the padding mask instead, attention crosses samples and the loss differs."""
    model = make_model(family)
    packed, unpacked = _packed_and_unpacked(_samples())
    assert packed["input_ids"].shape[0] < unpacked["input_ids"].shape[0]  # rows do hold several samples
    want_loss, want_grads = _hf_loss_and_grads(model, **model_inputs(unpacked))

    types = getattr(model.config, "layer_types", None) or []
    full = _block_mask(packed["position_ids"], None, torch.float32)
    sliding = _block_mask(packed["position_ids"], SLIDING_WINDOW, torch.float32)
    if family == "mistral":
        mask = sliding
    elif "sliding_attention" in types:
        mask = {"full_attention": full, "sliding_attention": sliding}
    else:
        mask = full
    ids, labels, positions = packed["input_ids"], packed["labels"], packed["position_ids"]
    loss, grads = _hf_loss_and_grads(
        model, input_ids=ids, labels=labels, attention_mask=mask, position_ids=positions
    )
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(grads, want_grads)

    loss, grads = _hf_loss_and_grads(model, **model_inputs(packed))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(grads, want_grads)

    # (a tiny random model's loss is near log(vocab) whatever it attends to: its gradients tell)
    _, crossing = _hf_loss_and_grads(
        model, **{**model_inputs(packed), "attention_mask": packed["attention_mask"]}
    )
    with pytest.raises(AssertionError):
        _assert_grads_close(crossing, want_grads)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_packed_training_through_roundpipe_equals_the_samples_unpacked(family):
    """fp32 on two devices, two microbatches: the packed rows' loss and gradients are those of the
    same samples unpacked through roundpipe, and of plain HF on the unpacked samples."""
    model = make_model(family)
    packed, unpacked = _packed_and_unpacked(_samples(seed=1))
    assert int((packed["labels"][:, 1:] != IGNORE).sum()) == int((unpacked["labels"][:, 1:] != IGNORE).sum())
    want_loss, want_grads = _roundpipe_loss_and_grads(model, model_inputs(unpacked))
    loss, grads = _roundpipe_loss_and_grads(model, model_inputs(packed))
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(grads, want_grads)
    hf_loss, _ = _hf_loss_and_grads(model, **model_inputs(unpacked))
    assert loss == pytest.approx(hf_loss, rel=1e-5)


def _tiny(model_type: str):
    import transformers

    from roundpipe.models.tiny import tiny_config

    config = tiny_config(transformers.AutoConfig.for_model(model_type), layers=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_a_family_whose_layers_carry_state_across_a_row_is_refused(model_type):
    """mamba (state-space layers only, no attention mask) and jamba (state-space layers among the
    attention ones) would carry one sample into the next: packing them is refused by name."""
    refusal = packing_refusal_of(_tiny(model_type))
    assert refusal is not None and model_type in refusal and "data.packing: false" in refusal
    assert all(packing_refusal_of(make_model(f, lora="default")) is None for f in PACKING_FAMILIES)


def test_the_trainer_refuses_packing_for_such_a_family(tmp_path, monkeypatch):
    from test_train import _recipe

    from roundpipe.runtime import Pipeline
    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    def no_pipeline(*_, **__):
        raise AssertionError("the refusal comes before the pipeline reads any weight")

    monkeypatch.setattr(Pipeline, "__init__", no_pipeline)
    recipe = _recipe(tmp_path, data={"packing": True}, run={"max_steps": 1, "grad_accum": 1})
    recipe["model"]["config"] = {"model_type": "lfm2", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "layer_types": ["conv", "full_attention"], "max_position_embeddings": 64}  # fmt: skip
    with pytest.raises(ConfigError, match=r"data\.packing: lfm2 cannot train on packed rows"):
        Trainer(config_from_dict(recipe), log=lambda *_: None).fit()


def test_data_packing_trains_on_rows_whose_position_ids_restart_per_sample(tmp_path, monkeypatch):
    """The trainer hands the pipeline each packed row with its position ids (restarting at every
    sample, where its eos was followed by the next sample) and no attention mask."""
    from test_train import _recipe

    from roundpipe.runtime import Pipeline
    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    seen = []
    real = Pipeline.forward_backward

    def record(self, input_ids, labels=None, attention_mask=None, position_ids=None, **kw):
        seen.append((input_ids, labels, attention_mask, position_ids))
        return real(self, input_ids, labels, attention_mask, position_ids, **kw)

    monkeypatch.setattr(Pipeline, "forward_backward", record)
    recipe = _recipe(
        tmp_path, data={"packing": True, "max_length": 48}, run={"max_steps": 1, "grad_accum": 1}
    )
    recipe["eval"], recipe["checkpoint"] = {"every": None}, {"every": None, "at_end": False}
    result = Trainer(config_from_dict(recipe), log=lambda *_: None).fit()
    assert result.steps == 1 and len(seen) == 1
    ids, labels, mask, positions = seen[0]
    assert mask is None and positions is not None and positions.shape == ids.shape == (8, 48)
    eos = EOS_ID  # the byte tokenizer's eos, which ends every packed sample
    restarts = 0
    for row_ids, row_labels, row_positions in zip(ids.tolist(), labels.tolist(), positions.tolist()):
        assert row_positions[0] == 0
        for t in range(1, 48):
            if row_positions[t] == 0:  # a sample (or the padding) starts here
                assert row_ids[t - 1] == eos and row_labels[t] == IGNORE
                restarts += 1
            else:
                assert row_positions[t] == row_positions[t - 1] + 1
    assert restarts >= 8  # rows do hold several samples


def test_the_trainer_refuses_rows_longer_than_the_models_positions(tmp_path, monkeypatch):
    """Packed rows of 96 tokens for a model configured for 64 positions: rotary angles the model never
    learned, which transformers does not refuse. The trainer does, before any weight is read."""
    from test_train import _recipe

    from roundpipe.runtime import Pipeline
    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    def no_pipeline(*_, **__):
        raise AssertionError("the refusal comes before the pipeline reads any weight")

    monkeypatch.setattr(Pipeline, "__init__", no_pipeline)
    recipe = _recipe(
        tmp_path, data={"packing": True, "max_length": 96}, run={"max_steps": 1, "grad_accum": 1}
    )
    with pytest.raises(
        ConfigError, match=r"data\.max_length: rows of 96 tokens .* 64 positions.*rope_scaling"
    ):
        Trainer(config_from_dict(recipe), log=lambda *_: None).fit()
