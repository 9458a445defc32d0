"""GPU check throughput run (scripts/gpu_check.sh): LoRA on a small Qwen3-shaped model, no data files.

It needs only torch, transformers and peft (what the lent GPU machine has), not the training
product's data stack; ``make demo`` is ``roundpipe train recipes/demo.yaml``.

The model is built from a config (no download) and the task is made up on the spot: every sequence
counts upwards from a random start (token t+1 = token t + 1, modulo the vocabulary), so a model
that learns the rule drives the loss towards zero. The run uses ``devices="auto"``: every GPU when
there are some, else two virtual CPU devices.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def build_model(vocab: int = 512, hidden: int = 256, layers: int = 4, seed: int = 0):
    import peft
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, lora)


def counting_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    ids = (start + torch.arange(seq)) % vocab
    labels = ids.clone()
    labels[:, :2] = -100  # the first tokens cannot be predicted from the rule: no target
    return {"input_ids": ids, "labels": labels}


def main(argv: list[str] | None = None) -> None:
    import roundpipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft calls a renamed HF helper

    model = build_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    config = roundpipe.RunConfig(devices=args.devices, num_microbatches=args.microbatches, dtype=args.dtype)
    generator = torch.Generator().manual_seed(0)
    with roundpipe.wrap(model, config) as pipe:
        names = ", ".join(d.name for d in pipe.backend.devices)
        print(
            f"roundpipe demo: LoRA on a {total / 1e6:.1f}M-parameter Qwen3-shaped model "
            f"({trainable / 1e6:.2f}M trainable), {len(pipe.adapter.layers)} layers streamed to [{names}]"
        )
        pipe.configure_optimizer(lr=5e-3, weight_decay=0.0)
        first = None
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            batch = counting_batch(args.batch, args.seq, model.config.vocab_size, generator)
            out = pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
            pipe.step()
            first = first if first is not None else out.loss
            if step == 1 or step % 5 == 0:
                rate = step * out.num_tokens / (time.perf_counter() - t0)
                print(f"step {step:3d}  loss {out.loss:7.4f}  ({rate:,.0f} tokens/s)")
        pipe.export_to(model)
        # Measured where the backend watches memory (CUDA, or cpu with the sanitizer), else the plan.
        peak = max(d["peak_bytes"] or d["planned_peak_bytes"] for d in pipe.stats()["devices"])
    print(
        f"loss {first:.3f} -> {out.loss:.3f}; peak bytes on a worker: {peak / 2**20:.1f} MiB "
        f"(the model's weights alone: {sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.1f} MiB)"
    )
    if not out.loss < first:
        raise SystemExit("the loss did not fall: something is wrong")


if __name__ == "__main__":
    main()
