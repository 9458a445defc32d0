"""The backbone: roundpipe trains exactly like plain PyTorch (+ peft + torch.optim.AdamW)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import (
    assert_exact,
    assert_same_run,
    pipeline_train,
    reference_train,
    reference_train_one_step_stale,
    trainable_weights,
)
from support.tiny_models import FAMILIES, make_batch, make_model

torch.set_num_threads(1)

STEPS = 5
# The matrix below runs roundpipe with one layer per stage, every layer recomputed in its backward
# stage (what the tests were written for); the automatic defaults have their own cases further down.
ROUNDPIPE = {"policy": "roundpipe", "partition": None}
_reference_cache: dict = {}


def _reference(family, lora, tied, padding):
    key = (family, lora, tied, padding)
    if key not in _reference_cache:
        model = make_model(family, lora=lora, tied=tied)
        batch = make_batch(batch=6, padding=padding)
        _reference_cache[key] = (model, batch, reference_train(model, batch, STEPS))
    return _reference_cache[key]


VARIANTS = (("left", 1), ("left", 3), ("left", 4), ("right", 3))  # (padding, microbatches)


def _cases() -> list:
    """Every family x LoRA/full x tied/untied x padding and microbatch variant. ``make test`` runs a
    quarter of them (the rest are marked slow; CI runs them all): each family still meets LoRA and
    full, tied and untied, and all four variants, rotated over the families so that every
    (family, variant) and (LoRA, tied, variant) pair runs somewhere."""
    cases = []
    for k, family in enumerate(FAMILIES):
        for i, lora in enumerate((None, "default")):
            for j, tied in enumerate((False, True)):
                for v, (padding, mb) in enumerate(VARIANTS):
                    quick = v == (2 * i + j + k) % len(VARIANTS)
                    marks = () if quick else (pytest.mark.slow,)
                    cases.append(pytest.param(family, lora, tied, padding, mb, marks=marks))
    return cases


CASES = _cases()


@pytest.mark.parametrize(("family", "lora", "tied", "padding", "microbatches"), CASES)
def test_fp32_training_equals_plain_pytorch(family, lora, tied, padding, microbatches):
    model, batch, want = _reference(family, lora, tied, padding)
    got = pipeline_train(
        model, batch, STEPS, devices="cpu:1", num_microbatches=microbatches, dtype="fp32", **ROUNDPIPE
    )
    assert_same_run(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_all_linear_lora_equals_plain_pytorch(family):
    model = make_model(family, lora="all-linear")
    batch = make_batch(batch=6, padding="left")
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, devices="cpu:1", num_microbatches=3, **ROUNDPIPE)
    assert_same_run(got, want)


@pytest.mark.parametrize(
    ("devices", "microbatches"),
    [("cpu:2", 3), ("cpu:3", 4), pytest.param("cpu:4", 6, marks=pytest.mark.slow)],
)
def test_several_devices_give_the_same_training(devices, microbatches):
    model, batch, want = _reference("qwen3", None, True, "left")
    got = pipeline_train(model, batch, STEPS, devices=devices, num_microbatches=microbatches, **ROUNDPIPE)
    assert_same_run(got, want)


@pytest.mark.parametrize(
    ("family", "lora", "tied", "padding"),
    [
        ("llama", None, False, "left"),
        ("qwen3", "default", True, "right"),
        ("gemma3_text", None, True, "left"),
    ],
)
@pytest.mark.parametrize("round_size", [2, 3])
def test_roundpipe_rounds_train_like_plain_pytorch(family, lora, tied, padding, round_size):
    """6 samples in 4 uneven microbatches on 2 devices, dealt in rounds of 2 (2 + 2) or of 3
    (3 + a short last round of 1); more cases in tests/test_rounds_runtime.py."""
    model, batch, want = _reference(family, lora, tied, padding)
    got = pipeline_train(
        model, batch, STEPS, devices="cpu:2", num_microbatches=4, round_size=round_size, **ROUNDPIPE
    )
    assert_same_run(got, want)


# RunConfig's defaults (policy, partition and microbatch count "auto"): the first step profiles
# the layers and the plan is chosen from the measured times; whatever it chooses trains exactly.
AUTO_CASES = [
    ("llama", None, False, "left", "cpu:1", "sync"),
    ("qwen3", "default", True, "right", "cpu:2", "sync"),
    ("gemma3_text", None, True, "left", "cpu:3", "sync"),
    ("llama", None, False, "left", "cpu:2", "async"),
]


@pytest.mark.parametrize(("family", "lora", "tied", "padding", "devices", "optimizer_mode"), AUTO_CASES)
def test_the_automatic_defaults_train_exactly(family, lora, tied, padding, devices, optimizer_mode):
    """Several AdamW steps on the defaults against plain fp32 PyTorch and a float64 run (the
    weights no further from float64 than twice plain fp32's distance); the first, profiling step
    is the first loss compared."""
    model = make_model(family, lora=lora, tied=tied)
    batch = make_batch(batch=6, padding=padding)
    baseline = reference_train_one_step_stale if optimizer_mode == "async" else reference_train
    plain = baseline(model, batch, STEPS)
    exact = baseline(copy.deepcopy(model).double(), batch, STEPS)
    got = pipeline_train(model, batch, STEPS, devices=devices, optimizer_mode=optimizer_mode)
    assert_exact(got, plain, exact)


def test_the_profiling_first_step_of_the_defaults_gives_the_plain_gradients():
    """The first forward_backward on the defaults profiles the layers (whose gradients it
    discards), chooses the plan, and runs the batch: its gradients are plain PyTorch's."""
    import roundpipe

    model = make_model("qwen3", tied=True)
    batch = make_batch(batch=6, padding="left")
    ref = copy.deepcopy(model)
    ref(**batch, use_cache=False).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2")) as pipe:
        pipe.forward_backward(**batch)
        assert pipe.layer_times is not None and pipe.plan.why["policy"].startswith("auto: ")
        got = {e.name: e.grad for e in pipe.store.entries if e.trainable}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_gradient_clipping_equals_clip_grad_norm():
    model = make_model("llama")
    batch = make_batch(batch=6, padding="right")
    want = reference_train(model, batch, STEPS, max_grad_norm=0.05)
    got = pipeline_train(
        model, batch, STEPS, devices="cpu:2", num_microbatches=3, max_grad_norm=0.05, **ROUNDPIPE
    )
    assert_same_run(got, want)


def test_gradients_equal_plain_backward_before_any_step():
    """The accumulated fp32 gradients themselves, not only the weights Adam makes of them."""
    import roundpipe

    model = make_model("gemma2", tied=True)
    batch = make_batch(batch=6, padding="left")
    ref = copy.deepcopy(model)
    ref(**batch, use_cache=False).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=4, **ROUNDPIPE)) as pipe:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        got = {e.name: e.grad for e in pipe.store.entries if e.trainable}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_bf16_tracks_plain_autocast(family):
    """bf16 weights and activations on the workers, fp32 masters on the CPU.

    Tolerance: plain autocast keeps fp32 weights and casts per matmul, while roundpipe uploads bf16
    weights and keeps bf16 activations between layers; both round to bf16's 8-bit mantissa
    (relative step 2**-8 = 0.4%), so the losses agree to 1% over 5 steps, and each parameter's
    total update (new - initial weights) agrees with autocast's to 10% in norm. Elementwise weight
    checks are meaningless here: Adam turns a 1% gradient error on a tiny element into a full step.
    """
    model = make_model(family, lora="default")
    batch = make_batch(batch=6, padding="left")
    start = trainable_weights(model)
    want = reference_train(model, batch, STEPS, autocast_dtype=torch.bfloat16)
    got = pipeline_train(model, batch, STEPS, devices="cpu:2", num_microbatches=3, dtype="bf16", **ROUNDPIPE)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-2, atol=0.0)
    for name in want.weights:
        delta_want = want.weights[name] - start[name]
        delta_got = got.weights[name] - start[name]
        assert (delta_got - delta_want).norm() <= 0.1 * delta_want.norm(), name


def test_fp16_with_loss_scaling_trains():
    model = make_model("llama", lora="default")
    batch = make_batch(batch=6, padding="left")
    want = reference_train(model, batch, STEPS, autocast_dtype=torch.float16)
    got = pipeline_train(model, batch, STEPS, devices="cpu:1", num_microbatches=2, dtype="fp16", **ROUNDPIPE)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=2e-2, atol=0.0)
