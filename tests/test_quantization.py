"""Frozen weights kept compressed (``RunConfig.quantization``): bitsandbytes' own formats, QLoRA that
trains as plain PyTorch (and plain peft + bitsandbytes) does on the same quantized weights, the host
bytes it saves, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from support.quantized import bnb_config, dequantized, peft_qlora, same_absmax_codes
from support.reference import EPS, LR, assert_exact, assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError
from roundpipe.number_codes import dynamic_map
from roundpipe.partition import quant_layout as quant_layout_module
from roundpipe.partition.quant_layout import TABLE_BYTES, quant_layout, quantized_bytes
from roundpipe.runtime import quantized
from roundpipe.runtime.quantized import pack, unpack

torch.set_num_threads(1)

STEPS = 3
# whole blocks, experts (rows of 64: bitsandbytes' native CPU unpacking reads a tensor of another
# even row length in blocks per row, not the flat blocks its packing and its CUDA kernels use), a
# short last block, an odd count
SHAPES = [(128, 256), (4, 96, 64), (3, 100), (7, 37)]


def _packed(w: torch.Tensor, fmt: str):
    layout = quant_layout(fmt, tuple(w.shape))
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(w, layout, buf)
    return layout, buf


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_is_bitsandbytes_format_both_ways(shape):
    """Our packing holds bitsandbytes' ``quantize_4bit(nf4, compress_statistics=True)``: the same
    4-bit codes, mean and second-level scales; each block's absmax code is the nearest in the
    dynamic map (bitsandbytes' native kernels search it approximately, so near 0 they may pick a
    neighbour: ours is never further from the true absmax). Unpacking bitsandbytes' own bytes gives
    its ``dequantize_4bit`` exactly: a checkpoint it wrote reads as it is."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    w = 0.05 * torch.randn(shape)
    layout, buf = _packed(w, "nf4")
    q, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)

    def part(b, name, dtype=torch.uint8):
        start, stop = layout.section(name)
        return b[start:stop].view(dtype)

    assert torch.equal(dynamic_map(), bnb.create_dynamic_map(signed=True))
    assert torch.equal(part(buf, "codes"), q.reshape(-1))
    assert torch.equal(part(buf, "absmax_scale", torch.float32), state.state2.absmax)
    assert torch.equal(part(buf, "offset", torch.float32), state.offset.reshape(1))
    ours, theirs = part(buf, "absmax"), state.absmax
    assert float((ours != theirs).float().mean()) <= 0.02
    true = (
        torch.nn.functional.pad(w.reshape(-1), (0, -w.numel() % 64)).view(-1, 64).abs().amax(dim=1)
        - state.offset
    )
    scale = state.state2.absmax.repeat_interleave(256)[: true.numel()]
    code = dynamic_map()
    assert ((code[ours.long()] * scale - true).abs() <= (code[theirs.long()] * scale - true).abs()).all()

    theirs_buf = buf.clone()
    part(theirs_buf, "absmax").copy_(state.absmax)
    assert torch.equal(unpack(theirs_buf, layout, torch.float32), bnb.dequantize_4bit(q, state))


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_packs_bitsandbytes_rows_and_scales(shape):
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(1)
    w = 0.05 * torch.randn(shape)
    layout, buf = _packed(w, "int8")
    cb, scb, _ = bnb.int8_vectorwise_quant(w.reshape(-1, shape[-1]))
    a, b = layout.section("values")
    assert torch.equal(buf[a:b].view(torch.int8), cb.reshape(-1))
    a, b = layout.section("scales")
    assert torch.equal(buf[a:b].view(torch.float32), scb)
    got = unpack(buf, layout, torch.float32).reshape(-1, shape[-1])
    assert torch.equal(got, bnb.int8_vectorwise_dequant(cb, scb))


