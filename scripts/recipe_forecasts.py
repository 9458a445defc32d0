"""Write the simulator's forecast into the header comment of each model recipe in recipes/.

Each recipe named in ``RECIPES`` gets, between the two marker lines, the predicted tokens/s, peak
GPU memory and host RAM of its own settings (policy, microbatches, batch, sequence length, dtype,
optimizer mode, LoRA rank) on the server it is written for, so the comment cannot go stale:
``tests/test_recipes.py`` runs ``--check``, which fails when a header differs from what this
script would write.

    .venv/bin/python scripts/recipe_forecasts.py          # rewrite the headers
    .venv/bin/python scripts/recipe_forecasts.py --check  # exit 1 if any is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "# --- forecast: written by scripts/recipe_forecasts.py; do not edit by hand ---"
END = "# --- end of forecast ---"
GIB = 1 << 30

# recipe file -> (model preset with the recipe's architecture, server preset, host RAM in GiB or
# None for the preset's)
RECIPES = {
    "qwen3-8b-lora-8x4090.yaml": ("qwen3-8b", "8xrtx4090", None),
    "qwen3-32b-full-8x4090.yaml": ("qwen3-32b", "8xrtx4090", None),
    "qwen3-235b-a22b-lora-8x4090.yaml": ("qwen3-235b-a22b", "8xrtx4090", None),
    "llama3.1-8b-full-8x4090.yaml": ("llama3.1-8b", "8xrtx4090", None),
    "qwen3-235b-a22b-lora-32k-8x4090.yaml": ("qwen3-235b-a22b", "8xrtx4090", None),
    "qwen3-235b-a22b-qlora-8x4090.yaml": ("qwen3-235b-a22b", "8xrtx4090", 256),
    "qwen3-32b-qlora-1x4090.yaml": ("qwen3-32b", "1xrtx4090", 64e9 / 2**30),
}


def forecast_lines(recipe: Path, model: str, hardware: str, host_gib: float | None = None) -> list[str]:
    from roundpipe.presets import load_hardware
    from roundpipe.sim.scenario import Scenario, safe_run
    from roundpipe.train.recipe import load_recipe

    # The model path is given on the command line at training time; any value passes the check.
    cfg = load_recipe(recipe, ["model.path=MODEL_DIR"])
    run = cfg.run
    microbatches = run.num_microbatches if isinstance(run.num_microbatches, int) else None
    server = load_hardware(
        hardware, **({} if host_gib is None else {"host_memory_bytes": int(host_gib * GIB)})
    )
    r = safe_run(
        Scenario(
            model,
            server,
            run.policy,
            seq_len=cfg.data.max_length,
            global_batch=run.batch_size,
            microbatches=microbatches,
            lora_rank=cfg.lora.rank if cfg.lora.enabled else None,
            dtype=run.dtype,
            optimizer=run.optimizer_mode,
            round_size=run.options.get("round_size"),
            mlp_chunk_tokens=run.mlp_chunk_tokens,
            quantization=run.quantization,
            # peft's target_modules adapt no expert of a fused-experts MoE unless they name them
            lora_experts="experts" in str(cfg.lora.target_modules),
        )
    )
    what = f"LoRA r={cfg.lora.rank}" if cfg.lora.enabled else "full fine-tuning"
    if run.quantization is not None:
        what += f", {run.quantization} base weights"
    host = "" if host_gib is None else f" with {host_gib:.0f} GiB of host RAM"
    lines = [
        BEGIN,
        f"# Simulated for {model} ({what}) on {hardware}{host}: policy {run.policy}, batches of {run.batch_size} x "
        f"{cfg.data.max_length} tokens in {run.num_microbatches} microbatches, {run.dtype}, {run.optimizer_mode} optimizer.",
    ]
    if r.fits:
        lines.append(
            f"# Predicted: {r.tokens_per_s:,.0f} tokens/s, {r.iteration_s:.1f} s per step, "
            f"peak GPU memory {max(r.peak_gpu_bytes) / GIB:.1f} GiB, host RAM {r.peak_host_bytes / GIB:.0f} GiB."
        )
    else:
        lines.append(f"# Predicted: does not fit ({r.reason})")
    lines.append(END)
    return lines


def with_header(text: str, lines: list[str]) -> str:
    body = text.splitlines()
    if BEGIN in body:
        start, stop = body.index(BEGIN), body.index(END)
        body = body[:start] + lines + body[stop + 1 :]
    else:
        body = lines + body
    return "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a header is stale instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for name, (model, hardware, host_gib) in RECIPES.items():
        path = ROOT / "recipes" / name
        text = path.read_text(encoding="utf-8")
        new = with_header(text, forecast_lines(path, model, hardware, host_gib))
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale forecast headers: {', '.join(stale)}; run .venv/bin/python scripts/recipe_forecasts.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
