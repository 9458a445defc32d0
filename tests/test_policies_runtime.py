"""Every executable dispatch policy trains exactly like plain PyTorch on the same workers."""

from __future__ import annotations

import pytest
import torch
from reference import assert_same_run, pipeline_train, reference_train
from tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError

torch.set_num_threads(1)

STEPS = 3
_refs: dict = {}


def _reference(lora):
    if lora not in _refs:
        model = make_model("qwen3", num_layers=4, tied=True, lora=lora)
        batch = make_batch(batch=8, padding="left")
        _refs[lora] = (model, batch, reference_train(model, batch, STEPS))
    return _refs[lora]


CASES = [
    ("roundpipe", "cpu:3", 4),
    ("roundpipe", "cpu:4", 8),
    ("gpipe", "cpu:2", 4),
    ("gpipe", "cpu:4", 8),
    ("1f1b", "cpu:2", 2),
    ("1f1b", "cpu:3", 8),
    ("interleaved", "cpu:2", 4),
    ("chimera", "cpu:2", 4),
    ("hanayo", "cpu:2", 4),
]


@pytest.mark.parametrize("lora", [None, "default"])
@pytest.mark.parametrize(("policy", "devices", "microbatches"), CASES)
def test_policy_trains_like_plain_pytorch(policy, devices, microbatches, lora):
    model, batch, want = _reference(lora)
    got = pipeline_train(model, batch, STEPS, devices=devices, num_microbatches=microbatches, policy=policy)
    assert_same_run(got, want)


def test_a_policy_the_runtime_cannot_run_says_so():
    with pytest.raises(ConfigError, match="'zb' cannot run yet"):
        roundpipe.RunConfig(policy="zb")


def test_too_many_stages_for_the_model_is_a_config_error():
    model = make_model("llama", num_layers=2)  # 4 layers: embed, 2 blocks, head
    with (
        roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:3", policy="interleaved")) as pipe,
        pytest.raises(ConfigError, match="needs 6 stages but the model has only 4 layers"),
    ):
        pipe.forward_backward(make_batch(batch=2)["input_ids"], labels=make_batch(batch=2)["labels"])
