"""RoundPipe's rounds on the runtime: training stays exact against plain PyTorch, the host holds the
hand-offs of about a round instead of the whole batch (measured from the host tensors really
alive), and the deal goes on across steps and across accumulating calls."""

from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch
from support.memory_oracle import hand_offs_in_flight, microbatches_of, working_set
from support.reference import (
    EPS,
    LR,
    RunResult,
    assert_exact,
    pipeline_train,
    reference_train,
    reference_train_one_step_stale,
    trainable_weights,
)
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError, ScheduleError
from roundpipe.runtime.step import StepRun
from roundpipe.schedule import POLICIES

torch.set_num_threads(1)

STEPS = 4
# The deal, the accumulators and the memory bounds below are those of one layer per stage.
ONE_LAYER_PER_STAGE = {"policy": "roundpipe", "partition": None}
next_start_device = POLICIES["roundpipe"].next_start_device


_references: dict = {}


def references(family: str, lora, tied: bool, batch_size: int):
    """(model, batch, plain fp32 run, float64 run), made once per case."""
    key = (family, lora, tied, batch_size)
    if key not in _references:
        model = make_model(family, lora=lora, tied=tied)
        batch = make_batch(batch=batch_size, padding="left")
        plain = reference_train(model, batch, STEPS)
        exact = reference_train(copy.deepcopy(model).double(), batch, STEPS)
        _references[key] = (model, batch, plain, exact)
    return _references[key]


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    ("family", "lora", "tied", "devices", "batch", "microbatches", "round_size"),
    [
        # rounds of N, uneven microbatches (7 samples in 4: 2, 2, 2, 1)
        ("llama", None, False, "cpu:2", 7, 4, 2),
        # a short last round (3 + 1, the last below the device count)
        ("llama", None, False, "cpu:2", 7, 4, 3),
        # three devices, rounds 3 + 2, tied embeddings
        ("qwen3", None, True, "cpu:3", 7, 5, 3),
        # LoRA, one sample per microbatch, rounds 2 + 2 + 2
        ("qwen3", "default", True, "cpu:2", 6, 6, 2),
    ],
)
def test_fp32_training_with_rounds_equals_plain_pytorch(
    family, lora, tied, devices, batch, microbatches, round_size
):
    model, data, plain, exact = references(family, lora, tied, batch)
    got = pipeline_train(
        model, data, STEPS, devices=devices, num_microbatches=microbatches, round_size=round_size
    )
    assert_exact(got, plain, exact)


def _halves(batch):
    return [{k: v[i::2] for k, v in batch.items()} for i in range(2)]


def _label_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def test_accumulating_two_calls_with_rounds_gives_the_gradient_of_the_whole_step():
    """Two forward_backward calls (5 and 4 samples, 3 microbatches each in rounds of 2: uneven
    microbatches and a short last round) accumulate into one sync step."""
    model, batch, plain, exact = references("llama", None, False, 9)
    parts = _halves(batch)
    total = _label_tokens(batch)
    mine = copy.deepcopy(model)
    losses = []
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=3, round_size=2)
    with roundpipe.wrap(mine, config) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0)
        for _ in range(STEPS):
            summed = 0.0
            for i, part in enumerate(parts):
                out = pipe.forward_backward(**part, accumulate=i == 0, loss_tokens=total)
                summed += out.loss * out.num_tokens
            pipe.step()
            losses.append(summed / total)
        pipe.export_to(mine)
    assert_exact(RunResult(losses, trainable_weights(mine)), plain, exact)


def test_async_training_with_rounds_equals_plain_pytorch_one_update_late():
    model = make_model("llama")
    batch = make_batch(batch=7, padding="right")
    plain = reference_train_one_step_stale(model, batch, STEPS)
    exact = reference_train_one_step_stale(copy.deepcopy(model).double(), batch, STEPS)
    got = pipeline_train(
        model, batch, STEPS, devices="cpu:2", num_microbatches=5, round_size=2, optimizer_mode="async"
    )
    assert_exact(got, plain, exact)


# ---------------------------------------------------------------- host memory, measured


class LiveHandOffs:
    """Stands in for the host buffer pool and measures the hidden-state tensors it hands out
    (activations and their gradients: ``[batch, seq, hidden]``) that are still referenced
    anywhere. A tensor's bytes count from its ``acquire`` until Python frees the tensor object,
    whatever the runtime's ledgers say (the pool keeps the buffer, never the tensor it returned)."""

    def __init__(self, pool, hidden: int):
        self.pool, self.hidden = pool, hidden
        self.live = self.peak = 0
        self._lock = threading.Lock()

    def acquire(self, shape, dtype):
        t = self.pool.acquire(shape, dtype)
        if len(shape) == 3 and shape[-1] == self.hidden:
            nbytes = t.numel() * t.element_size()
            with self._lock:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, nbytes)
        return t

    def release(self, t, event=None):
        self.pool.release(t, event)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


def peak_hand_off_bytes(round_size, *, microbatches: int, layers: int) -> tuple[int, int]:
    """Train two steps of a llama of ``layers`` blocks (one sample per microbatch) on cpu:2; return
    the peak bytes of live hand-offs in the second step and those of one microbatch at one boundary."""
    model = make_model("llama", num_layers=layers)
    batch = make_batch(batch=microbatches, seq=12, padding=None)
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=microbatches, round_size=round_size, **ONE_LAYER_PER_STAGE
    )
    with roundpipe.wrap(model, config) as pipe:
        live = LiveHandOffs(pipe.backend.host_buffers, model.config.hidden_size)
        pipe.backend.host_buffers = live
        pipe.configure_optimizer(lr=LR)
        for _ in range(2):
            live.peak = live.live
            pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()
        assert live.live == 0, "every hand-off is freed by the end of the step"
    return live.peak, 12 * model.config.hidden_size * 4


