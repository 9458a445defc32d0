"""Every random draw a layer's forward makes is replayed: the backward's recomputation draws what
the forward drew, whichever device or thread ran it.

Draws are seeded per task by (run seed, step, layer, microbatch, data-parallel rank). The oracle
for the gradients is plain peft run with the same draws: a forward pre-hook reseeds torch's
generator before each layer with the seed roundpipe gives that layer (``draw_seed``), and plain
autograd keeps the forward's masks without recomputing anything. Besides: two seeded runs agree
bit for bit, and so do runs on 1, 2 and 3 devices.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import EPS, LR, trainable_weights
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.runtime.compute import draw_seed

torch.set_num_threads(1)

peft = pytest.importorskip("peft")

PINNED = dict(policy="roundpipe", partition=None, verify_model=False)  # the proof is tested elsewhere


def _loha(rank_dropout: float, module_dropout: float):
    model = make_model("llama")
    config = peft.LoHaConfig(
        r=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_dropout=rank_dropout,
        module_dropout=module_dropout,
        init_weights=False,
    )
    return peft.get_peft_model(model, config)


def _lokr(rank_dropout: float):
    model = make_model("llama")
    config = peft.LoKrConfig(
        r=4, alpha=8, target_modules=["q_proj", "v_proj"], rank_dropout=rank_dropout, init_weights=False
    )
    return peft.get_peft_model(model, config)


ADAPTERS = {
    "loha-rank-dropout": lambda: _loha(0.5, 0.0),
    "loha-module-dropout": lambda: _loha(0.0, 0.5),
    "loha-both": lambda: _loha(0.3, 0.3),
    "lokr-rank-dropout": lambda: _lokr(0.5),
}


def _hf(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _plain_grads_under_roundpipe_draws(model, batch, seed: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Plain peft's gradients of one microbatch (the whole batch) when every decoder layer draws
    from the generator roundpipe seeds it with (layer index 0 is the embedding)."""
    model = copy.deepcopy(model)
    hooks = []
    for k, block in enumerate(_hf(model).model.layers):

        def reseed(module, args, index=k + 1):
            torch.manual_seed(draw_seed(seed, step, index, 0))

        hooks.append(block.register_forward_pre_hook(reseed))
    with torch.random.fork_rng():
        _hf(model)(**batch, use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad for n, p in _hf(model).named_parameters() if p.requires_grad}


def _first_grads(model, batch, seed: int, devices: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    config = roundpipe.RunConfig(devices=devices, num_microbatches=1, seed=seed, **PINNED)
    with roundpipe.wrap(model, config) as pipe:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        return {e.name: e.grad for e in pipe.store.entries if e.trainable}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_peft_random_adapters_get_the_gradient_of_their_own_draws(adapter, seed):
    """LoHa/LoKr ``rank_dropout`` and LoHa ``module_dropout`` draw on the host (``torch.rand``, no
    ``nn.Dropout``): the recompute must draw the same, or the gradient is of another mask."""
    model = ADAPTERS[adapter]()
    batch = make_batch(batch=4, padding=None)
    want = _plain_grads_under_roundpipe_draws(model, batch, seed)
    got = _first_grads(model, batch, seed, "cpu:2")
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if w is None:  # a module dropped in the whole batch: no gradient in plain peft
            assert g is None or not g.any(), name
            continue
        assert g is not None, f"{name}: no gradient, plain peft has one"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _train(model, batch, steps: int, devices: str, seed: int = 7, microbatches: int = 4):
    model = copy.deepcopy(model)
    config = roundpipe.RunConfig(devices=devices, num_microbatches=microbatches, seed=seed, **PINNED)
    with roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0)
        losses = []
        for _ in range(steps):
            out = pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
            losses.append(out.loss)
        pipe.export_to(model)
    return losses, trainable_weights(model)


def _assert_identical(a, b, what: str) -> None:
    assert a[0] == b[0], f"{what}: losses {a[0]} != {b[0]}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"{what}: {name} differs"


@pytest.mark.slow
def test_seeded_runs_agree_bit_for_bit_whatever_the_device_count():
    model = ADAPTERS["loha-both"]()
    batch = make_batch(batch=8)
    two = _train(model, batch, 3, "cpu:2")
    _assert_identical(_train(model, batch, 3, "cpu:2"), two, "cpu:2 twice")
    _assert_identical(_train(model, batch, 3, "cpu:1"), two, "cpu:1 against cpu:2")
    _assert_identical(_train(model, batch, 3, "cpu:3"), two, "cpu:3 against cpu:2")


@pytest.mark.slow
def test_module_dropout_that_drops_a_whole_stage_trains_on():
    """With ``module_dropout`` a stage's every adapter can be skipped for a microbatch: its output
    then needs no gradient, and the stage's backward has nothing to do (it used to fail with
    "element 0 of tensors does not require grad"). 20 steps of 4 microbatches at p=0.5 make it
    happen many times over."""
    model = _loha(0.0, 0.5)
    batch = make_batch(batch=8)
    losses, weights = _train(model, batch, 20, "cpu:2")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(w).all() for w in weights.values())


