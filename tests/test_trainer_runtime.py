"""What the trainer needs from the runtime, against plain PyTorch: gradient accumulation whose
gradient is that of the token-mean loss over the whole optimizer step (``loss_tokens``), and a
held-out evaluation (``Pipeline.evaluate``) that leaves training exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from support.reference import EPS, LR, trainable_weights
from support.tiny_models import make_batch, make_model

import roundpipe

torch.set_num_threads(1)


def _halves(batch):
    return [{k: v[i::2] for k, v in batch.items()} for i in range(2)]


def _label_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_accumulated_micro_steps_give_the_gradient_of_the_whole_step(devices):
    model = make_model("llama")
    batch = make_batch(batch=8, padding="right", seed=3)
    parts = _halves(batch)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS)
    ref_losses = []
    for _ in range(3):
        loss = ref(**batch, use_cache=False).loss  # HF's token mean over the whole batch
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    mine = copy.deepcopy(model)
    total = _label_tokens(batch)
    losses = []
    with roundpipe.wrap(mine, roundpipe.RunConfig(devices=devices, num_microbatches=2)) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS)
        for _ in range(3):
            summed = 0.0
            for i, part in enumerate(parts):
                out = pipe.forward_backward(
                    part["input_ids"],
                    labels=part["labels"],
                    attention_mask=part["attention_mask"],
                    accumulate=i == 0,
                    loss_tokens=total,
                )
                summed += out.loss * out.num_tokens
            pipe.step()
            losses.append(summed / total)
        pipe.export_to(mine)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    want = trainable_weights(ref)
    for name, w in trainable_weights(mine).items():
        torch.testing.assert_close(w, want[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_loss_tokens_below_the_batch_own_count_is_an_input_error():
    batch = make_batch(batch=4)
    with (
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:1")) as pipe,
        pytest.raises(roundpipe.InputError, match="loss_tokens"),
    ):
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"], loss_tokens=1)


@pytest.mark.parametrize("optimizer_mode", ["sync", "async"])
def test_evaluation_between_steps_gives_the_plain_loss_and_leaves_training_unchanged(optimizer_mode):
    model = make_model("qwen3", lora="default")
    train = make_batch(batch=4, seed=1)
    held_out = make_batch(batch=4, seed=2)

    def run(evaluate: bool):
        m = copy.deepcopy(model)
        losses, evals = [], []
        # Both runs are compared bit for bit, so they must run one plan: name it (the automatic
        # choice could differ between two profiles of a noisy machine).
        config = roundpipe.RunConfig(
            devices="cpu:2",
            num_microbatches=2,
            optimizer_mode=optimizer_mode,
            policy="roundpipe",
            partition=None,
        )
        with roundpipe.wrap(m, config) as pipe:
            pipe.configure_optimizer(lr=1e-2, eps=EPS)
            for _ in range(3):
                losses.append(pipe.forward_backward(**train).loss)
                pipe.step()
                if evaluate:
                    evals.append(pipe.evaluate(**held_out).loss)
            pipe.export_to(m)
        return losses, evals, trainable_weights(m), m

    plain_losses, _, plain_weights, _ = run(evaluate=False)
    losses, evals, weights, trained = run(evaluate=True)
    assert losses == plain_losses  # bit for bit: evaluation changed nothing
    for name, w in weights.items():
        assert torch.equal(w, plain_weights[name]), name
    with torch.no_grad():  # the last evaluation saw the weights the next step would read
        if optimizer_mode == "sync":
            want = trained(**held_out, use_cache=False).loss.item()
            assert evals[-1] == pytest.approx(want, rel=1e-5)
    assert all(e > 0 for e in evals)


def test_async_accumulation_reads_the_same_weights_as_one_whole_batch():
    """Async mode's staleness is counted in optimizer steps: every call that accumulates into
    step k computes on the same weights, so two halves train as the whole batch does."""
    model = make_model("llama")
    batch = make_batch(batch=8, padding="right", seed=5)
    total = _label_tokens(batch)

    def run(split: bool):
        m = copy.deepcopy(model)
        losses = []
        with roundpipe.wrap(
            m, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, optimizer_mode="async")
        ) as pipe:
            pipe.configure_optimizer(lr=LR, eps=EPS)
            for _ in range(4):
                parts = _halves(batch) if split else [batch]
                summed = 0.0
                for i, part in enumerate(parts):
                    out = pipe.forward_backward(**part, accumulate=i < len(parts) - 1, loss_tokens=total)
                    summed += out.loss * out.num_tokens
                pipe.step()
                losses.append(summed / total)
            pipe.export_to(m)
        return losses, trainable_weights(m)

    whole_losses, whole_weights = run(split=False)
    split_losses, split_weights = run(split=True)
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    for name, w in split_weights.items():
        torch.testing.assert_close(w, whole_weights[name], rtol=1e-4, atol=1e-6)


def test_an_async_update_under_way_keeps_its_learning_rate(monkeypatch):
    """``set_lr`` right after an async ``step()`` is queued behind the update still running on the
    host thread (a schedule changes the rate every step), so that update uses its own rate."""
    import time

    from roundpipe.runtime.optimizer_steps import OptimizerSteps

    slow = OptimizerSteps.deferred_step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.5)  # the caller's thread reaches set_lr long before the update starts
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(OptimizerSteps, "deferred_step", slow_step)
    model = make_model("llama")
    batch = make_batch(batch=4)

    def run(change_lr_early: bool):
        m = copy.deepcopy(model)
        config = roundpipe.RunConfig(
            devices="cpu:1", optimizer_mode="async", policy="roundpipe", partition=None, num_microbatches=1
        )  # one plan for both runs, compared bit for bit
        with roundpipe.wrap(m, config) as pipe:
            pipe.configure_optimizer(lr=LR, eps=EPS)
            pipe.forward_backward(**batch)
            pipe.step()
            if change_lr_early:
                pipe.set_lr(100.0)  # for the next update only
            pipe.export_to(m)  # waits for the update
        return trainable_weights(m)

    want, got = run(change_lr_early=False), run(change_lr_early=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_an_evaluation_batch_smaller_than_the_microbatch_count_runs_with_fewer_microbatches():
    """A held-out set's short last batch: fewer microbatches (one per sample), the plain loss; a
    training batch that short is still refused."""
    model = make_model("llama")
    short = make_batch(batch=2, seed=4)
    with torch.no_grad():
        want = model(**short, use_cache=False).loss.item()
    with roundpipe.wrap(
        copy.deepcopy(model), roundpipe.RunConfig(devices="cpu:2", num_microbatches=4)
    ) as pipe:
        assert pipe.evaluate(**short).loss == pytest.approx(want, rel=1e-5)
        with pytest.raises(roundpipe.InputError, match="num_microbatches=4 is larger than the batch"):
            pipe.forward_backward(**short)