@pytest.mark.slow  # ~10 s: many microbatches, measured step by step
def test_rounds_bound_the_live_hand_offs_on_the_host_by_two_rounds():
    """One layer per stage: 6 layers leave a microbatch's activation at 5 boundaries, and each
    device gets forward and backward deals in every round, so two rounds bound what is alive."""
    microbatches, layers = 12, 4
    boundaries = layers + 1  # embed | block 0..3 | head
    whole, unit = peak_hand_off_bytes(None, microbatches=microbatches, layers=layers)
    print(
        f"\nlive hand-offs, 12 microbatches on cpu:2: one round {whole} B ({whole / unit:.0f} x one boundary)"
    )
    for size in (2, 4):
        peak, _ = peak_hand_off_bytes(size, microbatches=microbatches, layers=layers)
        print(f"rounds of {size}: {peak} B ({peak / unit:.0f} x one boundary)")
        # two rounds of saved activations, plus a gradient in flight per microbatch of them
        assert peak <= 2 * size * (boundaries + 1) * unit
        assert 2 * peak < whole
    assert whole >= microbatches * boundaries * unit // 2  # without rounds: most of the step at once


# ---------------------------------------------------------------- device side


def test_a_stage_dealt_to_the_same_device_every_round_keeps_one_accumulator_and_the_memory_bound(
    monkeypatch,
):
    """5 layers on 3 devices: 9 deals a round, so every round deals the same stages to the same
    devices, and device 0's only backward stage (B2) sums its gradients over both rounds in one fp32
    accumulator, open while the next round's forwards run; the other stages go down once a round.
    The gradients equal plain PyTorch's, and what is alive on a device stays within two stages'
    weights and one microbatch's working set."""
    downloads: list[tuple[range, int]] = []
    on_grads = StepRun.on_grads

    def counted(self, layers, host_grads, contributions, event):
        downloads.append((layers, contributions))
        on_grads(self, layers, host_grads, contributions, event)

    monkeypatch.setattr(StepRun, "on_grads", counted)
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=12)
    ref = copy.deepcopy(model)
    ref(**batch, use_cache=False).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    split = microbatches_of(batch, 6)
    need = working_set(model, split) + hand_offs_in_flight(model, split)
    config = roundpipe.RunConfig(devices="cpu:3", num_microbatches=6, round_size=3, **ONE_LAYER_PER_STAGE)
    with roundpipe.wrap(model, config) as pipe:
        pipe.forward_backward(**batch)
        got = {e.name: e.grad.clone() for e in pipe.store.entries if e.trainable}
        peak = max(d["peak_bytes"] for d in pipe.stats()["devices"])
        two_stages = 2 * max(pipe.store.layer_bytes)  # one layer per stage
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    per_stage: dict[int, list[int]] = {}
    for layers, contributions in downloads:
        per_stage.setdefault(layers.start, []).append(contributions)
    assert per_stage == {0: [3, 3], 1: [3, 3], 2: [6], 3: [3, 3], 4: [3, 3]}
    assert two_stages < peak <= two_stages + need


# ---------------------------------------------------------------- the deal across calls


def test_the_deal_goes_on_across_steps_and_accumulating_calls():
    """Every forward_backward call, accumulating or not, starts its deal on the device after the
    one the previous call's last round ended on."""
    model = make_model("llama")
    batch = make_batch(batch=5)
    config = roundpipe.RunConfig(devices="cpu:3", num_microbatches=5, round_size=3, **ONE_LAYER_PER_STAGE)
    with roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=LR)
        tables = []
        for accumulate in (True, False, False, True, False):
            pipe.forward_backward(**batch, accumulate=accumulate)
            tables.append(pipe.last_plan.table)
            if not accumulate:
                pipe.step()
    assert tables[0].options["start_device"] == 0
    for before, after in zip(tables, tables[1:]):
        assert after.options["round_size"] == 3
        assert after.options["start_device"] == next_start_device(before)
    # 4 stages each way: 7 deals per round, two rounds, so each call moves the deal on 14 = 2 mod 3
    assert [t.options["start_device"] for t in tables] == [0, 2, 1, 0, 2]


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(round_size=0), "round_size must be a positive int"),
        (dict(round_size=2.5), "round_size must be a positive int"),
        (dict(round_size=2, policy="gpipe"), "which policy 'gpipe' does not do"),
        (dict(round_size=2, policy_options={"round_size": 3}), "disagree"),
    ],
)
def test_bad_round_size_is_a_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        roundpipe.RunConfig(**kwargs)


def test_a_round_smaller_than_the_device_count_says_what_to_use():
    model = make_model("llama")
    batch = make_batch(batch=4)
    config = roundpipe.RunConfig(devices="cpu:3", num_microbatches=4, round_size=2, **ONE_LAYER_PER_STAGE)
    with roundpipe.wrap(model, config) as pipe, pytest.raises(ScheduleError, match="round_size >= 3"):
        pipe.forward_backward(**batch)


def test_round_size_in_policy_options_works_too():
    model, data, plain, exact = references("llama", None, False, 7)
    got = pipeline_train(
        model, data, STEPS, devices="cpu:2", num_microbatches=4, policy_options={"round_size": 2}
    )
    assert_exact(got, plain, exact)