@pytest.mark.parametrize("fmt, worst", [("nf4", 0.16), ("int8", 0.004), ("fp8", 0.07)])
def test_each_format_round_trips_within_its_resolution(fmt, worst):
    """The largest error relative to the row's largest value: nf4's widest gap (0.72 to 1) is 0.28
    of a block's absmax, so half of that at most, plus the 8-bit code of the absmax itself; int8
    rounds to 1/254 of the row's; e4m3 keeps 3 mantissa bits (1/16 at most)."""
    torch.manual_seed(2)
    w = torch.randn(64, 192)
    w[3] = 0.0  # a zero row: scales of 0 must not make NaNs
    layout, buf = _packed(w, fmt)
    got = unpack(buf, layout, torch.float32)
    assert torch.isfinite(got).all() and torch.equal(got[3], torch.zeros(192))
    err = (got - w).abs().amax(dim=1) / w.abs().amax(dim=1).clamp(min=1e-30)
    assert float(err.max()) <= worst
    assert unpack(buf, layout, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8"])
def test_unpacking_in_pieces_gives_the_whole(fmt, monkeypatch):
    """A tensor larger than one piece is unpacked piece by piece (bounded transient) to the same
    values: pieces of 2 second-level nf4 blocks (32,768 values) or of whole rows."""
    torch.manual_seed(3)
    w = torch.randn(3, 160, 256)  # 122,880 values: 4 pieces, the last one short
    layout, buf = _packed(w, fmt)
    whole = unpack(buf, layout, torch.float32)
    monkeypatch.setattr(quant_layout_module, "UNPACK_VALUES", 2 * 64 * 256)
    assert quantized._piece_values(layout) < layout.numel
    assert torch.equal(unpack(buf, layout, torch.float32), whole)


@pytest.mark.parametrize(
    "family, lora, fmt",
    [
        ("llama", "default", "nf4"),
        ("llama", "all-linear", "int8"),
        ("qwen3", "default", "fp8"),
        ("qwen3", "all-linear", "nf4"),
        ("qwen3_moe", "default", "nf4"),
        ("qwen3_moe", "default", "int8"),
        ("qwen3_moe", "default", "fp8"),
    ],
)
def test_qlora_trains_like_plain_pytorch_on_the_dequantized_weights(family, lora, fmt):
    """fp32 compute on ``cpu:2``: losses to rtol 1e-5 and adapters by the float64 rule against
    plain PyTorch whose frozen block weights hold what the packing holds (the MoE against plain
    fp32: torch's grouped expert matmul has no float64)."""
    model = make_model(family, lora=lora, num_layers=3)
    batch = make_batch(batch=6, seq=12)
    want = dequantized(model, fmt)
    plain = reference_train(want, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, devices="cpu:2", num_microbatches=3, quantization=fmt)
    if family == "qwen3_moe":
        assert_same_run(got, plain)
    else:
        assert_exact(got, plain, reference_train(want.double(), batch, STEPS))
    assert plain.losses != reference_train(model, batch, 1).losses[:1] * STEPS  # the weights did change


@pytest.mark.parametrize("family, fmt", [("llama", "nf4"), ("qwen3", "nf4"), ("llama", "int8")])
def test_qlora_trains_like_plain_peft_on_bitsandbytes(family, fmt, tmp_path):
    """The reference QLoRA users run: transformers' BitsAndBytesConfig (nf4 with double
    quantization, fp32 compute; or LLM.int8()) and peft's LoRA, trained by plain PyTorch. The same
    weights and adapters through roundpipe with quantization=fmt give the same losses (rtol 1e-5)
    and adapters."""
    pytest.importorskip("bitsandbytes")
    make_model(family, num_layers=3).save_pretrained(tmp_path)
    model = make_model(family, lora="default", num_layers=3)
    reference = peft_qlora(tmp_path, model, fmt)
    batch = make_batch(batch=6, seq=12)
    want = reference_train(reference, batch, STEPS)
    got = pipeline_train(model, batch, STEPS, devices="cpu:2", num_microbatches=3, quantization=fmt)
    if fmt == "int8":  # LLM.int8() multiplies in int8: a quantized activation, not our fp32 matmul
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=2e-2, atol=0)
        return
    assert_same_run(got, want)


