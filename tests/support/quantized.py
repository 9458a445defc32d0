"""References for runs with compressed frozen weights (``RunConfig.quantization``)."""

from __future__ import annotations

import copy

import torch

from roundpipe.partition.quant_layout import quant_layout
from roundpipe.runtime.quantized import pack, quantizable, unpack


def dequantized(model, fmt: str):
    """A copy of ``model`` whose frozen block weights (those the store keeps compressed) hold what
    their ``fmt`` packing holds: plain PyTorch on the same dequantized weights."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." not in f"{name}.":
                continue
            for attr, p in module._parameters.items():
                if p is None or p.requires_grad or not quantizable(module, attr, p):
                    continue
                layout = quant_layout(fmt, tuple(p.shape))
                buf = torch.empty(layout.nbytes, dtype=torch.uint8)
                pack(p, layout, buf)
                p.copy_(unpack(buf, layout, p.dtype))
    return model


def peft_qlora(directory, like, fmt: str = "nf4"):
    """Plain peft QLoRA through bitsandbytes: the model saved in ``directory`` loaded with
    transformers' ``BitsAndBytesConfig`` (nf4 with double quantization, or int8; fp32 compute), the
    LoRA of ``like`` (a peft model of the same family) put on it with its weights copied."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=bnb_config(fmt), dtype=torch.float32, device_map="cpu"
    )
    if fmt == "nf4":
        same_absmax_codes(
            model, transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        )
    model.train()
    model = peft.get_peft_model(model, copy.deepcopy(like.peft_config["default"]))
    lora = {n: p for n, p in like.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in lora:
                p.copy_(lora.pop(n))
    assert not lora, f"LoRA parameters missing from the bitsandbytes model: {sorted(lora)}"
    return model


def same_absmax_codes(quantized, original) -> None:
    """Give each 4-bit weight of ``quantized`` (bitsandbytes) the absmax codes our packing of
    ``original``'s weight holds. bitsandbytes' native search of the dynamic map picks a neighbouring
    code in a few blocks near 0 (see test_quantization); every other byte is already the same, which
    this checks, so afterwards both hold the same quantized weights."""
    weights = dict(original.named_parameters())
    for name, module in quantized.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        w = weights[f"{name}.weight"]
        layout = quant_layout("nf4", tuple(w.shape))
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack(w, layout, buf)
        a, b = layout.section("codes")
        assert torch.equal(buf[a:b], module.weight.data.reshape(-1)), name
        a, b = layout.section("absmax")
        state.absmax.copy_(buf[a:b])


def bnb_config(fmt: str):
    """transformers' BitsAndBytesConfig for ``fmt``: nf4 with double quantization and fp32 compute,
    or LLM.int8()."""
    import transformers

    if fmt == "nf4":
        return transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    return transformers.BitsAndBytesConfig(load_in_8bit=True)
