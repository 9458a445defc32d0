"""transformers' grouped experts (``grouped_mm``, its default for mixtures of experts) on CUDA's
clock. torch runs ``aten._grouped_mm`` without reading the group offsets only on its fast path,
bf16 on compute capability 9.x and 10.x; everywhere else (fp16, fp32, an RTX 4090 in any dtype) its
fallback copies the offsets to the host, a host sync in every expert projection of every MoE layer
pass. The cpu backend and the virtual server count that sync like any other, and the virtual
server runs the operation on shapes alone (its meta kernel takes bf16 only; run eagerly, it
computed on bytes that do not exist, two seconds a call at Qwen3-235B's size)."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import VirtualDataError
from roundpipe.presets import load_model_config

torch.set_num_threads(1)

GROUPED = "aten._grouped_mm.default"


def _meta_moe():
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(load_model_config("qwen3-235b-a22b"))
    config.update(
        num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1024,
    )  # fmt: skip
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def _second_step(pipe, ids) -> tuple[int, dict]:
    """Host syncs and eager operations of a second step (the first one plans; each
    ``forward_backward`` starts the count afresh)."""
    pipe.configure_optimizer(lr=1e-4)
    for _ in range(2):
        pipe.forward_backward(ids, ids)
        pipe.step()
    return pipe.backend.host_syncs.count, dict(pipe.backend.host_syncs.stalls)


@pytest.mark.parametrize(
    "hardware, dtype, syncs",
    [("2xrtx4090", "fp16", True), ("2xrtx4090", "bf16", True), ("2xh100-sxm", "bf16", False),
     ("2xh100-sxm", "fp16", True)],
)  # fmt: skip
def test_a_virtual_moe_counts_the_fallback_sync_and_runs_no_operation_eagerly(hardware, dtype, syncs):
    pipe = roundpipe.wrap(
        _meta_moe(),
        roundpipe.RunConfig(
            devices=f"virtual:{hardware}", dtype=dtype, policy="roundpipe", num_microbatches=2
        ),
    )
    try:
        count, eager = _second_step(pipe, torch.randint(0, 1000, (4, 256)))
        sites = pipe.backend.host_syncs.report()
    finally:
        pipe.close()
    assert eager == {}
    if syncs:
        assert count > 0 and all(GROUPED in what for what in _sync_names(sites)), sites
    else:
        assert count == 0, sites


def _sync_names(report: dict) -> list[str]:
    return [site["what"] for site in report["sites"]]


def test_the_cpu_backend_counts_the_fallback_sync_of_fp32_grouped_experts():
    model = make_model("qwen3_moe", num_layers=2)
    model.set_experts_implementation("grouped_mm")
    pipe = roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", policy="roundpipe", num_microbatches=2))
    batch = make_batch(4, 8, vocab=model.config.vocab_size, padding=None)
    try:
        count, _ = _second_step(pipe, batch["input_ids"])
        sites = pipe.backend.host_syncs.report()
    finally:
        pipe.close()
    assert count > 0 and all(GROUPED in what for what in _sync_names(sites)), sites


def test_eager_experts_on_a_virtual_server_are_refused_naming_the_read():
    """transformers' eager experts loop over the experts hit, which they read on the host: a
    virtual run has no values to read. It ran on bytes that do not exist (no expert hit, so no
    expert computed, and no error)."""
    model = _meta_moe()
    model.set_experts_implementation("eager")
    pipe = roundpipe.wrap(
        model,
        roundpipe.RunConfig(
            devices="virtual:2xrtx4090", dtype="bf16", policy="roundpipe", num_microbatches=2
        ),
    )
    try:
        pipe.configure_optimizer(lr=1e-4)
        ids = torch.randint(0, 1000, (4, 256))
        with pytest.raises(VirtualDataError, match="nonzero|_local_scalar_dense"):
            pipe.forward_backward(ids, ids)
    finally:
        pipe.close()


def test_the_virtual_server_benchmark_reports_the_syncs_of_each_step():
    """``benchmarks/virtual_server.py`` took a step's host syncs as the count after it less the
    count before it, but each ``forward_backward`` starts the count afresh: a run making the same
    syncs every step reported zero."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import virtual_server

    case = virtual_server.Case(
        "moe", "qwen3-235b-a22b", "2xrtx4090", 4, 2, 2, layers=1, seq=256, lora_rank=32
    )
    r = virtual_server.run_case(case, 2)
    # one MoE layer, two microbatches, two calls: its grouped products forward, recomputed, backward
    assert r["host_syncs_per_step"] >= 2 * 2 * 2 * 2, r["host_syncs_per_step"]
