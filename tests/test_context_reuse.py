"""A device builds a microbatch's layer context (masks, rotary tables: the base model's forward
through the context view) only when the microbatch's mask and positions differ from those of the
context it holds; a microbatch like the last one reuses that context's tables and uploads only its
own ids and labels. Reused or rebuilt, training equals plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from support.reference import assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.models.views import ContextView

torch.set_num_threads(1)

STEPS = 3
ONE_LAYER_PER_STAGE = {"policy": "roundpipe", "partition": None}


@pytest.fixture
def context_builds(monkeypatch):
    """The number of times any device ran the context view (the build of a layer context)."""
    count = [0]
    forward = ContextView.forward

    def counted(self, *args, **kwargs):
        count[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ContextView, "forward", counted)
    return count


def _step(pipe, batch):
    pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch.get("attention_mask")
    )
    pipe.step()


@pytest.mark.parametrize("mask", [True, False], ids=["all-ones mask", "no mask"])
def test_microbatches_of_one_shape_and_mask_build_one_context_per_device_and_step(context_builds, mask):
    batch = make_batch(batch=8, padding=None)
    if not mask:
        del batch["attention_mask"]
    devices = 2
    with roundpipe.wrap(
        make_model("llama", num_layers=3),
        roundpipe.RunConfig(devices=f"cpu:{devices}", num_microbatches=4, **ONE_LAYER_PER_STAGE),
    ) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for step in range(STEPS):
            before = context_builds[0]
            _step(pipe, batch)
            assert context_builds[0] - before == devices, f"step {step}: one build per device"
            for dev in pipe.backend.devices:
                assert dev.ledger.by_tag.get("context", 0) == 0, "the step released every context"


def _trains_like_plain_pytorch(family: str, batch: dict, devices: str) -> None:
    model = make_model(family, num_layers=3)
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(
        model, batch, STEPS, devices=devices, num_microbatches=4, dtype="fp32", **ONE_LAYER_PER_STAGE
    )
    assert_same_run(got, want)


def test_reused_contexts_train_like_plain_pytorch():
    _trains_like_plain_pytorch("qwen3", make_batch(batch=8, padding=None), "cpu:2")


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_microbatch_whose_mask_differs_gets_its_own_context(context_builds, padding):
    # Sample i has i % 4 padding tokens: with 2 samples a microbatch, microbatches 0 and 2 share a
    # mask, 1 and 3 share another, so a device running them in order rebuilds at every microbatch;
    # reusing a context across a mask change would train differently from plain PyTorch.
    _trains_like_plain_pytorch("llama", make_batch(batch=8, padding=padding), "cpu:1")
    assert context_builds[0] >= STEPS * 4  # every microbatch of every step (and the wrap's checks)


def test_microbatches_that_differ_only_in_positions_get_their_own_contexts(context_builds):
    # Packed rows: the same (all-ones) mask, different position ids per microbatch.
    batch = make_batch(batch=4, padding=None)
    seq = batch["input_ids"].shape[1]
    cuts = [4, 6, 8, 3]  # where each row's second sequence starts
    batch["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(seq - c)]) for c in cuts])
    _trains_like_plain_pytorch("llama", batch, "cpu:1")
    assert context_builds[0] >= STEPS * 4  # every microbatch of every step (and the wrap's checks)
