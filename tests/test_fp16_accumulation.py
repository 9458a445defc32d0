"""fp16 accumulation (issue 11, item 4): ``RunConfig(fp16_accumulation=True)`` sets the CUDA flag
for the pipeline's lifetime; the cost model, ``simulate`` and ``plan`` time fp16 GEMMs at the
preset's fp16-accumulate rate when asked; every other dtype refuses the option."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.cli import main
from roundpipe.partition.cost import layer_time, model_costs
from roundpipe.presets import load_hardware, load_model_config
from roundpipe.sim.scenario import Scenario, run_scenario

torch.set_num_threads(1)


def test_fp16_accumulation_runs_fp16_gemms_at_the_fp16_accumulate_rate():
    hw = load_hardware("rtx4090")  # 165.2 TFLOP/s accumulating in fp32, 330.3 in fp16
    config = load_model_config("llama3.1-8b")
    plain = model_costs(config, 2048, 4, dtype="fp16")
    fast = model_costs(config, 2048, 4, dtype="fp16", fp16_accumulation=True)
    for a, b in zip(plain, fast):
        for phase in ("forward", "backward_stage"):
            ratio = layer_time(a, hw, phase=phase) / layer_time(b, hw, phase=phase)
            # Only the GEMMs speed up: elementwise traffic and FlashAttention (fp32 accumulation) do not.
            assert 1.0 <= ratio <= 330.3 / 165.2 + 1e-9, (a.name, phase)
            if a.kind == "embed":
                assert ratio == 1.0  # a gather, no GEMM
            elif a.kind == "head":
                assert ratio > 1.8, phase  # a vocabulary-sized GEMM is nearly all of it
            else:
                assert ratio > 1.5, phase


def test_a_scenario_with_fp16_accumulation_is_faster_and_other_dtypes_refuse_it():
    base = Scenario("llama3.1-8b", "8xrtx4090", seq_len=2048, global_batch=16, microbatches=8, dtype="fp16")
    fast = run_scenario(Scenario(**{**base.__dict__, "fp16_accumulation": True}))
    slow = run_scenario(base)
    assert fast.tokens_per_s > 1.2 * slow.tokens_per_s
    with pytest.raises(roundpipe.ConfigError, match="needs dtype fp16"):
        run_scenario(Scenario(**{**base.__dict__, "dtype": "bf16", "fp16_accumulation": True}))


def test_simulate_and_plan_take_the_flag(capsys):
    args = ["--model", "llama3.1-8b", "--seq-len", "2048", "--global-batch", "16", "--microbatches", "8"]
    main(["simulate", *args, "--dtype", "fp16", "--json"])
    slow = json.loads(capsys.readouterr().out)["tokens_per_s"]
    main(["simulate", *args, "--dtype", "fp16", "--fp16-accumulation", "--json"])
    fast = json.loads(capsys.readouterr().out)["tokens_per_s"]
    assert fast > 1.2 * slow
    with pytest.raises(SystemExit) as info:
        main(
            ["plan", "--model", "llama3.1-8b", "--seq-len", "2048", "--dtype", "bf16", "--fp16-accumulation"]
        )
    assert info.value.code == 2
    assert "needs dtype fp16" in capsys.readouterr().err


def test_run_config_refuses_it_without_fp16():
    with pytest.raises(roundpipe.ConfigError, match="fp16_accumulation needs dtype='fp16'"):
        roundpipe.RunConfig(dtype="bf16", fp16_accumulation=True)


def test_the_cpu_backend_says_it_has_no_fp16_accumulation_and_trains_as_usual():
    batch = make_batch(batch=4)
    losses = {}
    for flag in (False, True):
        # One named plan for both runs, compared bit for bit.
        config = roundpipe.RunConfig(
            devices="cpu:1", dtype="fp16", fp16_accumulation=flag, policy="roundpipe", partition=None,
            num_microbatches=1,
        )  # fmt: skip
        with pytest.warns(RuntimeWarning, match="no effect") if flag else contextlib.nullcontext():
            pipe = roundpipe.wrap(make_model("llama"), config)
        with pipe:
            losses[flag] = pipe.forward_backward(**batch).loss
    assert losses[True] == losses[False]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sets_the_flag_while_the_pipeline_is_open_and_restores_it():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "allow_fp16_accumulation"):
        pytest.skip("this torch has no allow_fp16_accumulation")
    before = matmul.allow_fp16_accumulation
    config = roundpipe.RunConfig(devices="cuda:0", dtype="fp16", fp16_accumulation=True)
    with roundpipe.wrap(make_model("llama"), config):
        assert matmul.allow_fp16_accumulation
    assert matmul.allow_fp16_accumulation == before
