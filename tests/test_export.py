"""Exports after pipeline training (roundpipe/train/export.py).

Oracles: peft's and transformers' own loaders. A LoRA model trained a few steps with the pipeline
is exported; ``PeftModel.from_pretrained`` (adapter) and ``AutoModelForCausalLM.from_pretrained``
(merged) must give the trained model's logits, and the pipeline's loss on the same batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError
from roundpipe.train.export import export_adapter, export_merged

torch.set_num_threads(1)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _base_dir(tmp_path: Path, family: str, *, tied: bool = False) -> Path:
    directory = tmp_path / f"base-{family}"
    make_model(family, tied=tied).save_pretrained(directory)
    return directory


def _fresh(directory: Path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def _lora(base, targets="all-linear", **kw):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", **kw)
    return peft.get_peft_model(base, config)


def _train(model, ids: torch.Tensor, steps: int = 3) -> float:
    """Train ``model`` a few pipeline steps, export the masters into it, and return the pipeline's
    loss on ``ids`` at the exported weights (a last forward_backward that does not step)."""
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)) as pipe:
        pipe.configure_optimizer(lr=1e-2)
        for _ in range(steps):
            pipe.forward_backward(ids, labels=ids)
            pipe.step()
        loss = pipe.forward_backward(ids, labels=ids, accumulate=True).loss
        pipe.export_to(model)
    model.eval()
    return loss


def _logits_and_loss(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss.item()


@pytest.mark.parametrize(
    "family, targets",
    [("llama", "all-linear"), ("qwen3_moe", ["q_proj", "v_proj"])],
    ids=["llama", "qwen3_moe"],
)
def test_adapter_and_merged_exports_reload_as_the_trained_model(tmp_path, family, targets):
    """qwen3_moe also writes its fused expert tensors back per expert, as transformers'
    save_pretrained does."""
    import peft

    base_dir = _base_dir(tmp_path, family)
    model = _lora(_fresh(base_dir), targets)
    ids = make_batch(padding=None)["input_ids"]
    untrained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    pipeline_loss = _train(model, ids)
    assert any(not torch.equal(p, untrained[n]) for n, p in model.named_parameters() if "lora_B" in n)
    logits, loss = _logits_and_loss(model, ids)
    assert loss == pytest.approx(pipeline_loss, rel=1e-5)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}

    adapter_dir = export_adapter(model, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    adapted = peft.PeftModel.from_pretrained(_fresh(base_dir), adapter_dir).eval()
    adapted_logits, adapted_loss = _logits_and_loss(adapted, ids)
    torch.testing.assert_close(adapted_logits, logits, rtol=0.0, atol=1e-6)
    assert adapted_loss == pytest.approx(pipeline_loss, rel=1e-5)

    merged_dir = export_merged(model, tmp_path / "merged", max_shard_bytes=100_000)
    assert (merged_dir / "model.safetensors.index.json").is_file()
    import transformers

    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        merged_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    merged_logits, merged_loss = _logits_and_loss(merged.eval(), ids)
    torch.testing.assert_close(merged_logits, logits, rtol=0.0, atol=1e-5)
    assert merged_loss == pytest.approx(pipeline_loss, rel=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    stored = json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("base_layer" in n or "lora_" in n for n in stored)
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored

    # the training model is untouched: same parameters, bit for bit, still a peft model
    for n, p in model.named_parameters():
        assert torch.equal(p, params_before[n]), n
    assert isinstance(model, peft.PeftModel)


def test_merged_export_merges_lora_on_fused_experts(tmp_path):
    """peft adapts a MoE layer's fused 3-D expert tensors with a ParamWrapper; the merged weight
    is split per expert. (No pipeline: an untrained adapter with non-zero B is enough.)"""
    import transformers

    model = _lora(_fresh(_base_dir(tmp_path, "qwen3_moe")), init_lora_weights=False).eval()
    assert any("experts" in n and "lora_A" in n for n, _ in model.named_parameters())
    ids = make_batch(padding=None)["input_ids"]
    logits, _ = _logits_and_loss(model, ids)
    out = export_merged(model, tmp_path / "merged")
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(_logits_and_loss(merged.eval(), ids)[0], logits, rtol=0.0, atol=1e-5)
    base_logits, _ = _logits_and_loss(_fresh(tmp_path / "base-qwen3_moe"), ids)
    assert (base_logits - logits).abs().max() > 1e-3  # the adapter does change the model


def test_full_fine_tune_merged_export_in_bf16_with_tokenizer(tmp_path):
    """A model without LoRA is written as is; ``dtype`` converts every float tensor and is
    recorded in config.json; the tokenizer is saved alongside; tied weights stay tied."""
    import transformers

    base_dir = _base_dir(tmp_path, "qwen3", tied=True)
    model = _fresh(base_dir)
    ids = make_batch(padding=None)["input_ids"]
    _train(model, ids, steps=2)
    logits, _ = _logits_and_loss(model, ids)

    class Tokenizer:  # what export_merged needs of a tokenizer
        def save_pretrained(self, directory):
            Path(directory, "tokenizer.json").write_text("{}")

    out = export_merged(model, tmp_path / "merged", tokenizer=Tokenizer(), dtype=torch.bfloat16)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert reloaded.dtype == torch.bfloat16
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    for n, p in reloaded.named_parameters():
        assert torch.equal(p, want[n]), n
    reloaded_logits, _ = _logits_and_loss(reloaded.float(), ids)
    torch.testing.assert_close(reloaded_logits, logits, rtol=0.05, atol=0.05)


def test_export_errors_say_what_to_use(tmp_path):
    base_dir = _base_dir(tmp_path, "llama", tied=True)
    with pytest.raises(ConfigError, match="export_merged"):
        export_adapter(_fresh(base_dir), tmp_path / "adapter")
    tied_head = _lora(_fresh(base_dir), targets=["lm_head"])
    with pytest.raises(ConfigError, match="tied.*export the adapter"):
        export_merged(tied_head, tmp_path / "merged")
