"""Numerical faults: a NaN or Inf in a layer's output, the loss or a weight gradient is found before
the optimizer applies it. ``nan_policy="stop"`` raises ``NonFiniteError`` naming the step, layer,
microbatch and device where it first appeared, with the last completed step intact;
``nan_policy="skip"`` drops the step's update and counts it; fp16 runs skip and lower the loss
scale. The check itself changes nothing: a finite run is bit for bit the run without it."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from support.reference import pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError, NonFiniteError
from roundpipe.testing import faults
from roundpipe.testing.faults import Fault

torch.set_num_threads(1)

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

CONFIG = dict(devices="cpu:2", num_microbatches=4, partition=None)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", num_layers=3)


@pytest.fixture(scope="module")
def batch():
    return make_batch(batch=4)


def _pipe(model, policy="1f1b", **config):
    pipe = roundpipe.wrap(copy.deepcopy(model), roundpipe.RunConfig(**{**CONFIG, "policy": policy, **config}))
    pipe.configure_optimizer(lr=1e-2)
    return pipe


def _fb(pipe, batch):
    return pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
    )


def _masters(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict()["masters"].items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unknown_nan_policy_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="skip, stop"):
        roundpipe.RunConfig(nan_policy="ignore")


@pytest.mark.parametrize("policy", ["1f1b", "roundpipe"])
@pytest.mark.parametrize("nan_policy", ["stop", "skip"])
def test_a_finite_run_equals_plain_pytorch_under_either_policy(model, batch, policy, nan_policy):
    plain = reference_train(model, batch, 3)
    got = pipeline_train(model, batch, 3, policy=policy, nan_policy=nan_policy, **CONFIG)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    for name, want in plain.weights.items():
        torch.testing.assert_close(got.weights[name], want, rtol=1e-4, atol=1e-6)


def test_skip_defers_updates_and_a_finite_run_is_bit_for_bit_the_eager_one(model, batch):
    runs = {}
    for nan_policy in ("stop", "skip"):
        with _pipe(model, nan_policy=nan_policy) as pipe:
            for _ in range(2):
                _fb(pipe, batch)
                pipe.step()
            runs[nan_policy] = _masters(pipe)
            assert pipe.skipped_steps == 0
    assert _equal(runs["stop"], runs["skip"])


# (fault, what the error must name): where the first non-finite value appears
STOP_CASES = {
    "forward output": (Fault("forward", kind="nan", layer="layers.1", microbatch=2, step=1),
                       {"layer": "layers.1", "microbatch": 2, "what": "output"}),
    "gradient": (Fault("backward", kind="nan", microbatch=1, step=1),
                 {"microbatch": 1, "what": "gradient"}),
}  # fmt: skip


@pytest.mark.parametrize("policy", ["1f1b", "roundpipe"])
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stop_names_where_the_first_non_finite_value_appeared_before_any_update(model, batch, policy, case):
    fault, where = STOP_CASES[case]
    fault = dataclasses.replace(fault, fired=0)  # the case's Fault is shared by the parametrizations
    # A forward NaN is found before any layer is final, so even eager updates never apply it; a
    # gradient NaN is found before its own layer's update (deferred here: nothing is applied).
    config = {"nan_policy": "stop"}
    with _pipe(model, policy=policy, **config) as pipe:
        if case == "gradient":
            pipe.configure_optimizer(lr=1e-2, max_grad_norm=1e9)
        _fb(pipe, batch)
        pipe.step()
        before = _masters(pipe)
        with faults.injected(fault), pytest.raises(NonFiniteError) as info:
            _fb(pipe, batch)
        err = info.value
        assert fault.fired == 1
        assert err.step == 1
        assert err.microbatch == where["microbatch"]
        assert err.what == where["what"]
        if "layer" in where:
            assert err.layer == where["layer"]
        else:
            assert err.layer is not None
        assert err.device in ("cpu:0", "cpu:1")
        assert f"microbatch {err.microbatch}" in str(err) and err.layer in str(err)
        assert pipe.abandon_step()  # nothing of the step was applied: the last completed one is intact
        assert _equal(_masters(pipe), before)
        _fb(pipe, batch)  # and the pipeline trains on
        pipe.step()
        assert all(torch.isfinite(v).all() for v in _masters(pipe).values())


def test_a_gradient_nan_found_under_eager_updates_stops_before_its_own_layer_is_updated(model, batch):
    # Eager updates step each layer as soon as its gradient is final: layers above the one whose
    # gradient is non-finite may already hold the new weights; the poisoned ones never do.
    with _pipe(model, nan_policy="stop") as pipe:
        with faults.injected(Fault("backward", kind="nan", device="cpu:0")), pytest.raises(NonFiniteError):
            _fb(pipe, batch)
        assert all(torch.isfinite(v).all() for v in _masters(pipe).values())


@pytest.mark.parametrize("policy", ["1f1b", "roundpipe"])
def test_skip_drops_the_update_counts_it_and_the_run_goes_on(model, batch, policy):
    with _pipe(model, policy=policy) as clean:
        _fb(clean, batch)
        clean.step()
        _fb(clean, batch)
        clean.step()
        want = _masters(clean)
    with _pipe(model, policy=policy, nan_policy="skip") as pipe:
        _fb(pipe, batch)
        pipe.step()
        with faults.injected(Fault("forward", kind="nan", layer="layers.0", step=1)):
            out = _fb(pipe, batch)
        assert not math.isfinite(out.loss)
        pipe.step()
        assert pipe.last_step_skipped and pipe.skipped_steps == 1
        assert pipe.last_nonfinite is not None and pipe.last_nonfinite.layer == "layers.0"
        _fb(pipe, batch)  # the skipped step changed nothing: this one is the clean run's second
        pipe.step()
        assert not pipe.last_step_skipped and pipe.skipped_steps == 1
        assert _equal(_masters(pipe), want)
        assert pipe.state_dict()["skipped_steps"] == 1


def test_fp16_skips_a_non_finite_gradient_and_lowers_the_loss_scale(model, batch):
    with _pipe(model, dtype="fp16", nan_policy="stop") as pipe:
        scale = pipe._updates.loss_scale()
        with faults.injected(Fault("backward", kind="nan", microbatch=0)):
            _fb(pipe, batch)  # no NonFiniteError: an overflow is what loss scaling expects
        pipe.step()
        assert pipe.last_step_skipped and pipe.skipped_steps == 1
        assert pipe._updates.loss_scale() == scale / 2


def test_an_evaluation_with_a_nan_loss_leaves_training_alone(model, batch):
    with _pipe(model, nan_policy="stop") as pipe:
        with faults.injected(Fault("forward", kind="nan", layer="layers.1")):
            out = pipe.evaluate(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
        assert not math.isfinite(out.loss)
        _fb(pipe, batch)
        pipe.step()
        assert pipe.skipped_steps == 0


def test_a_nan_fault_needs_a_tensor_point():
    with pytest.raises(ConfigError, match="forward or backward"):
        Fault("upload", kind="nan")


# ----------------------------------------------------------------- roundpipe train
def _trainer_run(tmp_path, nan_policy: str, fault: Fault):
    from test_train import _quiet, _recipe

    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    recipe = _recipe(tmp_path, run={"grad_accum": 1, "nan_policy": nan_policy}, eval={"every": None})
    lines: list[str] = []
    trainer = Trainer(config_from_dict(recipe), log=lambda line: (lines.append(line), _quiet(line)))
    with faults.injected(fault):
        try:
            return trainer.fit(), lines
        except NonFiniteError as err:
            return err, lines


def test_a_training_run_skips_and_counts_a_non_finite_step(tmp_path):
    # The third step's forward (pipeline call 2) turns NaN in layers.0: that update is dropped.
    result, lines = _trainer_run(tmp_path, "skip", Fault("forward", kind="nan", layer="layers.0", step=2))
    assert not isinstance(result, Exception)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[2].get("skipped") and not math.isfinite(rows[2]["loss"])
    assert any(
        "step 3: update skipped" in line and "layers.0" in line and "1 skipped so far" in line
        for line in lines
    )


def test_a_training_run_stops_on_a_nan_naming_where_and_keeps_the_last_completed_step(tmp_path):
    err, lines = _trainer_run(
        tmp_path, "stop", Fault("forward", kind="nan", layer="layers.1", microbatch=1, step=4)
    )
    assert isinstance(err, NonFiniteError)
    assert (err.step, err.layer, err.microbatch, err.what) == (4, "layers.1", 1, "output")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "NonFiniteError" in log and "Traceback" in log
    assert any("wrote a checkpoint of step 4, the last completed one" in line for line in lines)
    assert sorted(p.name for p in (tmp_path / "run").rglob("step-*")) == ["step-00000003", "step-00000004"]