def _gpt2(embd_pdrop: float):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        embd_pdrop=embd_pdrop,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def test_gpt2_embedding_dropout_is_replayed_and_seeded_runs_agree():
    """GPT-2 drops out its embeddings (``embd_pdrop``) inside the embedding layer."""
    model = _gpt2(0.1)
    batch = make_batch(batch=8)
    first = _train(model, batch, 3, "cpu:2")
    _assert_identical(_train(model, batch, 3, "cpu:2"), first, "cpu:2 twice")
    # The first step's gradient is that of the loss roundpipe reports: plain GPT-2 with the
    # embedding layer drawing what roundpipe seeds it with.
    plain = copy.deepcopy(model)
    plain.transformer.drop.register_forward_pre_hook(
        lambda m, a: torch.manual_seed(draw_seed(3, 0, 0, 0)) and None
    )
    with torch.random.fork_rng():
        plain(**batch, use_cache=False).loss.backward()
    got = _first_grads(model, batch, 3, "cpu:2")
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _lora_with_dropout():
    model = make_model("llama")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def _full_with_dropout():
    model = make_model("llama")
    model.config.attention_dropout = 0.1
    for block in model.model.layers:  # each attention read it from the config when it was built
        block.self_attn.attention_dropout = 0.1
    return model


@pytest.mark.parametrize("make", [_lora_with_dropout, _full_with_dropout], ids=["lora", "full"])
def test_two_seeded_runs_give_identical_losses_and_weights_with_dropout_on(make):
    model = make()
    batch = make_batch(batch=8)
    first = _train(model, batch, 3, "cpu:2")
    _assert_identical(_train(model, batch, 3, "cpu:2"), first, "cpu:2 twice")
    other = _train(model, batch, 3, "cpu:2", seed=8)
    assert other[0] != first[0], "another seed draws other masks"


def test_monteclora_is_refused_at_wrap_time():
    """MonteCLoRA hands each forward the next of a buffer of pre-drawn samples (and keeps the last
    one on the module): a recompute would take another sample, so it cannot be replayed."""
    from roundpipe.errors import UnsupportedModel

    if not hasattr(peft.tuners.lora.config, "MontecloraConfig"):
        pytest.skip("this peft has no MonteCLoRA")
    model = make_model("llama")
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        monteclora_config=peft.tuners.lora.config.MontecloraConfig(num_samples=2, buffer_size=4),
    )
    model = peft.get_peft_model(model, config)
    with pytest.raises(UnsupportedModel, match="(?i)monteclora"):
        roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", **PINNED))


def _draws(seed: int | None, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A closure on a fresh ``cpu:1`` compute stream draws a device tensor (a random kernel, run
    later on the stream's thread) and a host one (random host work, run at issue), inside
    ``Device.seeded(seed)`` or, for None, outside any seeded block."""
    from contextlib import nullcontext

    from roundpipe.backend.cpu import CpuBackend

    backend = CpuBackend(1, sanitize=False)
    dev, out = backend.devices[0], {}

    def draw():
        with dev.seeded(seed) if seed is not None else nullcontext():
            out["device"] = torch.rand(64)
            out["host"] = torch.bernoulli(host)
            out["device"] = torch.cat([out["device"], torch.rand(64)])  # a second kernel
        dev.ledger.reserve(out["device"], "draw", "activations")

    try:
        stream = dev.streams["compute"]
        stream.submit(draw, name="draw")
        stream.synchronize()
        return out["device"].clone(), out["host"].clone()
    finally:
        backend.close()


def test_the_cpu_backend_seeds_kernels_and_host_work_and_leaves_the_default_generator_alone():
    host = torch.full((64,), 0.5)
    before = torch.get_rng_state()
    device, drawn = _draws(11, host)
    assert torch.equal(torch.get_rng_state(), before)
    again = _draws(11, host)
    assert torch.equal(again[0], device) and torch.equal(again[1], drawn)
    other = _draws(12, host)
    assert not torch.equal(other[0], device) and not torch.equal(other[1], drawn)
    # The host draws come from another generator than the kernels' (not the same numbers).
    assert not torch.equal(drawn, (device[:64] < 0.5).float())


def test_the_cpu_backend_advances_the_default_generator_outside_seeded_blocks():
    """As a CUDA kernel advances the device's generator: two unseeded draws differ (the backend
    used to restore the default generator after each random kernel, so every unseeded draw was the
    same and an unseeded recompute replayed its forward by accident)."""
    host = torch.full((64,), 0.5)
    device, drawn = _draws(None, host)
    assert not torch.equal(device[:64], device[64:])
    assert not torch.equal(drawn, _draws(None, host)[1])
