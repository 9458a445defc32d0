"""Loading a HF model directory straight into the parameter store (roundpipe/train/loading.py).

The oracle is transformers itself: a model saved with ``save_pretrained`` and read back with
``from_pretrained`` (plain PyTorch, + peft) must give the same losses, and the same store contents,
as the same directory read by ``build_model`` + ``roundpipe.wrap(..., weights=...)``. The memory
test loads a 350 MB model in a fresh process and checks that host RAM grows by about one copy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.reference import EPS, LR
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.train.config import LoraConfig, ModelConfig
from roundpipe.train.loading import SafetensorsWeights, build_model

torch.set_num_threads(1)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="all-linear")
RUN = dict(devices="cpu:2", num_microbatches=2)


def _save(tmp_path: Path, family: str, *, dtype=torch.bfloat16, shard: str | None = "60KB", **kw) -> Path:
    """A tiny model of ``family`` saved in ``dtype`` (sharded unless ``shard`` is None)."""
    directory = tmp_path / f"{family}-{str(dtype).removeprefix('torch.')}"
    model = make_model(family, **kw).to(dtype)
    if shard is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=shard)
    return directory


def _from_pretrained(directory: Path, lora_from=None):
    """The reference: transformers' own loader in fp32, LoRA copied from ``lora_from`` (a model
    ``build_model`` made), in train mode like the built model."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    if lora_from is None:
        return model
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=LORA.rank, lora_alpha=LORA.alpha, target_modules=LORA.target_modules, task_type="CAUSAL_LM"
        ),
    )
    with torch.no_grad():
        lora = {n: p for n, p in lora_from.named_parameters() if "lora_" in n}
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(lora[n])
    return model


def _reference_losses(model, batch, steps: int) -> list[float]:
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=0.0
    )
    losses = []
    for _ in range(steps):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _pipeline_losses(pipe, batch, steps: int) -> list[float]:
    pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        out = pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        pipe.step()
        losses.append(out.loss)
    return losses


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_loaded_directory_trains_like_from_pretrained(tmp_path, family, lora):
    """A bf16 sharded checkpoint, run in fp32: build_model + wrap(weights=) gives the losses of
    from_pretrained + plain PyTorch (+ peft) over three AdamW steps; the model is usable after."""
    directory = _save(tmp_path, family)
    assert (directory / "model.safetensors.index.json").is_file()
    loaded = build_model(ModelConfig(path=str(directory)), LORA if lora else LoraConfig(), seed=0)
    assert any(p.is_meta for p in loaded.model.parameters())
    reference = _from_pretrained(directory, lora_from=loaded.model if lora else None)
    batch = make_batch()
    with roundpipe.wrap(loaded.model, roundpipe.RunConfig(**RUN), weights=loaded.weights) as pipe:
        assert not any(p.is_meta for p in loaded.model.parameters())
        with torch.no_grad():  # the re-pointed model runs on the CPU and matches before training
            torch.testing.assert_close(
                loaded.model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6
            )
        got = _pipeline_losses(pipe, batch, steps=3)
    want = _reference_losses(reference, batch, steps=3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0.0)
    assert got[-1] < got[0]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(host_memory="pageable"),
        dict(dtype="bf16"),
        dict(optimizer_mode="async"),
    ],
    ids=["arena-fp32", "pageable", "bf16", "async"],
)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_store_holds_what_from_pretrained_gives(tmp_path, options, lora):
    """For every kind of store entry (fp32 master as compute copy, pageable master + run-dtype
    copies, frozen copies converted or not), loading from meta fills the same bytes as wrapping the
    from_pretrained model, and re-points the model's tensor at the store's copy."""
    directory = _save(tmp_path, "qwen3", dtype=torch.bfloat16)
    loaded = build_model(ModelConfig(path=str(directory)), LORA if lora else LoraConfig(), seed=0)
    reference = _from_pretrained(directory, lora_from=loaded.model if lora else None)
    config = roundpipe.RunConfig(**RUN, **options)
    with (
        roundpipe.wrap(loaded.model, config, weights=loaded.weights) as pipe,
        roundpipe.wrap(reference, config) as want,
    ):
        want_entries = {e.name: e for e in want.store.entries}
        assert [e.name for e in pipe.store.entries] == list(want_entries)
        for e in pipe.store.entries:
            w = want_entries[e.name]
            assert (e.source is None) == ("lora_" in e.name), e.name  # all but LoRA came from the file
            assert len(e.buffers) == len(w.buffers)
            for got, expected in zip(e.buffers, w.buffers):
                assert got.dtype == expected.dtype and torch.equal(got, expected), e.name
            if e.trainable:
                assert torch.equal(e.master, w.master), e.name
                if e.source is not None:  # loaded: the model's tensor is the master
                    assert e.tensor.data_ptr() == e.master.data_ptr(), e.name
            else:  # frozen: the model's tensor is the store's only copy
                assert e.tensor.data_ptr() == e.compute.data_ptr(), e.name


