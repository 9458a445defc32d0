"""The GPU check's own helpers (tests/support/gpu_check_support.py), on the cpu backend: a helper
that only runs on a GPU is otherwise first exercised where a GPU is lent, a few minutes a session."""

from __future__ import annotations

import torch
from support.gpu_check_support import compute_delayed
from support.reference import assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

from roundpipe.backend.cpu import CpuStream

torch.set_num_threads(1)


def test_the_slow_gpu_patch_delays_every_compute_closure_and_passes_submit_its_arguments():
    """The slow-GPU patch (``slow_compute`` puts a sleep kernel before each compute closure on a
    GPU) wraps a stream class's ``submit``; here it wraps the cpu backend's, whose ``submit`` takes
    the same arguments. Every compute closure is delayed, the rest are not, and the run trains as
    plain PyTorch does."""
    model = make_model("llama", lora="default")
    batch = make_batch(batch=8, padding="left")
    want = reference_train(model, batch, 2)
    delayed: list[str] = []
    with compute_delayed(CpuStream, lambda: delayed.append("compute")):
        got = pipeline_train(
            model, batch, 2, devices="cpu:2", num_microbatches=4, policy="roundpipe", partition=None
        )
    assert delayed, "no compute closure was delayed"
    assert CpuStream.submit is not None and "late" not in CpuStream.submit.__qualname__, (
        "the patch outlived its block"
    )
    assert_same_run(got, want)
