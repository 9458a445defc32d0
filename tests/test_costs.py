"""The kernel-level cost model against measured layers, and ``roundpipe costs`` (issue 11, item 5).

The oracle is the RoundPipe paper's per-layer times on an RTX 4090 (``presets/measured_layers.json``,
a copy of the public figures): every one of them is predicted within 15% through the function the
command prints. The rest pins the mechanisms the fit relies on (small GEMMs are less efficient,
MoE layers cost more per FLOP, sliding windows shorten attention), the gpt-oss-20b preset and the
command's output and errors. Pure Python: nothing here needs torch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache

import pytest

from roundpipe.cli import main
from roundpipe.errors import ConfigError
from roundpipe.partition.cost import layer_time, layer_times, model_costs, model_totals
from roundpipe.partition.kernels import gemm, gemm_efficiency, kernel_seconds, keys_per_query, rates
from roundpipe.partition.layer_rows import QUANTITIES, calibration, layer_rows, totals
from roundpipe.partition.shape import model_shape
from roundpipe.presets import known_models, load_hardware, load_measured_layers, load_model_config

MEASURED = load_measured_layers()
CASES = [(model, q) for model in MEASURED["models"] for q in QUANTITIES]


@cache
def _predicted() -> dict[tuple[str, str], object]:
    return {(r.model, r.quantity): r for r in calibration()}


def test_the_measured_copy_says_where_and_how_it_was_measured():
    assert "2604.27085" in MEASURED["_source"] and "allow_fp16_accumulation" in MEASURED["_source"]
    assert MEASURED["setting"] == {
        "hardware": "rtx4090",
        "seq_len": 2048,
        "microbatch_size": 4,
        "dtype": "fp16",
        "fp16_accumulation": True,
    }
    assert len(CASES) == 20 and set(MEASURED["models"]) <= set(known_models())


@pytest.mark.parametrize(("model", "quantity"), CASES, ids=[f"{m}-{q}" for m, q in CASES])
def test_every_measured_layer_time_is_predicted_within_15_percent(model, quantity):
    row = _predicted()[(model, quantity)]
    assert row.measured_s == MEASURED["models"][model][quantity] / 1e3
    assert abs(row.error) <= 0.15, (
        f"{model} {quantity}: predicted {row.predicted_s * 1e3:.2f} ms, measured {row.measured_s * 1e3:.2f} ms"
    )


def test_the_calibration_is_what_the_command_prints(capsys):
    main(["costs", "--calibration", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 20 and out["max_abs_error"] <= 0.15
    first = out["rows"][0]
    row = _predicted()[(first["model"], first["quantity"])]
    assert first["predicted_s"] == pytest.approx(row.predicted_s) and first["error"] == pytest.approx(
        row.error
    )
    main(["costs", "--calibration"])
    table = capsys.readouterr().out
    assert "gpt-oss-20b" in table and "largest error" in table


# ---------------------------------------------------------------------------------------------
# Mechanisms


def test_a_smaller_gemm_is_less_efficient_and_large_ones_reach_the_plateau():
    r = rates(load_hardware("rtx4090"), "fp16", fp16_accumulate=True)
    expert = gemm("expert", 512, 1536, 4096, 2)  # one Qwen3-235B-A22B expert's share of 8192 tokens
    projection = gemm("q_proj", 8192, 8192, 4096, 2)
    assert gemm_efficiency(expert.flops, r) < gemm_efficiency(projection.flops, r) < r.gemm_efficiency
    assert gemm_efficiency(projection.flops, r) > 0.99 * r.gemm_efficiency
    per_flop = [kernel_seconds(k, r) / k.flops for k in (expert, projection)]
    assert per_flop[0] > 1.05 * per_flop[1]
    skinny = gemm("lora_A", 512, 32, 4096, 2)  # rank 32: bound by reading its input, not by FLOPs
    assert kernel_seconds(skinny, r) == pytest.approx(skinny.bytes / r.memory_bw)


def test_moe_layers_cost_more_per_active_flop_than_dense_ones():
    hw = load_hardware("rtx4090")
    kw = dict(seq_len=2048, micro_batch_size=4, dtype="fp16", fp16_accumulation=True)
    dense = model_costs(load_model_config("qwen3-32b"), **kw)[1]
    for name in ("qwen3-235b-a22b", "gpt-oss-20b"):
        moe = model_costs(load_model_config(name), **kw)[1]
        for phase, flops in (("forward", "fwd_flops"), ("backward", "bwd_flops")):
            moe_rate = getattr(moe, flops) / layer_time(moe, hw, phase=phase)
            dense_rate = getattr(dense, flops) / layer_time(dense, hw, phase=phase)
            assert moe_rate < 0.7 * dense_rate, (name, phase)


def test_sliding_window_layers_attend_to_at_most_the_window():
    assert keys_per_query(2048, None) == keys_per_query(2048, 4096) == 2049 / 2
    assert keys_per_query(2048, 128) == pytest.approx((128 * 129 / 2 + (2048 - 128) * 128) / 2048)
    costs = model_costs(load_model_config("gpt-oss-20b"), 2048, 4)
    sliding, full = costs[1], costs[2]  # layers.0 slides, layers.1 attends to everything
    attn = {c.name: next(k for k in c.fwd_kernels if k.kind == "attention").flops for c in (sliding, full)}
    assert attn["layers.0"] < 0.15 * attn["layers.1"]
    assert sliding.fwd_flops < full.fwd_flops


def test_other_gpus_keep_the_fitted_curve_against_their_own_peaks():
    cfg = load_model_config("llama3.1-8b")
    block = model_costs(cfg, 4096, 1)[1]
    ada, hopper = load_hardware("rtx4090"), load_hardware("h100-sxm")
    assert layer_time(block, hopper) < 0.5 * layer_time(block, ada)
    r_ada, r_hopper = rates(ada, "bf16"), rates(hopper, "bf16")
    assert r_hopper.gemm_ramp_s == r_ada.gemm_ramp_s  # the same fill-and-drain time ...
    assert r_hopper.gemm_half_flops / r_ada.gemm_half_flops == pytest.approx(989.5 / 165.2)  # ... at its peak


def test_an_efficiency_override_sets_the_gemm_plateau():
    costs = model_costs(load_model_config("qwen3-0.6b"), 1024)
    hw = load_hardware("rtx4090")
    slow, _ = layer_times(costs, hw, efficiency=0.4)
    fast, _ = layer_times(costs, hw, efficiency=0.8)
    assert all(s >= f for s, f in zip(slow, fast)) and slow[-1] > 1.5 * fast[-1]
    with pytest.raises(ConfigError, match="efficiency"):
        layer_times(costs, hw, efficiency=1.5)


# ---------------------------------------------------------------------------------------------
# gpt-oss-20b


def test_the_gpt_oss_preset_loads_with_its_architecture():
    cfg = load_model_config("openai/gpt-oss-20b")
    assert cfg["_source"] and cfg == load_model_config("gpt-oss-20b")
    shape = model_shape(cfg)
    assert (shape.num_experts, shape.experts_per_tok, shape.moe_intermediate) == (32, 4, 2880)
    assert shape.fused_experts and shape.expert_bias and shape.router_bias and shape.attention_sinks
    assert shape.moe_layers == frozenset(range(24)) and shape.sliding_window == 128
    assert shape.sliding_layers == frozenset(range(0, 24, 2))
    assert (shape.q_dim, shape.kv_dim, shape.vocab, shape.tied) == (4096, 512, 201088, False)


def test_the_gpt_oss_preset_costs_its_published_parameter_counts():
    cfg = load_model_config("gpt-oss-20b")
    costs = model_costs(cfg, 2048, 4, dtype="fp16")
    assert model_totals(costs)["params"] == pytest.approx(cfg["_card_params"]["total"], rel=0.02)
    h, v = 2880, 201088
    attention = h * 4096 + 4096 + 2 * (h * 512 + 512) + 4096 * h + h
    experts = 32 * (h * 5760 + 5760 + 2880 * h + h)
    block = costs[1]
    assert block.params == attention + h * 32 + 32 + experts + 2 * h + 64  # router, norms, sinks
    active = 24 * (attention + h * 32 + 4 * (h * 5760 + 2880 * h)) + v * h  # blocks + untied head
    assert active == pytest.approx(cfg["_card_params"]["active"], rel=0.03)
    assert costs[-1].params == v * h + h and costs[-1].tied_params == 0
    fwd = [layer_time(c, load_hardware("rtx4090"), fp16_accumulate=True) for c in costs]
    assert all(t > 0 for t in fwd)


def test_fused_expert_gradients_cost_the_full_tensor_per_expert_under_full_fine_tuning():
    cfg = load_model_config("gpt-oss-20b")
    full = model_costs(cfg, 2048, 4, dtype="fp16")[1]
    lora = model_costs(cfg, 2048, 4, dtype="fp16", lora_rank=16)[1]
    names = {k.name for k in full.bwd_kernels}
    assert "fused expert grad (full size)" in names
    assert "fused expert grad (full size)" not in {k.name for k in lora.bwd_kernels}
    grad = next(k for k in full.bwd_kernels if k.name == "fused expert grad (full size)")
    assert grad.total_bytes == pytest.approx(32 * 2 * (32 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880)))


# ---------------------------------------------------------------------------------------------
# The command


def test_costs_prints_every_layer_by_its_runtime_name_with_times_and_bytes(capsys):
    args = ["costs", "--model", "qwen3-0.6b", "--seq-len", "512", "--microbatch-size", "2"]
    main([*args, "--head-shards", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in out["layers"]]
    assert names == ["embed", *(f"layers.{i}" for i in range(28)), "head.0", "head.1"]
    for key in (
        "model",
        "hardware",
        "seq_len",
        "microbatch_size",
        "tokens",
        "dtype",
        "lora_rank",
        "head_shards",
    ):
        assert key in out
    assert out["tokens"] == 1024
    fields = {"forward_s", "backward_s", "fwd_flops", "bwd_flops", "param_bytes", "act_in_bytes",
              "saved_bytes", "transient_bytes", "kind"}  # fmt: skip
    assert all(fields <= set(r) for r in out["layers"])
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in out["layers"])
    rows = layer_rows("qwen3-0.6b", seq_len=512, microbatch_size=2, head_shards=2)
    assert out["totals"] == pytest.approx(totals(rows))
    assert out["totals"]["forward_s"] == pytest.approx(sum(r["forward_s"] for r in out["layers"]))
    main(args)
    table = capsys.readouterr().out
    assert "layers.27" in table and "head" in table and "total" in table


def test_lora_leaves_the_frozen_embedding_without_a_backward():
    rows = layer_rows("qwen3-0.6b", seq_len=512, lora_rank=8)
    assert rows[0].name == "embed" and rows[0].backward_s == 0.0
    full = layer_rows("qwen3-0.6b", seq_len=512)
    assert rows[1].backward_s < full[1].backward_s  # no base-weight gradients


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt2", "--seq-len", "512"], "known models: .*gpt-oss-20b"),
        (["--model", "qwen3-0.6b", "--seq-len", "512", "--hardware", "rtx5090"], "known GPUs"),
        (["--model", "qwen3-0.6b", "--seq-len", "512", "--fp16-accumulation"], "needs dtype fp16"),
        (
            ["--model", "qwen3-0.6b", "--seq-len", "512", "--head-shards", "999999"],
            "head_shards must be in 1..",
        ),
        (["--model", "qwen3-0.6b", "--seq-len", "0"], "--seq-len: expected a positive integer"),
        (
            ["--model", "qwen3-0.6b", "--seq-len", "64", "--lora-rank", "-1"],
            "--lora-rank: expected a positive",
        ),
        (["--model", "qwen3-0.6b", "--seq-len", "64", "--label-fraction", "2"], "label fraction"),
        (["--model", "qwen3-0.6b"], "give --model M and --seq-len S"),
    ],
)
def test_bad_settings_exit_2_and_say_what_to_change(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["costs", *args])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_layer_rows_refuse_a_head_shard_count_that_is_not_a_positive_int():
    with pytest.raises(ConfigError, match="--head-shards"):
        layer_rows("qwen3-0.6b", seq_len=64, head_shards=0)


def test_the_cost_model_and_the_command_never_import_torch():
    code = (
        "import sys; import roundpipe.commands.costs, roundpipe.partition.kernels, roundpipe.partition.shape; "
        "from roundpipe.partition.layer_rows import calibration; calibration(); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_moe_config_without_an_expert_width_is_a_config_error():
    """An MoE config with neither ``moe_intermediate_size`` nor ``intermediate_size`` names the key
    (it was a TypeError from ``int(None)`` deep in the cost model)."""
    config = dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        model_costs(config, 16)


def test_an_mlp_in_token_chunks_saves_no_intermediate_and_pays_one_more_forward(capsys):
    """``--mlp-chunk-tokens`` (``RunConfig.mlp_chunk_tokens``): a block saves no MLP intermediate, its
    transient is one chunk's (plus the MLP input's gradient), and its backward runs the MLP's
    forward once more; the embedding and the head are not touched."""
    args = ["costs", "--model", "qwen3-32b", "--seq-len", "16384", "--json"]
    main(args)
    whole = json.loads(capsys.readouterr().out)
    main([*args, "--mlp-chunk-tokens", "4096"])
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["mlp_chunk_tokens"] == 4096 and whole["mlp_chunk_tokens"] is None
    shape = model_shape(load_model_config("qwen3-32b"))
    for a, b in zip(whole["layers"], chunked["layers"]):
        if a["kind"] != "block":
            assert a == b
            continue
        assert a["saved_bytes"] - b["saved_bytes"] == 16384 * 2 * 4 * shape.dense_width
        assert b["transient_bytes"] < a["transient_bytes"]
        assert b["backward_s"] > a["backward_s"] and b["forward_s"] == a["forward_s"]
        assert b["bwd_flops"] - a["bwd_flops"] == pytest.approx(16384 * 6 * shape.hidden * shape.dense_width)
