"""The longest sequence a server trains a model at (``roundpipe plan --max-seq-len``): searched over
the plans a policy has, not one default plan; host RAM a hard limit; the binding limit named with
its figures; lengths beyond the model's positions refused unless rope scaling reaches them."""

from __future__ import annotations

import json

import pytest

from roundpipe.errors import ConfigError
from roundpipe.partition.positions import check_positions, position_limit, with_rope_scaling
from roundpipe.presets import GIB, load_hardware, load_model_config
from roundpipe.sim.seq_limit import GPU, HOST, POSITIONS, max_seq_len
from roundpipe.sim.tune import tune

PAPER_HOST_GIB = 800e9 / GIB  # the paper's server: 800 GB of host RAM


def _plan(capsys, *args: str) -> dict:
    from roundpipe.commands.plan import main

    main(["--dtype", "fp16", "--max-seq-len", "--json", *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_qwen3_32b_reaches_the_papers_length_within_800_gb_of_host_ram(capsys):
    """The paper trains Qwen3-32B in full at 28,672 tokens on 8x RTX 4090 with 800 GB of RAM. One
    default plan (64 microbatches, the objective's grain, the whole step as one round) stopped at
    14,976 tokens; a layer per backward stage and rounds of microbatches reach further."""
    out = _plan(capsys, "--model", "qwen3-32b", "--host-ram", str(PAPER_HOST_GIB))
    assert out["max_seq_len"] >= 28_672, out["binding_detail"]
    assert out["fits"] and out["peak_host_bytes"] <= 800e9
    assert max(out["peak_gpu_bytes_per_device"]) <= 24 * GIB
    assert (
        out["binding_limit"] in (GPU, HOST)
        and f"{out['max_seq_len'] + 128:,} tokens" in out["binding_detail"]
    )


@pytest.mark.slow
def test_qwen3_235b_lora_reaches_the_papers_length_with_its_moe_in_chunks(capsys):
    """The paper trains Qwen3-235B-A22B with LoRA r=32 at 31,744 tokens on 8x RTX 4090 with 800 GB
    of RAM. With the MoE block in one piece the GPUs bound it at 21,760 (its dispatched copies and
    experts' intermediates); in chunks of 4,096 tokens the host's RAM binds, past the paper."""
    out = _plan(
        capsys, "--model", "qwen3-235b-a22b", "--lora-rank", "32", "--mlp-chunk-tokens", "4096",
        "--host-ram", str(PAPER_HOST_GIB),
    )  # fmt: skip
    assert out["max_seq_len"] >= 31_744, out["binding_detail"]
    assert out["fits"] and out["peak_host_bytes"] <= 800e9
    assert max(out["peak_gpu_bytes_per_device"]) <= 24 * GIB
    assert out["binding_limit"] == HOST and f"{out['max_seq_len'] + 128:,} tokens" in out["binding_detail"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, args, paper",
    [("qwen3-1.7b", ("--rope-scaling", "yarn:2"), 74_752), ("llama3.1-8b", (), 50_176)],
)
def test_the_smaller_models_reach_the_papers_lengths_within_800_gb(capsys, model, args, paper):
    """The paper's longest sequences for Qwen3-1.7B (past its 40,960 positions: with yarn scaling
    of factor 2) and Llama-3.1-8B, in full on 8x RTX 4090 with 800 GB of RAM, the MLP in chunks."""
    out = _plan(
        capsys, "--model", model, *args, "--mlp-chunk-tokens", "4096", "--host-ram", str(PAPER_HOST_GIB)
    )
    assert out["max_seq_len"] >= paper, out["binding_detail"]
    assert out["fits"] and out["peak_host_bytes"] <= 800e9
    assert max(out["peak_gpu_bytes_per_device"]) <= 24 * GIB
    assert out["binding_limit"] == POSITIONS and out["memory_max_seq_len"] > out["max_seq_len"]


def test_every_plan_is_searched_not_one_default_plan(capsys):
    """One default plan stopped Qwen3-8B on two RTX 4090s at 40,064 tokens; other plans reach the
    model's 40,960 positions."""
    out = _plan(capsys, "--model", "qwen3-8b", "--hardware", "2xrtx4090", "--global-batch", "8")
    assert out["max_seq_len"] == 40_960
    assert out.get("binding_limit") == POSITIONS


@pytest.mark.slow
def test_host_ram_binds_when_the_host_is_small():
    server = load_hardware("1xrtx4090", host_memory_bytes=10 * GIB)
    limit = max_seq_len("qwen3-0.6b", server, global_batch=8, dtype="fp16", grain=1024)
    assert limit.binding == HOST and 0 < limit.tokens < 40_960, limit.detail
    assert limit.result is not None and limit.result.peak_host_bytes <= 10 * GIB
    assert "of host RAM of 10.00 GiB" in limit.detail


def test_gpu_memory_binds_with_ample_host_ram():
    limit = max_seq_len("llama3.1-8b", load_hardware("2xrtx4090"), global_batch=8, dtype="fp16", grain=1024)
    assert limit.binding == GPU and limit.tokens > 0 and limit.memory_tokens is None
    assert max(limit.result.peak_gpu_bytes) <= 24 * GIB


def test_positions_bind_and_the_answer_says_what_memory_would_allow():
    limit = max_seq_len("qwen3-1.7b", "8xrtx4090", global_batch=8, dtype="fp16")
    assert (limit.tokens, limit.binding) == (40_960, POSITIONS)
    assert limit.memory_tokens > 74_752  # the paper's length, with rope scaling
    assert "rope_scaling" in limit.detail and "yarn" in limit.detail


def test_rope_scaling_lifts_the_position_limit(capsys):
    out = _plan(capsys, "--model", "qwen3-1.7b", "--global-batch", "8", "--rope-scaling", "yarn:2")
    assert out["max_seq_len"] == 81_920 and out["binding_limit"] == POSITIONS


def test_a_length_beyond_the_positions_is_refused_before_the_search():
    with pytest.raises(ConfigError, match=r"40,960 positions.*rope_scaling"):
        tune("qwen3-1.7b", "8xrtx4090", seq_len=41_000, global_batch=8, time_budget_s=1)


def test_plan_refuses_a_bad_rope_scaling(capsys):
    from roundpipe.commands.plan import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen3-1.7b", "--seq-len", "4096", "--rope-scaling", "yarn"])
    assert exc.value.code == 2 and "TYPE:FACTOR" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, limit",
    [
        ({}, 40_960),
        ({"rope_scaling": {"rope_type": "default"}}, 40_960),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}}, 131_072),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 81_920),
        ({"max_position_embeddings": 131_072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
          "original_max_position_embeddings": 8192}}, 131_072),
    ],
    ids=["none", "default", "yarn", "rope_parameters", "llama3"],
)  # fmt: skip
def test_the_position_limit_follows_the_configs_rope_scaling(extra, limit):
    config = {**load_model_config("qwen3-1.7b"), **extra}
    assert position_limit(config) == limit
    check_positions(config, limit)
    with pytest.raises(ConfigError, match="configured for"):
        check_positions(config, limit + 1)


