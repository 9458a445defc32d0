"""Readiness-first dispatch under varying work (issue 14): per-microbatch trimming of trailing
padding (exact against plain PyTorch), the ``slow`` fault kind, the simulator's jitter, slow-device
and ``order="ready"`` options, and strict against ready order giving the same training."""

from __future__ import annotations

import pytest
import torch
from support.reference import assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError
from roundpipe.presets import load_hardware
from roundpipe.runtime.inputs import split_batch
from roundpipe.schedule import build_table
from roundpipe.sim.choice import default_partition
from roundpipe.sim.options import SimOptions
from roundpipe.sim.scenario import Scenario, run_scenario
from roundpipe.sim.simulator import simulate, without_costs
from roundpipe.sim.workload import uniform_workload
from roundpipe.testing import faults

torch.set_num_threads(1)

STEPS = 3


def _ragged_right(batch: int = 6, seq: int = 12, lengths=(12, 11, 7, 5, 9, 4), seed: int = 0) -> dict:
    """Right-padded samples of the given real lengths (labels -100 on padding and on the first real
    token): microbatches of two samples then end in different numbers of all-padding columns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for i, n in enumerate(lengths[:batch]):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _split(batch: dict, microbatches: int, position_ids=None):
    return split_batch(
        batch["input_ids"],
        batch["labels"],
        batch.get("attention_mask"),
        position_ids,
        vocab_size=256,
        microbatch_count=lambda _: microbatches,
    )


# ----------------------------------------------------------------- per-microbatch trimming
def test_each_microbatch_is_cut_to_its_own_longest_sample():
    batch = _ragged_right()
    mbs, total = _split(batch, 3)
    assert [mb.seq_len for mb in mbs] == [12, 7, 9]
    assert total == int((batch["labels"][:, 1:] != -100).sum())  # the whole batch's label count
    for mb, rows in zip(mbs, (slice(0, 2), slice(2, 4), slice(4, 6))):
        n = mb.seq_len
        assert torch.equal(mb.input_ids, batch["input_ids"][rows, :n])
        assert torch.equal(mb.attention_mask, batch["attention_mask"][rows, :n])
        assert torch.equal(mb.labels, batch["labels"][rows, :n])
    assert sum(mb.loss_positions.numel() for mb in mbs) == total


def test_position_ids_are_cut_with_their_microbatch():
    batch = _ragged_right()
    shared = torch.arange(12).unsqueeze(0) + 5
    mbs, _ = _split(batch, 3, position_ids=shared)
    assert [tuple(mb.position_ids.shape) for mb in mbs] == [(1, 12), (1, 7), (1, 9)]
    per_row = torch.arange(12).repeat(6, 1)
    mbs, _ = _split(batch, 3, position_ids=per_row)
    assert [tuple(mb.position_ids.shape) for mb in mbs] == [(2, 12), (2, 7), (2, 9)]


def test_columns_that_still_hold_a_label_or_a_token_are_kept():
    batch = _ragged_right()
    batch["labels"][3, 8] = 17  # a label on a padded column counts in the loss: keep it
    mbs, _ = _split(batch, 3)
    assert mbs[1].seq_len == 9
    left = make_batch(batch=6, padding="left")  # left padding: the padding is not trailing
    assert {mb.seq_len for mb in _split(left, 3)[0]} == {12}
    unmasked = _ragged_right()
    unmasked.pop("attention_mask")  # no mask: every column is a token
    assert {mb.seq_len for mb in _split(unmasked, 3)[0]} == {12}


@pytest.mark.parametrize(
    ("family", "policy", "devices"),
    [
        ("llama", "roundpipe", "cpu:2"),
        ("gemma3_text", "1f1b", "cpu:2"),  # sliding windows, softcapping
        ("gemma2", "roundpipe", "cpu:1"),  # eager attention: additive float masks
        ("qwen3_moe", "gpipe", "cpu:2"),  # the router loss counts tokens by the mask
    ],
)
def test_trimmed_microbatches_train_exactly_like_plain_pytorch(family, policy, devices):
    model = make_model(family)
    batch = _ragged_right()
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(
        model, batch, STEPS, devices=devices, num_microbatches=3, policy=policy, partition=None
    )
    assert_same_run(got, want)


# ----------------------------------------------------------------- the slow fault kind
def _slow_run(policy: str = "1f1b", order: str = "strict", factor: float = 3.0):
    """One step of a tiny Llama on cpu:2 with cpu:1 slowed ``factor`` times: (fault, its compute
    spans on cpu:1, the loss)."""
    batch = make_batch(batch=4, padding="right")
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, policy=policy, partition=None, order=order
    )
    with roundpipe.wrap(make_model("llama"), config) as pipe:
        fault = faults.Fault("compute", kind="slow", device="cpu:1", factor=factor)
        with faults.injected(fault):
            out = pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
        spans = [s for s in pipe.last_timeline().spans if s.lane == "compute" and s.device == 1]
    return fault, spans, out.loss


def test_a_slow_device_sleeps_after_every_closure_of_its_compute_stream():
    fault, spans, _ = _slow_run(factor=3.0)
    assert spans and fault.fired == len(spans)  # every labelled closure of cpu:1, none of cpu:0
    assert fault.slept_s == pytest.approx(2.0 * fault.measured_s)  # factor - 1 times what each took
    # The sleep is inside the closure's span: what the timeline shows is the slowed device.
    assert sum(s.end - s.start for s in spans) >= fault.slept_s + fault.measured_s


def test_a_slow_fault_changes_no_number():
    _, _, slowed = _slow_run(factor=2.0)
    batch = make_batch(batch=4, padding="right")
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, policy="1f1b", partition=None)
    with roundpipe.wrap(make_model("llama"), config) as pipe:
        plain = pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        ).loss
    assert slowed == plain


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(where="forward", kind="slow"), "where='compute'"),
        (dict(where="compute", kind="error"), "kind 'slow'"),
        (dict(where="compute", kind="slow", factor=0.5), "finite number >= 1"),
        (dict(where="compute", kind="slow", factor=float("inf")), "finite number >= 1"),
        (dict(where="compute", kind="slow", step=2), "by device only"),
    ],
)
def test_a_malformed_slow_fault_says_what_to_change(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        faults.Fault(**kwargs)


def test_a_slow_fault_comes_from_the_environment_too(monkeypatch):
    monkeypatch.setenv(faults.ENV, '[{"where": "compute", "kind": "slow", "device": "cpu:1", "factor": 2}]')
    try:
        (fault,) = faults.from_environment()
        assert (fault.kind, fault.device, fault.factor) == ("slow", "cpu:1", 2)
    finally:
        faults._PLAN = None  # from_environment enables it for the process


# ----------------------------------------------------------------- strict against ready order
@pytest.mark.parametrize(
    ("policy", "devices", "microbatches"),
    [
        ("gpipe", "cpu:2", 4),
        ("1f1b", "cpu:2", 4),
        ("interleaved", "cpu:2", 4),
        ("chimera", "cpu:2", 4),
        ("hanayo", "cpu:2", 4),
        ("roundpipe", "cpu:2", 4),
    ],
)
def test_ready_order_trains_exactly_like_strict_order(policy, devices, microbatches):
    model = make_model("qwen3", num_layers=2)
    batch = _ragged_right(batch=8, lengths=(12, 3, 7, 12, 5, 9, 4, 11))
    config = dict(devices=devices, num_microbatches=microbatches, policy=policy, partition=None)
    strict = pipeline_train(model, batch, 2, order="strict", **config)
    # cpu:1 slowed so that ready order has something to reorder
    with faults.injected(faults.Fault("compute", kind="slow", device="cpu:1", factor=1.5)):
        ready = pipeline_train(model, batch, 2, order="ready", **config)
    assert_same_run(ready, strict)


# ----------------------------------------------------------------- the simulator's options
def _sim(policy: str, **options):
    table = build_table(policy, *([default_partition(policy, 4, {}, 8)] * 2), 4, 8)
    return simulate(
        table, uniform_workload(8), load_hardware("4xrtx4090"), without_costs(SimOptions(**options))
    )


def test_jitter_is_the_same_for_a_seed_and_another_for_another_seed():
    a, b = _sim("1f1b", jitter=0.3, jitter_seed=7), _sim("1f1b", jitter=0.3, jitter_seed=7)
    assert a.iteration_s == b.iteration_s and a.compute_busy_s == b.compute_busy_s
    assert _sim("1f1b", jitter=0.3, jitter_seed=8).compute_busy_s != a.compute_busy_s
    assert _sim("1f1b", jitter=0.0, jitter_seed=7) == _sim("1f1b")  # off: no draw, the plain step


def test_a_slow_device_makes_the_simulated_step_longer_by_its_own_work():
    plain, slow = _sim("gpipe"), _sim("gpipe", slowdown=(1.0, 2.0))
    assert slow.compute_busy_s[1] == pytest.approx(2 * plain.compute_busy_s[1])
    assert slow.compute_busy_s[0] == plain.compute_busy_s[0]
    assert slow.iteration_s > plain.iteration_s


def test_ready_order_in_the_simulator():
    # Round-robin already deals in readiness order: nothing moves, the same step.
    strict, ready = (
        _sim("roundpipe", slowdown=(1.0, 2.0)),
        _sim("roundpipe", slowdown=(1.0, 2.0), order="ready"),
    )
    assert ready.reordered == 0 and ready.iteration_s == strict.iteration_s
    # GPipe behind a slow device: the devices after it run backwards as their gradients arrive.
    strict, ready = _sim("gpipe", slowdown=(1.0, 2.0)), _sim("gpipe", slowdown=(1.0, 2.0), order="ready")
    assert strict.iteration_s == 114.0 and ready.iteration_s == 102.0 and ready.reordered > 0
    # The same work, every gradient sent down and every layer stepped, whatever the order.
    for policy in ("1f1b", "interleaved", "chimera", "hanayo", "zb"):
        s, r = _sim(policy, jitter=0.3, order="strict"), _sim(policy, jitter=0.3, order="ready")
        assert sum(r.compute_busy_s) == pytest.approx(sum(s.compute_busy_s))
        assert (r.d2h_bytes, r.h2d_bytes) == (s.d2h_bytes, s.h2d_bytes)


def test_ready_order_with_real_costs_and_async_steps_runs_to_the_end():
    s = Scenario("qwen3-1.7b", "8xrtx4090", "1f1b", seq_len=2048, global_batch=16, microbatches=8,
                 optimizer="async", num_devices=4)  # fmt: skip
    strict = run_scenario(s, SimOptions(optimizer="async", jitter=0.2))
    ready = run_scenario(s, SimOptions(optimizer="async", jitter=0.2, order="ready"))
    assert ready.reordered > 0 and ready.optimizer_busy_s == pytest.approx(strict.optimizer_busy_s)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(order="fifo"), "'strict' or 'ready'"),
        (dict(jitter=-0.1), "finite number >= 0"),
        (dict(jitter=float("nan")), "finite number >= 0"),
        (dict(slowdown=(1.0, 0.0)), "finite numbers > 0"),
        (dict(slowdown=2.0), "one compute-time factor per device"),
    ],
)
def test_bad_simulator_options_say_what_to_change(options, match):
    with pytest.raises(ConfigError, match=match):
        SimOptions(**options)


def test_a_slowdown_for_more_devices_than_the_table_has_is_refused():
    with pytest.raises(ConfigError, match="at most one factor per device"):
        _sim("1f1b", slowdown=(1.0,) * 5)