def test_tied_checkpoint_that_stores_one_name(tmp_path):
    """A tied model's file holds only the embedding; the head finds it under its other name and
    the two stay one Parameter (one store entry)."""
    directory = _save(tmp_path, "llama", tied=True, dtype=torch.float32, shard=None)
    weights = SafetensorsWeights(directory)
    assert (
        "model.embed_tokens.weight" in weights.stored_names()
        and "lm_head.weight" not in weights.stored_names()
    )
    loaded = build_model(ModelConfig(path=str(directory)), LoraConfig(), seed=0)
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = _from_pretrained(directory)
    batch = make_batch()
    with roundpipe.wrap(model, roundpipe.RunConfig(**RUN), weights=loaded.weights) as pipe:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert sum(e.tensor is model.lm_head.weight for e in pipe.store.entries) == 1
        got = _pipeline_losses(pipe, batch, steps=2)
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor(_reference_losses(reference, batch, steps=2)), rtol=1e-5, atol=0.0
    )


def test_moe_experts_are_assembled_from_per_expert_tensors(tmp_path):
    """transformers fuses a MoE layer's experts into 3-D tensors; the file keeps one per expert."""
    directory = _save(tmp_path, "qwen3_moe", dtype=torch.float32)
    weights = SafetensorsWeights(directory)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weights.stored_names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in weights
    loaded = build_model(ModelConfig(path=str(directory)), LoraConfig(), seed=0)
    reference = _from_pretrained(directory)
    batch = make_batch()
    with roundpipe.wrap(loaded.model, roundpipe.RunConfig(**RUN), weights=loaded.weights) as pipe:
        out = pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
    want = reference(**batch).loss.item()
    assert out.loss == pytest.approx(want, rel=1e-5)


def test_lora_parameters_are_initialised_like_peft_and_seeded(tmp_path):
    directory = _save(tmp_path, "llama", dtype=torch.float32, shard=None)

    def lora(seed):
        model = build_model(ModelConfig(path=str(directory)), LORA, seed=seed).model
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    a, again, other = lora(0), lora(0), lora(1)
    assert a and all(not t.is_meta for t in a.values())
    for name, t in a.items():
        if "lora_B" in name:
            assert torch.count_nonzero(t) == 0, name  # B = 0: training starts from the base model
        else:
            fan_in = t.shape[1]
            bound = 1 / fan_in**0.5  # kaiming_uniform(a=sqrt(5)), as nn.Linear and peft
            assert 0 < t.abs().max() <= bound, name
        assert torch.equal(t, again[name])
    assert any(not torch.equal(t, other[n]) for n, t in a.items() if "lora_A" in n)


def test_build_from_config_numbers_is_seeded_and_has_no_weights():
    config = dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    first = build_model(ModelConfig(config=config), LORA, seed=3)
    second = build_model(ModelConfig(config=config), LORA, seed=3)
    assert first.weights is None
    import peft

    assert isinstance(first.model, peft.PeftModel)
    for (n, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert not p.is_meta and torch.equal(p, q), n
    batch = make_batch()
    with roundpipe.wrap(first.model, roundpipe.RunConfig(**RUN)) as pipe:
        losses = _pipeline_losses(pipe, batch, steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(ConfigError, match="model_type"):
        build_model(ModelConfig(config={"hidden_size": 64}), LoraConfig(), seed=0)
    with pytest.raises(ConfigError):
        build_model(ModelConfig(config={"model_type": "no-such-family"}), LoraConfig(), seed=0)


def test_safetensors_weights_read_every_dtype_and_convert(tmp_path, monkeypatch):
    """fill() gives what safetensors' own reader gives, converting dtypes (also chunk by chunk),
    for 0-d, empty and non-contiguous destinations."""
    from safetensors.torch import load_file, save_file

    import roundpipe.train.loading as loading

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.f32": torch.randn(7, 5, generator=g),
        "b.bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(3, 4, generator=g).to(torch.float16),
        "d.i64": torch.arange(10),
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.zeros(0, 4),
    }
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    want = load_file(tmp_path / "model.safetensors")
    weights = SafetensorsWeights(tmp_path)
    monkeypatch.setattr(loading, "READ_CHUNK_BYTES", 8)  # a conversion reads a few elements at a time
    for name, t in want.items():
        assert name in weights and f"base_model.model.{name}" in weights
        same = torch.empty_like(t)
        weights.fill(name, same)
        assert torch.equal(same, t), name
        if t.is_floating_point():
            wide = torch.empty(t.shape, dtype=torch.float64)
            weights.fill(name, wide)
            assert torch.equal(wide, t.double()), name
    strided = torch.empty(5, 7).t()  # not contiguous: read whole, then copied
    weights.fill("a.f32", strided)
    assert torch.equal(strided, want["a.f32"])
    with pytest.raises(CheckpointError, match=r"a\.f32.*\[7, 5\].*\[5, 7\]"):
        weights.fill("a.f32", torch.empty(5, 7))
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        weights.fill("nope", torch.empty(1))
    assert "nope" not in weights


def test_directory_problems_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        build_model(ModelConfig(path=str(tmp_path / "missing")), LoraConfig(), seed=0)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no model.safetensors"):
        SafetensorsWeights(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"only PyTorch \.bin.*save_pretrained"):
        SafetensorsWeights(tmp_path)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        SafetensorsWeights(no_config)


def test_broken_files_are_checkpoint_errors(tmp_path):
    directory = _save(tmp_path, "llama", dtype=torch.float32)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first, *_ = sorted(set(index["weight_map"].values()))
    shard = directory / first
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 16])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsWeights(directory)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {first}"):
        SafetensorsWeights(directory)