def test_with_rope_scaling_stretches_the_configs_own_positions():
    config = with_rope_scaling(load_model_config("qwen3-1.7b"), "yarn:2")
    assert position_limit(config) == 81_920
    with pytest.raises(ConfigError, match="FACTOR above 1"):
        with_rope_scaling(config, "yarn:0.5")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 4096])
def test_qwen3_32b_at_the_planned_longest_sequence_runs_on_the_virtual_server_within_24_gib(chunk):
    """The runtime keeps the plan's promise: Qwen3-32B's layers (two of them; every decoder layer is
    alike) at the longest sequence the planner finds for 800 GB of host RAM, one layer per stage, one
    sequence per microbatch, on a virtual 8x RTX 4090, its memory guard passed and every GPU's
    reserved peak within 24 GiB: 32,640 tokens with the MLP in one piece, the model's 40,960
    positions with it in chunks of 4,096 tokens."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import roundpipe

    server = load_hardware("8xrtx4090", host_memory_bytes=int(PAPER_HOST_GIB * GIB))
    tokens = max_seq_len("qwen3-32b", server, dtype="fp16", mlp_chunk_tokens=chunk).tokens
    assert tokens >= (28_672 if chunk is None else 40_960)
    config = {**load_model_config("qwen3-32b"), "num_hidden_layers": 2}
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    run = roundpipe.RunConfig(
        devices="virtual:8xrtx4090", dtype="fp16", fp16_accumulation=True, policy="roundpipe",
        num_microbatches=8, partition=None, sanitize=False, mlp_chunk_tokens=chunk,
    )  # fmt: skip
    with roundpipe.wrap(model, run) as pipe:
        pipe.configure_optimizer(lr=1e-5)
        ids = torch.randint(0, 1000, (8, tokens))
        pipe.forward_backward(ids, ids)
        pipe.step()
        peaks = [d.memory.reserved_peak for d in pipe.backend.devices]
        step_s = pipe.stats()["step_s"]
    print(
        f"{tokens:,} tokens, MLP chunk {chunk}: reserved peaks {[round(p / GIB, 2) for p in peaks]} GiB, {step_s:.1f} s"
    )
    assert max(peaks) <= 24 * GIB, [round(p / GIB, 2) for p in peaks]
