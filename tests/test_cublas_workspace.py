"""cuBLAS's workspaces are part of every CUDA device's memory budget: torch allocates one per
(cuBLAS handle, stream) a matmul ran with and keeps it, two per compute stream (the worker thread's
handle and the autograd engine's), of a size set by the GPU's architecture (torch's defaults:
32 MiB on sm90, 8.125 MiB before; plus 1 MiB of cuBLASLt workspace beside each). The rule is
written once (``partition.memory``) and read by the planner, the simulator and the cuda backend."""

from __future__ import annotations

import pytest

from roundpipe.partition.memory import (
    CUBLAS_WORKSPACES_PER_COMPUTE_STREAM,
    cublas_reserve_bytes,
    cublas_workspace_bytes,
    device_reserve_bytes,
)
from roundpipe.partition.model_plan import plan_partitions
from roundpipe.presets import load_hardware
from roundpipe.schedule import build_table
from roundpipe.schedule.table import Partition
from roundpipe.sim.simulator import simulate
from roundpipe.sim.workload import uniform_workload

MIB, KIB = 1 << 20, 1 << 10
STAGES = Partition((0, 1, 2, 3, 4))  # one layer per stage


@pytest.mark.parametrize(
    "capability, env, nbytes",
    [
        ((9, 0), {}, 32 * MIB + 1 * MIB),  # H100, H200: ":4096:8" and the cuBLASLt MiB
        ((8, 9), {}, 8 * MIB + 128 * KIB + 1 * MIB),  # RTX 4090: ":4096:2:16:8"
        ((8, 0), {}, 8 * MIB + 128 * KIB + 1 * MIB),
        ((10, 0), {}, 8 * MIB + 128 * KIB + 1 * MIB),  # torch's larger default is for sm90 only
        (None, {}, 0),  # not a CUDA GPU
        ((8, 9), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MIB + 1 * MIB),
        ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 2 * 128 * KIB),  # cuBLASLt capped to it
        ((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}, 36 * MIB),
        ((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, 32 * MIB),  # one shared workspace
    ],
)
def test_one_workspace_is_torchs_default_for_the_architecture_or_what_the_environment_says(
    capability, env, nbytes
):
    assert cublas_workspace_bytes(capability, env) == nbytes


def test_each_compute_stream_keeps_two():
    assert CUBLAS_WORKSPACES_PER_COMPUTE_STREAM == 2
    assert cublas_reserve_bytes((9, 0)) == 2 * 33 * MIB
    assert cublas_reserve_bytes((9, 0), compute_streams=2) == 4 * 33 * MIB


def test_presets_know_their_architecture_and_the_reserve_counts_the_workspaces():
    h200, rtx, cpu = load_hardware("2xh200"), load_hardware("2xrtx4090"), load_hardware("2xcpu")
    assert (h200.compute_capability, rtx.compute_capability, cpu.compute_capability) == ((9, 0), (8, 9), None)
    assert device_reserve_bytes(h200) == h200.workspace_reserve_bytes + 66 * MIB
    assert device_reserve_bytes(cpu) == cpu.workspace_reserve_bytes  # virtual devices: no cuBLAS


def _peak(hw) -> int:
    work = uniform_workload(4, 1e-3, 2e-3, param_bytes=1 << 30, act_in_bytes=1 << 20)
    return max(simulate(build_table("roundpipe", STAGES, STAGES, 2, 4), work, hw).peak_gpu_bytes)


def test_the_simulated_peak_of_a_preset_grows_by_exactly_the_workspaces():
    with_cublas = _peak(load_hardware("2xh200"))
    without = _peak(load_hardware("2xh200", gpu_compute_capability=None))
    assert with_cublas - without == cublas_reserve_bytes((9, 0))


def test_a_plan_with_less_headroom_than_the_workspaces_no_longer_fits():
    bare = load_hardware("2xh200", gpu_compute_capability=None)
    need = _peak(bare)
    tight = need + cublas_reserve_bytes((9, 0)) // 2  # fitted before the workspaces were counted
    work = uniform_workload(4, 1e-3, 2e-3, param_bytes=1 << 30, act_in_bytes=1 << 20)
    table = build_table("roundpipe", STAGES, STAGES, 2, 4)
    assert simulate(
        table, work, load_hardware("2xh200", gpu_compute_capability=None, gpu_memory_bytes=tight)
    ).fits
    over = simulate(table, work, load_hardware("2xh200", gpu_memory_bytes=tight))
    assert not over.fits and "device" in over.reason


def test_the_partition_planner_reserves_them_too():
    kw = dict(seq_len=1024, num_devices=2, microbatches=4)
    plan = plan_partitions("qwen3-0.6b", "2xh200", **kw)
    bare = plan_partitions("qwen3-0.6b", load_hardware("2xh200", gpu_compute_capability=None), **kw)
    assert plan.reserve_bytes - bare.reserve_bytes == cublas_reserve_bytes((9, 0))
    assert plan.peak_bytes - bare.peak_bytes == cublas_reserve_bytes((9, 0))


def test_the_cuda_backend_keeps_them_out_of_capacity_and_free_bytes(monkeypatch):
    """``CudaDevice.allocation_slack`` (subtracted from the planner's budget and from free bytes)
    counts them for the GPU's architecture and the environment; run without a GPU, on a stand-in."""
    import types

    import torch

    from roundpipe.backend.cpu_allocator import CUDA_RULES
    from roundpipe.backend.cuda import ALLOCATING_STREAMS, CudaDevice

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    device = types.SimpleNamespace(torch_device=torch.device("cuda", 0))
    slack = CudaDevice.allocation_slack(device)  # type: ignore[arg-type]
    assert slack == CUDA_RULES.overhead(ALLOCATING_STREAMS) + 66 * MIB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert CudaDevice.allocation_slack(device) == CUDA_RULES.overhead(ALLOCATING_STREAMS) + 2 * 256 * KIB  # type: ignore[arg-type]
