"""The cuda backend speaks the same protocol: equivalence and memory on a real GPU.

Marked ``cuda``; skipped where torch sees no GPU. ``scripts/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import pytest
import torch
from reference import assert_same_run, pipeline_train, reference_train
from tiny_models import make_batch, make_model

import roundpipe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _exact_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize(("devices", "microbatches"), [("cuda:0", 1), ("cuda:0", 3), ("cuda:0x2", 4)])
@pytest.mark.parametrize("lora", [None, "default"])
def test_cuda_training_equals_plain_pytorch_on_cpu(devices, microbatches, lora):
    model = make_model("qwen3", lora=lora, tied=True)
    batch = make_batch(batch=6, padding="left")
    want = reference_train(model, batch, 3)
    got = pipeline_train(model, batch, 3, devices=devices, num_microbatches=microbatches)
    # Different kernels (cuBLAS vs CPU BLAS) sum in a different order: a little more room than on cpu.
    assert_same_run(got, want, loss_rtol=1e-4, weight_rtol=1e-3, weight_atol=1e-5)


def test_cuda_bf16_trains():
    model = make_model("llama", lora="all-linear")
    batch = make_batch(batch=6, padding="right")
    got = pipeline_train(model, batch, 5, devices="cuda:0x2", num_microbatches=3, dtype="bf16")
    assert got.losses[-1] < got.losses[0]


def test_cuda_ledger_bounds_what_torch_allocates():
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=6)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cuda:0", num_microbatches=3)) as pipe:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        torch.cuda.synchronize()
        ledger_peak = pipe.backend.devices[0].memory.peak
    real_peak = torch.cuda.max_memory_allocated() - base
    # The ledger counts what the runtime places (weights, activations, gradients); the real peak adds
    # the compute's own temporaries, which for these tiny layers stay within a few MiB.
    assert ledger_peak <= real_peak + 1
    assert real_peak < ledger_peak + 64 * 2**20