def _frozen_bytes(pipe) -> tuple[int, list[str]]:
    """Bytes the store really holds for its compressed entries (their buffers' storages)."""
    packed = [e for e in pipe.store.entries if e.quant is not None]
    return sum(b.untyped_storage().nbytes() for e in packed for b in e.buffers), [e.name for e in packed]


def test_nf4_keeps_the_frozen_weights_in_under_a_third_of_bf16s_host_bytes():
    """Measured on the store's buffers, against the same weights in a bf16 run (both pinned-free
    ``pageable`` copies, so the bytes are the tensors' own)."""
    model = make_model("qwen3", lora="default", num_layers=2)
    run = dict(devices="cpu:1", dtype="bf16", host_memory="pageable")
    with roundpipe.wrap(model, roundpipe.RunConfig(quantization="nf4", **run)) as pipe:
        nf4, names = _frozen_bytes(pipe)
        entries = {e.name: e for e in pipe.store.entries}
    with roundpipe.wrap(model, roundpipe.RunConfig(**run)) as pipe:
        bf16 = sum(
            b.untyped_storage().nbytes() for e in pipe.store.entries if e.name in names for b in e.buffers
        )
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down of each block; norms and LoRA stay
    assert all(".lora_" not in n and "norm" not in n for n in names)
    assert nf4 == sum(quantized_bytes("nf4", tuple(entries[n].tensor.shape)) for n in names)
    assert nf4 <= 0.3 * bf16, f"nf4 {nf4} bytes against bf16 {bf16}"


def test_quantization_of_a_model_that_trains_every_weight_is_refused():
    with pytest.raises(ConfigError, match="full fine-tuning.*LoRA.*or leave quantization unset"):
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:1", quantization="nf4"))


def test_an_unknown_quantization_is_refused_naming_the_formats():
    with pytest.raises(ConfigError, match="nf4, int8, fp8"):
        roundpipe.RunConfig(quantization="nf2")