def test_meta_tensor_without_a_source_is_named(tmp_path):
    directory = _save(tmp_path, "llama", dtype=torch.float32, shard=None)
    loaded = build_model(ModelConfig(path=str(directory)), LoraConfig(), seed=0)
    with pytest.raises(ConfigError, match="model.embed_tokens.weight is on the meta device.*weights="):
        roundpipe.wrap(loaded.model, roundpipe.RunConfig(**RUN))

    class Partial:
        def __contains__(self, name):
            return name != "model.layers.1.mlp.up_proj.weight" and name in loaded.weights

        def fill(self, name, out):
            loaded.weights.fill(name, out)

    with pytest.raises(CheckpointError, match=r"no tensor for model\.layers\.1\.mlp\.up_proj\.weight"):
        roundpipe.wrap(loaded.model, roundpipe.RunConfig(**RUN), weights=Partial())


def test_model_built_on_the_meta_device_with_meta_buffers_is_refused(tmp_path):
    import transformers

    directory = _save(tmp_path, "llama", dtype=torch.float32, shard=None)
    with torch.device("meta"):  # unlike init_empty_weights, this leaves the rotary tables empty too
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(directory)
        )
    with pytest.raises(ConfigError, match=r"rotary_emb\.inv_freq.*init_empty_weights"):
        roundpipe.wrap(model, roundpipe.RunConfig(**RUN), weights=SafetensorsWeights(directory))


# ------------------------------------------------------------------ host memory: one copy, not two

_MEASURE = textwrap.dedent(
    """
    import json, resource, sys, threading, time
    import psutil, torch
    torch.set_num_threads(1)
    import accelerate, peft, transformers
    import roundpipe, roundpipe.runtime
    from roundpipe.train.config import LoraConfig, ModelConfig
    from roundpipe.train.loading import build_model

    path, mode = sys.argv[1], sys.argv[2]
    proc = psutil.Process()
    before = proc.memory_info().rss
    # Linux carries ru_maxrss over fork + exec: it starts at the parent's RSS, so only a rise
    # above its value now is this process's own peak.
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    targets = ["q_proj", "v_proj"]
    if mode == "new":
        loaded = build_model(ModelConfig(path=path), LoraConfig(enabled=True, rank=8, target_modules=targets), 0)
        model, weights = loaded.model, loaded.weights
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
        model, weights = peft.get_peft_model(model, lora), None
    pipe = roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2"), weights=weights)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if maxrss > maxrss_before:
        peak[0] = max(peak[0], maxrss)
    frozen = sum(e.nbytes for e in pipe.store.entries if not e.trainable)
    print(json.dumps({"before": before, "peak": peak[0], "store_frozen_bytes": frozen}))
    """
)


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> tuple[Path, int]:
    """A 357 MB fp32 Llama (hidden 1024, 2 layers, vocab 32000, untied), saved once."""
    import accelerate
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with accelerate.init_empty_weights():  # HF's random init is slow; any values will do
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    directory = tmp_path_factory.mktemp("big") / "llama"
    model.save_pretrained(directory)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return directory, nbytes


def _measure(directory: Path, mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(directory), mode],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_loading_holds_one_copy_of_the_model_in_host_ram(big_model_dir):
    """Peak RSS growth while loading + wrapping (LoRA, so the store holds the frozen base once) is
    about one copy of the model; the naive from_pretrained + wrap holds two at its peak."""
    directory, model_bytes = big_model_dir
    assert model_bytes >= 200e6
    new = _measure(directory, "new")
    naive = _measure(directory, "naive")
    grow_new = new["peak"] - new["before"]
    grow_naive = naive["peak"] - naive["before"]
    print(
        f"\nmodel {model_bytes / 1e6:.1f} MB; peak RSS growth: build_model + wrap(weights=) "
        f"{grow_new / 1e6:.1f} MB ({grow_new / model_bytes:.2f}x), from_pretrained + wrap "
        f"{grow_naive / 1e6:.1f} MB ({grow_naive / model_bytes:.2f}x)"
    )
    assert new["store_frozen_bytes"] >= 0.99 * model_bytes  # the store really holds the base
    assert grow_new < 1.35 * model_bytes
    assert grow_naive > grow_new