def test_a_checkpoint_is_packed_tensor_by_tensor_as_it_is_read(tmp_path):
    """A model built on meta (``roundpipe train``'s loading) gets its compressed weights straight
    from the files: the model's own tensor of each stays on meta (no full-precision copy on the
    host), and the run trains as the same model given in memory does."""
    from roundpipe.train.config import LoraConfig, ModelConfig
    from roundpipe.train.loading import build_model

    make_model("qwen3", num_layers=2).save_pretrained(tmp_path)
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="all-linear")
    batch = make_batch(batch=4, seq=10)
    run = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, quantization="nf4")

    def losses(pipe):
        pipe.configure_optimizer(lr=1e-3)
        out = []
        for _ in range(2):
            out.append(pipe.forward_backward(batch["input_ids"], labels=batch["labels"]).loss)
            pipe.step()
        return out

    loaded = build_model(ModelConfig(path=str(tmp_path)), lora, seed=0)
    in_memory = build_model(ModelConfig(path=str(tmp_path)), lora, seed=0)
    for name, p in in_memory.model.named_parameters():
        if p.is_meta:  # filled from the same files
            data = torch.empty(p.shape, dtype=p.dtype)
            in_memory.weights.fill(name, data)
            torch.utils.swap_tensors(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
    with roundpipe.wrap(loaded.model, run, weights=loaded.weights) as pipe:
        packed = [e for e in pipe.store.entries if e.quant is not None]
        assert packed and all(e.tensor.is_meta and e.source for e in packed)
        got = losses(pipe)
    with roundpipe.wrap(in_memory.model, run) as pipe:
        assert losses(pipe) == got


# ----------------------------------------------------------------------------- what it costs
def test_the_cost_model_counts_the_bytes_the_store_holds():
    """One layout rule for both: each block's device bytes in the cost model are what the store
    holds for it (byte for byte on a dense model; the bytes compression saves on fused experts
    within a few bytes of scales: the model fuses gate and up, the cost model counts them apart),
    and a block's saved bytes grow by its unpacked weights."""
    from roundpipe.partition.cost import model_costs

    for family, slack in (("llama", 0), ("qwen3_moe", 16)):
        model = make_model(family, lora="all-linear", num_layers=2)
        config = model.base_model.model.config.to_dict()
        plain = model_costs(config, 16, lora_rank=4, dtype="bf16")
        held = {}
        for fmt in (None, "nf4", "int8", "fp8"):
            with roundpipe.wrap(
                model, roundpipe.RunConfig(devices="cpu:1", dtype="bf16", quantization=fmt)
            ) as pipe:
                held[fmt] = pipe.store.layer_bytes
        for fmt in ("nf4", "int8", "fp8"):
            costs = model_costs(config, 16, lora_rank=4, dtype="bf16", quantization=fmt)
            for i, (c, p) in enumerate(zip(costs, plain)):
                if c.kind != "block":
                    assert c.param_bytes == p.param_bytes == held[fmt][i]
                    continue
                if family == "llama":
                    assert c.param_bytes == held[fmt][i]
                # what compression saves (peft's LoRA on fused experts differs from the model's)
                saved = p.param_bytes - c.param_bytes
                assert abs(saved - (held[None][i] - held[fmt][i])) <= slack, (family, fmt, c.name)
                assert c.saved_bytes - p.saved_bytes == _unpacked(config, c)


def _unpacked(config, cost) -> int:
    """bf16 bytes of a block's compressed weights: every linear's weight but the router's."""
    from roundpipe.partition.shape import model_shape

    shape = model_shape(config)
    i = int(cost.name.split(".")[1])
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    attention = h * q + 2 * h * kv + q * h
    mlp = 3 * shape.num_experts * h * shape.expert_width if shape.is_moe(i) else 3 * h * shape.dense_width
    return 2 * (attention + mlp)


def test_a_plan_bounds_the_device_memory_of_unpacked_weights():
    """One layer per stage on ``cpu:1``, weights four times the activations: the live peak of a
    step stays within the plan's figure (compressed weights resident, a layer's unpacked copy while
    it runs, a backward stage's kept until it ends), which is no more than 20% above it; nf4's
    peak is below the run's without compression (the prefetched layer is compressed too)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for fmt in (None, "nf4", "int8", "fp8"):
        run = roundpipe.RunConfig(
            devices="cpu:1", num_microbatches=1, policy="roundpipe", partition=None, quantization=fmt
        )
        with roundpipe.wrap(model, run) as pipe:
            pipe.configure_optimizer(lr=1e-3)
            pipe.forward_backward(ids, labels=ids)
            live = pipe.stats()["devices"][0]["peak_bytes"]
            planned = pipe._planner.planned_peaks(pipe.last_plan.table, 1, tuple(ids.shape))[0].nbytes
        assert live <= planned <= 1.2 * live, (fmt, live, planned)
        peaks[fmt] = live
    assert peaks["nf4"] < peaks[None]


def test_host_bytes_and_pcie_of_a_plan_shrink_with_compression():
    """The simulator's host state and upload bytes for Qwen3-32B LoRA: nf4 below 0.35x of bf16's
    weights, int8 and fp8 near half (the adapters, norms, embedding and head stay bf16)."""
    from roundpipe.partition.cost import model_costs, model_totals
    from roundpipe.presets import load_model_config

    config = load_model_config("qwen3-32b")
    host = {
        fmt: model_totals(model_costs(config, 4096, lora_rank=16, dtype="bf16", quantization=fmt))[
            "host_bytes"
        ]
        for fmt in (None, "nf4", "int8", "fp8")
    }
    assert host["nf4"] < 0.35 * host[None]
    assert 0.45 * host[None] < host["int8"] < 0.56 * host[None]
    assert host["fp8"] == host["int8"]
    with pytest.raises(ConfigError, match="full fine-tuning.*LoRA rank"):
        model_costs(config, 4096, dtype="bf16", quantization="nf4")


def test_the_tables_are_the_size_the_cost_model_counts():
    assert quantized.table_bytes().numel() == TABLE_BYTES


# ----------------------------------------------------------------------------- exports
def _trained(model, fmt: str, batch):
    """``model`` trained 2 steps with its base weights kept compressed; returns the pipeline's
    unpacked base values too (the exports merge on them)."""
    with roundpipe.wrap(
        model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, quantization=fmt)
    ) as pipe:
        pipe.configure_optimizer(lr=1e-2)
        for _ in range(2):
            pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()
        pipe.export_to(model)
        return {n: pipe.store.unpacked_weights().get(id(p)) for n, p in model.named_parameters()}


def test_the_adapter_loads_on_the_quantized_base_with_plain_peft(tmp_path):
    """Trained with nf4 here and exported with ``export_adapter``, the adapter loads with peft's
    ``PeftModel.from_pretrained`` onto the base transformers quantizes with BitsAndBytesConfig: the
    same model as our trained adapters put on that base (every adapter weight, the same loss), and
    the loss of the trained model on the dequantized weights to 1e-4 (bitsandbytes' CPU matmuls are
    not ours: its untrained base alone is ~3e-6 off)."""
    pytest.importorskip("bitsandbytes")
    import peft
    import transformers

    from roundpipe.train.export import export_adapter

    make_model("llama", num_layers=2).save_pretrained(tmp_path / "base")
    model = make_model("llama", lora="default", num_layers=2)
    batch = make_batch(batch=4, seq=10)
    _trained(model, "nf4", batch)
    export_adapter(model, tmp_path / "adapter")
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    same_absmax_codes(base, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").train()
    ours = peft_qlora(tmp_path / "base", model, "nf4")
    theirs = dict(loaded.named_parameters())
    lora = [(n, p) for n, p in ours.named_parameters() if "lora_" in n]
    assert lora and all(torch.equal(p, theirs[n]) for n, p in lora)
    got = loaded(**batch).loss.item()
    assert got == ours(**batch).loss.item()
    assert got == pytest.approx(dequantized(model, "nf4")(**batch).loss.item(), rel=1e-4)


def test_a_merged_export_merges_into_the_dequantized_weights_in_bf16(tmp_path):
    """The merged file holds, for each compressed weight, bf16(unpacked + LoRA update), says so in
    config.json, and loads with transformers alone."""
    import transformers

    from roundpipe.train.export import export_merged

    model = make_model("qwen3", lora="default", num_layers=2)
    batch = make_batch(batch=4, seq=10)
    unpacked = _trained(model, "int8", batch)
    values = {id(p): unpacked[n] for n, p in model.named_parameters() if unpacked[n] is not None}
    export_merged(model, tmp_path, dtype=torch.bfloat16, base_values=values, merged_from="int8")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "int8" in merged.config.roundpipe_merged_from
    want = dequantized(model, "int8").merge_and_unload()
    for name, p in merged.named_parameters():
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, want.get_parameter(name).to(torch.bfloat16), rtol=0, atol=0, msg=name)


def test_a_virtual_qlora_step_moves_and_computes_what_the_simulator_says():
    """Two Llama-3.1-8B blocks with LoRA and nf4 on a virtual RTX 4090 (no data, modelled time):
    the runtime uploads the compressed bytes the simulator counts, its modelled compute includes
    the unpacking the cost model times, and its device memory follows the memory model."""
    import peft
    from test_virtual_server import MEMORY_TOLERANCE, _meta_llama

    from roundpipe.sim import SimOptions, simulate

    model = peft.get_peft_model(_meta_llama(2), peft.LoraConfig(r=16, target_modules="all-linear"))
    rows, seq, microbatches = 4, 4096, 2
    run = roundpipe.RunConfig(
        devices="virtual:1xrtx4090", dtype="bf16", num_microbatches=microbatches, quantization="nf4"
    )
    with roundpipe.wrap(model, run) as pipe:
        pipe.configure_optimizer(lr=1e-4)
        ids = torch.randint(0, 1000, (rows, seq))
        for _ in range(2):
            before = pipe.backend.modelled()
            pipe.forward_backward(ids, ids)
            pipe.step()
        after = pipe.backend.modelled()
        workload = pipe.backend.costs._workload(rows // microbatches, seq)
        sim = simulate(pipe.last_plan.table, workload, pipe.backend.server, SimOptions(optimizer="sync"))
        busy = [a - b for a, b in zip(after["compute_busy_s"], before["compute_busy_s"])]
        assert busy == pytest.approx(list(sim.compute_busy_s), rel=0.01)
        assert after["h2d_bytes"] - before["h2d_bytes"] == pytest.approx(sim.h2d_bytes, rel=0.01)
        packed = sum(b.nbytes for e in pipe.store.entries if e.quant is not None for b in e.buffers)
        assert packed < 0.27 * sum(2 * e.tensor.numel() for e in pipe.store.entries if e.quant is not None)
        low, high = MEMORY_TOLERANCE
        for dev, planned in zip(pipe.backend.devices, sim.peak_gpu_bytes):
            assert low * planned <= dev.memory.peak <= high * planned


@pytest.mark.slow
def test_the_235b_qlora_plan_fits_256_gib_where_bf16_does_not():
    """``roundpipe plan``'s search for Qwen3-235B-A22B, LoRA r=32 on the attention, sequences of
    4,096, on 8x RTX 4090 with 256 GiB of host RAM: nf4 fits, bf16 does not (it needs ~625 GiB),
    and nf4's tokens/s is within 0.6-1x of bf16's on a host that holds it."""
    from roundpipe.presets import GIB, load_hardware
    from roundpipe.sim.tune import tune

    small = load_hardware("8xrtx4090", host_memory_bytes=256 * GIB)
    kw = dict(
        seq_len=4096, global_batch=64, lora_rank=32, dtype="bf16", lora_experts=False, time_budget_s=15.0
    )
    nf4 = tune("qwen3-235b-a22b", small, quantization="nf4", **kw).best
    bf16 = tune("qwen3-235b-a22b", small, **kw).best
    roomy = tune("qwen3-235b-a22b", "8xrtx4090", **kw).best
    assert nf4.fits and nf4.result.peak_host_bytes <= 256 * GIB
    assert not bf16.fits and roomy.fits and roomy.result.peak_host_bytes > 256 * GIB
    assert 0.6 * roomy.result.tokens_per_s < nf4.result.tokens_per_s < roomy.result.tokens_per_s


def test_a_model_already_quantized_by_bitsandbytes_is_refused_at_wrap_with_what_to_do(tmp_path):
    """Its packed uint8 weights were stored as if they were weights and the first forward failed in
    a worker (StageError: AssertionError in F of stage 1); now it is refused before anything runs,
    saying to load the model in bf16 and let roundpipe compress it."""
    pytest.importorskip("bitsandbytes")
    import peft
    import transformers

    from roundpipe.errors import UnsupportedModel

    make_model("llama", num_layers=2).save_pretrained(tmp_path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for fmt in (None, "nf4"):
        with pytest.raises(
            UnsupportedModel, match="holds uint8 values.*load the model in bf16.*quantization="
        ):
            roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", quantization=fmt))


def _saved_by_bitsandbytes(directory, family: str, fmt: str):
    """A tiny ``family`` model quantized by transformers' BitsAndBytesConfig and saved: its packed
    codes and quant states are what the files hold."""
    import transformers

    # LLM.int8() quantizes the fp16 weight: the plain checkpoint is fp16, so packing it here starts
    # from the same values
    make_model(family, num_layers=2, dtype=torch.float16 if fmt == "int8" else torch.float32).save_pretrained(
        directory / "plain"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory / "plain", quantization_config=bnb_config(fmt), dtype=torch.float32, device_map="cpu"
    )
    model.save_pretrained(directory / "packed")
    return directory / "packed"


def test_a_checkpoint_saved_by_bitsandbytes_trains_as_it_is(tmp_path):
    """Saved after BitsAndBytesConfig (nf4, double quantization), read by ``roundpipe train``'s loader:
    the stored codes and scales become the store's buffers unchanged, and the run trains like plain
    peft QLoRA on that same saved model (rtol 1e-5); without quantization='nf4' it is refused."""
    pytest.importorskip("bitsandbytes")
    import peft
    import transformers

    from roundpipe.train.config import LoraConfig, ModelConfig
    from roundpipe.train.loading import build_model

    saved = _saved_by_bitsandbytes(tmp_path, "llama", "nf4")
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="packed in nf4.*set quantization='nf4'"):
        loaded = build_model(ModelConfig(path=str(saved)), lora, seed=0)
        roundpipe.wrap(loaded.model, roundpipe.RunConfig(devices="cpu:1"), weights=loaded.weights)
    loaded = build_model(ModelConfig(path=str(saved)), lora, seed=0)
    batch = make_batch(batch=6, seq=12)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        saved, dtype=torch.float32, device_map="cpu"
    )
    reference = peft.get_peft_model(reference.train(), copy.deepcopy(loaded.model.peft_config["default"]))
    ours = dict(loaded.model.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name:
                p.copy_(ours[name])
    want = reference_train(reference, batch, STEPS)
    run = roundpipe.RunConfig(devices="cpu:2", num_microbatches=3, quantization="nf4")
    with roundpipe.wrap(loaded.model, run, weights=loaded.weights) as pipe:
        packed = [e for e in pipe.store.entries if e.quant is not None]
        assert packed and all(e.tensor.is_meta for e in packed)
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0)
        losses = []
        for _ in range(STEPS):
            losses.append(
                pipe.forward_backward(
                    batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
                ).loss
            )
            pipe.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want.losses), rtol=1e-5, atol=0)


def test_an_int8_checkpoint_saved_by_bitsandbytes_trains_as_packing_it_here_does(tmp_path):
    """LLM.int8()'s saved rows and SCB are the bytes roundpipe's int8 packing makes of the same
    weights: the run from the saved int8 checkpoint and the run from the unquantized one with
    quantization='int8' have the same losses, exactly."""
    pytest.importorskip("bitsandbytes")
    from roundpipe.train.config import LoraConfig, ModelConfig
    from roundpipe.train.loading import build_model

    saved = _saved_by_bitsandbytes(tmp_path, "qwen3", "int8")
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="all-linear")
    batch = make_batch(batch=4, seq=10)
    losses = []
    for directory in (saved, tmp_path / "plain"):
        loaded = build_model(ModelConfig(path=str(directory)), lora, seed=0)
        run = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, quantization="int8")
        with roundpipe.wrap(loaded.model, run, weights=loaded.weights) as pipe:
            pipe.configure_optimizer(lr=1e-3)
            losses.append([])
            for _ in range(2):
                losses[-1].append(pipe.forward_backward(batch["input_ids"], labels=batch["labels"]).loss)
                pipe.step()
    assert losses[0] == losses[1]


def test_roundpipe_train_runs_a_qlora_recipe_and_exports_both(tmp_path):
    """A recipe with ``run.quantization: nf4`` and ``optim.state_dtype: bf16`` trains (the loss
    falls) and exports the adapter and a bf16 merged model that says what it was merged into."""
    import transformers
    from test_train import _quiet, _recipe

    from roundpipe.train.recipe import config_from_dict
    from roundpipe.train.trainer import Trainer

    recipe = _recipe(
        tmp_path,
        lora={"enabled": True, "rank": 4, "alpha": 8},
        run={"quantization": "nf4"},
        optim={"lr": 1e-2, "state_dtype": "bf16"},
        checkpoint={"export": "both"},
    )
    result = Trainer(config_from_dict(recipe), log=_quiet).fit()
    losses = result.train_losses
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    assert (result.exports["adapter"] / "adapter_config.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(result.exports["merged"])
    assert "nf4" in merged.config.roundpipe_merged_from
    assert all(p.dtype == torch.bfloat16 for p in merged.parameters())
