"""The cuda backend speaks the same protocol: equivalence, stream safety and memory on a real GPU.

Marked ``cuda``; skipped where torch sees no GPU. ``scripts/gpu_check.sh`` runs them on a GPU
machine (with that machine's own torch and transformers; too old a version is a skip that names
it), the equivalence tests also under PyTorch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``).
With ``ROUNDPIPE_GPU_CHECK_DRY_RUN=1`` (``scripts/gpu_check.sh --dry-run``) the same tests run on
the cpu backend: ``cuda:0x2`` becomes ``cpu:2``, ``cuda:0`` becomes ``cpu:1``, the memory test
shrinks its model and reads the cpu devices' measured peaks instead of torch.cuda's.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from support.gpu_check_support import (
    DRY_RUN,
    MiB,
    below_minimum,
    build_llama,
    build_or_skip,
    compute_waits_removed,
    devices,
    equivalence_grid,
    measure_working_set,
    measured_memory_is_live,
    memory_sizes,
    older_than_tested,
    on_gpu,
    planning_ledger,
    sanitize_new_threads,
    sanitizer_enabled,
    slow_compute,
    transformers_has,
    versions_line,
    workers_per_gpu,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (DRY_RUN or torch.cuda.is_available()),
        reason="needs a CUDA GPU (scripts/gpu_check.sh; --dry-run runs these on cpu devices)",
    ),
]

try:
    from support.reference import assert_same_run, pipeline_train, reference_train
    from support.tiny_models import make_batch, make_model, variable_length_batch

    import roundpipe
    from roundpipe.config import known_policies
    from roundpipe.partition.memory import cublas_reserve_bytes
except Exception as e:  # an older torch / transformers than roundpipe can even import with
    if not older_than_tested():
        raise
    pytest.skip(f"roundpipe cannot be imported with {versions_line()}: {e}", allow_module_level=True)

# The sanitizer walks the Python stack at every kernel: two steps (one after an update) there.
STEPS = 2 if sanitizer_enabled() else 3
# Cuda's kernels (cuBLAS, fused attention) sum in a different order from the CPU reference's: a
# little more room than the cpu tests' tolerances.
GPU_TOLERANCES = dict(loss_rtol=1e-4, weight_rtol=1e-3, weight_atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _supported_versions():
    too_old = below_minimum()
    if too_old:
        pytest.skip(f"roundpipe needs newer packages than {versions_line()}: {'; '.join(too_old)}")
    missing = transformers_has("LlamaConfig", "Qwen3Config", "AutoModelForCausalLM")
    if missing:
        pytest.skip(f"{versions_line()} lacks {', '.join(missing)} (the tests' model families)")


@pytest.fixture(autouse=True)
def _exact_matmuls():
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(autouse=True)
def _sanitize_worker_threads():
    """Under TORCH_CUDA_SANITIZER, roundpipe's worker threads are checked too (not only this one)."""
    if not sanitizer_enabled():
        yield
        return
    with sanitize_new_threads():
        yield


# ----------------------------------------------------------------------------- stream sanitizer
def _race_in_a_new_thread(synchronise: bool) -> BaseException | None:
    """Write a tensor on one stream and read it on another, in a new thread; what it raised."""
    outcome: list[BaseException | None] = []

    def body():
        try:
            writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
            with torch.cuda.stream(writer):
                a = torch.ones(1 << 20, device="cuda")
            if synchronise:
                reader.wait_stream(writer)
            with torch.cuda.stream(reader):
                a.add(1)
            torch.cuda.synchronize()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return outcome[0]


def test_the_stream_sanitizer_catches_an_unsynchronised_read_in_a_worker_thread():
    """The control for the sanitized equivalence runs: were the hook on worker threads missing,
    the sanitizer would check nothing roundpipe does and those runs would pass vacuously."""
    if not sanitizer_enabled():
        pytest.skip("TORCH_CUDA_SANITIZER is not set (or there is no GPU): nothing to check")
    from torch.cuda._sanitizer import CUDASanitizerErrors

    assert isinstance(_race_in_a_new_thread(synchronise=False), CUDASanitizerErrors)
    assert _race_in_a_new_thread(synchronise=True) is None


# ----------------------------------------------------------------------------- equivalence
_references: dict = {}


def _reference(lora):
    """A tiny tied qwen3 of 8 layers (embed, 6 blocks, head: enough stages for interleaved and
    hanayo on two workers) and its plain-PyTorch training on the CPU."""
    if lora not in _references:
        model = build_or_skip(
            "tests/support/tiny_models.make_model('qwen3')",
            lambda: make_model("qwen3", num_layers=6, tied=True, lora=lora),
        )
        batch = make_batch(batch=8, padding="left")
        _references[lora] = (model, batch, reference_train(model, batch, STEPS))
    return _references[lora]


@pytest.mark.parametrize(
    ("policy", "spec", "microbatches", "lora", "order"),
    [
        pytest.param(*case, id=f"{case[0]}-{devices(case[1])}-m{case[2]}-{case[3] or 'full'}-{case[4]}")
        for case in equivalence_grid(known_policies())
    ],
)
def test_every_policy_trains_like_plain_pytorch(policy, spec, microbatches, lora, order):
    model, batch, want = _reference(lora)
    got = pipeline_train(
        model,
        batch,
        STEPS,
        devices=devices(spec),
        num_microbatches=microbatches,
        policy=policy,
        order=order,
        partition=None,  # the policy's own default stages: the table under test
    )
    assert_same_run(got, want, **GPU_TOLERANCES)


# ----------------------------------------------------------------------------- smoke
def test_bf16_lora_training_lowers_the_loss():
    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", lora="all-linear")
    )
    batch = make_batch(batch=6, padding="right")
    got = pipeline_train(model, batch, 5, devices=devices("cuda:0x2"), num_microbatches=3, dtype="bf16")
    assert got.losses[-1] < got.losses[0]


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8"])
def test_qlora_on_the_gpu_matches_plain_pytorch_on_the_dequantized_weights(fmt):
    """Frozen weights kept compressed (RunConfig.quantization), unpacked on the GPU's compute
    stream with the tables each layer carries: fp32 compute against plain PyTorch on the CPU on the
    same dequantized weights."""
    from support.quantized import dequantized

    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", lora="all-linear")
    )
    batch = make_batch(batch=6, padding="left")
    want = reference_train(dequantized(model, fmt), batch, STEPS)
    got = pipeline_train(
        model, batch, STEPS, devices=devices("cuda:0x2"), num_microbatches=3, quantization=fmt
    )
    assert_same_run(got, want, **GPU_TOLERANCES)


def test_the_ledger_peak_bounds_what_is_really_allocated():
    """The ledger counts what the runtime places (weights, activations, gradients); the real peak
    (torch.cuda's allocator; the cpu devices' measured live bytes in a dry run) adds the compute's
    own temporaries, which for these tiny layers stay within a few MiB, and cuBLAS's workspaces,
    which the runtime keeps out of the ledger's budget as allocation slack (two per compute stream:
    2 x 33 MiB on an H100 or H200, 2 x 9.1 MiB on other GPUs; the first GPU run measured 64.2 MiB
    above the ledger's peak on an H200, over the 64 MiB this test first allowed)."""
    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", num_layers=3)
    )
    batch = make_batch(batch=6)
    if on_gpu():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    config = roundpipe.RunConfig(
        devices=devices("cuda:0"), num_microbatches=3, policy="roundpipe", partition=None
    )
    with roundpipe.wrap(model, config) as pipe:  # one layer per stage, as the bound below assumes
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        dev = pipe.backend.devices[0]
        if on_gpu():
            torch.cuda.synchronize()
        ledger_peak = planning_ledger(dev).peak
        measured = dev.memory.peak if measured_memory_is_live(dev) else None
        largest = max(pipe.store.layer_bytes)
    capability = torch.cuda.get_device_capability(0) if on_gpu() else None
    cublas = cublas_reserve_bytes(capability, env=os.environ)
    if on_gpu():
        real_peak = torch.cuda.max_memory_allocated() - base
    elif measured is not None:
        real_peak = measured
    else:
        pytest.skip("dry run: this runtime's Device.memory is the ledger itself, nothing measured to compare")
    print(
        f"\nledger peak {ledger_peak / MiB:.3f} MiB, real peak {real_peak / MiB:.3f} MiB, "
        f"largest layer {largest / MiB:.3f} MiB, cuBLAS workspaces {cublas / MiB:.3f} MiB"
    )
    assert largest <= ledger_peak <= real_peak + 1
    assert real_peak < ledger_peak + cublas + 8 * MiB


# ----------------------------------------------------------------------------- CUDA's clock
# A closure runs when it is issued, while the GPU may be far behind (docs/design.md §4): the tests
# below make the GPU slow, read device values on the host only where an error is raised, and vary
# every hand-off's size, which is what exposed the defects of issue 21 on the cpu backend's model.


def test_on_cudas_clock_a_slow_gpu_lora_run_with_the_embedding_alone_trains_like_plain_pytorch():
    """LoRA llama, roundpipe, one layer per stage: the frozen embedding has a backward stage of its
    own with nothing to do. Every compute is queued behind a sleep, so the host issues far ahead:
    a pinned buffer given back while a download still wrote it, or a device buffer reused before the
    work reading it ran, would change the numbers."""
    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", lora="default")
    )
    batch = make_batch(batch=8, padding="left")
    want = reference_train(model, batch, STEPS)
    with slow_compute():
        got = pipeline_train(
            model,
            batch,
            STEPS,
            devices=devices("cuda:0x2"),
            num_microbatches=4,
            policy="roundpipe",
            partition=None,
        )
    assert_same_run(got, want, **GPU_TOLERANCES)


def test_on_cudas_clock_a_warm_step_with_an_attention_mask_makes_no_host_sync():
    """Reading a device value on the host waits for the stream (the run-ahead collapses). With
    ``torch.cuda.set_sync_debug_mode("error")`` around a warm step (left padding, an attention mask)
    any such read raises where it happens; a dry run reads the cpu backend's count instead."""
    model = build_or_skip("tests/support/tiny_models.make_model('llama')", lambda: make_model("llama"))
    batch = make_batch(batch=8, padding="left")
    config = roundpipe.RunConfig(devices=devices("cuda:0x2"), num_microbatches=4, policy="roundpipe")
    with roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=1e-3)

        def step():
            out = pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
            return out.loss

        step()  # warm: the first step measures, plans and may read what later steps do not
        if on_gpu():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            loss = step()
            syncs = pipe.stats()["host_syncs"]
            assert syncs["count"] == 0, syncs["sites"]
    print(f"\nwarm step with an attention mask: loss {loss:.4f}, no host sync")


def test_on_cudas_clock_the_pinned_pool_stays_within_its_headroom_over_variable_lengths():
    """Lengths drawn per step change every hand-off's size: the pinned pool reuses size classes and
    larger buffers and gives the least recently used back, so its reserved bytes stay within 1.25x
    its peak in use (and it does not register new host memory with the driver every step)."""
    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", num_layers=2)
    )
    rng = torch.Generator().manual_seed(0)
    config = roundpipe.RunConfig(
        devices=devices("cuda:0x2"), num_microbatches=4, policy="roundpipe", partition=None
    )
    ratios = []
    with roundpipe.wrap(model, config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        for _ in range(20):
            batch = variable_length_batch(rng)
            pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
            host = pipe.stats()["host_memory"]
            ratios.append(host["pool_reserved_bytes"] / host["pool_peak_in_use_buffer_bytes"])
    print(
        f"\npinned pool over 20 variable-length steps: reserved / peak in use at most {max(ratios):.3f} "
        f"(last {ratios[-1]:.3f}); {host}"
    )
    assert max(ratios) <= 1.25, host
    assert host["pool_in_use_bytes"] == 0, host


def test_the_stream_sanitizer_flags_a_roundpipe_wait_removed():
    """The negative control of the stream checks: with the compute streams' waits dropped (for the
    weights and inputs uploaded on other streams) one step must be flagged, by PyTorch's CUDA
    sanitizer on a GPU (``TORCH_CUDA_SANITIZER=1``), by the cpu backend's own checks in a dry run."""
    if on_gpu() and not sanitizer_enabled():
        pytest.skip("TORCH_CUDA_SANITIZER is not set: nothing would flag the missing wait")
    if on_gpu():
        from torch.cuda._sanitizer import CUDASanitizerErrors as flagged
    else:
        from roundpipe.errors import StreamProtocolError as flagged
    model = build_or_skip(
        "tests/support/tiny_models.make_model('llama')", lambda: make_model("llama", num_layers=2)
    )
    batch = make_batch(batch=4)
    config = roundpipe.RunConfig(
        devices=devices("cuda:0"), num_microbatches=2, policy="roundpipe", partition=None, sanitize=True
    )
    caught = None
    with roundpipe.wrap(model, config) as pipe, compute_waits_removed():
        try:
            pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
        except Exception as e:
            caught = e
    chain = []
    while caught is not None and len(chain) < 8:
        chain.append(caught)
        caught = caught.__cause__ or caught.__context__
    assert any(isinstance(e, flagged) for e in chain), [f"{type(e).__name__}: {e}"[:300] for e in chain]
    print(f"\nflagged: {type(chain[0]).__name__}: {str(chain[0])[:300]}")


# ----------------------------------------------------------------------------- memory
MEMORY_STEPS = 3
_working_sets: dict = {}


@pytest.fixture(scope="module")
def big_llama():
    """Llama blocks of 386 MiB in bf16 (2 MiB in a dry run), small vocabulary (memory_sizes)."""
    sizes = memory_sizes()
    return sizes, build_or_skip(f"a Llama of {sizes}", lambda: build_llama(sizes))


def _working_set(model, rows, seq, device):
    if rows not in _working_sets:
        _working_sets[rows] = build_or_skip(
            "one decoder layer's plain forward + backward",
            lambda: measure_working_set(model, rows, seq, device, torch.bfloat16),
        )
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return _working_sets[rows]


def _runtime_plan(pipe) -> str:
    """The runtime's own per-stage plan, printed for comparison (informational)."""
    try:
        plan = pipe.plan
        return str(plan() if callable(plan) else plan)
    except Exception as e:
        return f"(not available: {type(e).__name__}: {e})"


@pytest.mark.parametrize(
    ("spec", "microbatches"),
    [pytest.param(spec, m, id=f"{devices(spec)}-m{m}") for spec in ("cuda:0", "cuda:0x2") for m in (2, 8)],
)
def test_peak_memory_stays_within_two_stages_weights_and_a_working_set(big_llama, spec, microbatches):
    """Full fine-tuning in bf16 with the roundpipe policy (one layer per stage), a few steps.

    The plan of one worker: the weights of two stages (the one computing and the prefetched next),
    plus one working set (a decoder layer's forward + backward for one microbatch measured in plain
    PyTorch on the same device, the stage's fp32 gradient accumulator, its incoming activation and
    gradient, a stream's cuBLAS workspace), plus what the two-tasks-in-flight rule lets overlap it:
    the previous stage's accumulator still downloading, the next task's inputs arriving, and the
    microbatch's context. Workers sharing a GPU share its allocator: their plans add up.
    """
    sizes, model = big_llama
    gpu = on_gpu()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    rows = -(-sizes.batch // microbatches)
    ws = _working_set(model, rows, sizes.seq, device)
    head_dim = sizes.hidden // sizes.heads
    context = 4 * rows * sizes.seq * 8 + 2 * rows * sizes.seq * head_dim * 4 + MiB  # + small tensors
    in_flight = ws.accumulator + ws.activations + context

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), generator=generator)
    workers = workers_per_gpu(spec)
    config = roundpipe.RunConfig(
        devices=devices(spec), num_microbatches=microbatches, policy="roundpipe", partition=None, dtype="bf16"
    )
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        base_reserved = torch.cuda.memory_reserved()
    peaks, ledger_peaks, reserved, active, retries = [], [], [], [], []
    with roundpipe.wrap(model, config) as pipe:
        slack = pipe.backend.devices[0].allocation_slack()  # partly used segments per worker
        pipe.configure_optimizer(lr=1e-5)
        layer_bytes = list(pipe.store.layer_bytes)
        names = [layer.name for layer in pipe.adapter.layers]
        for _ in range(MEMORY_STEPS):
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            out = pipe.forward_backward(ids, labels=ids)
            stats = pipe.stats()["devices"]
            if gpu:
                torch.cuda.synchronize()
                peaks.append([torch.cuda.max_memory_allocated() - base])
                allocator = [torch.cuda.memory_stats()]  # the workers of a GPU share its allocator
                above = (base, base_reserved)
            else:
                peaks.append(
                    [max(d["peak_bytes"], dev.memory.peak) for d, dev in zip(stats, pipe.backend.devices)]
                )
                allocator = [dev.memory.stats() for dev in pipe.backend.devices]
                allocator = [
                    {"active_bytes.all.peak": a["active_bytes_peak"], "reserved_bytes.all.peak": a["reserved_bytes_peak"],
                     "num_alloc_retries": a["num_alloc_retries"]}
                    for a in allocator
                ]  # fmt: skip
                above = (0, 0)
            # active: allocated plus blocks freed while a stream they were handed to may still use
            # them; reserved: what the caching allocator holds from the device (the bytes that fit)
            active.append([a["active_bytes.all.peak"] - above[0] for a in allocator])
            reserved.append([a["reserved_bytes.all.peak"] - above[1] for a in allocator])
            retries.append([a.get("num_alloc_retries", 0) for a in allocator])
            ledger_peaks.append([planning_ledger(dev).peak for dev in pipe.backend.devices])
            pipe.step()
        plan_text = _runtime_plan(pipe)

    stage = max(layer_bytes)
    weights = 2 * stage
    plan = weights + ws.total + in_flight
    strict = weights + ws.total
    bound = plan * workers if gpu else plan  # a GPU's peak covers its workers; a cpu device its own
    measured = max(max(p) for p in peaks)
    reserved_bound = bound + slack * (workers if gpu else 1)

    def mib(n):
        return f"{n / MiB:.1f}"

    figures = "\n".join(
        [
            f"memory {devices(spec)} microbatches={microbatches} ({workers} worker(s), bf16, full "
            f"fine-tuning, {MEMORY_STEPS} steps, {rows} rows x {sizes.seq} tokens per microbatch, "
            f"last loss {out.loss:.3f})",
            "  layers (MiB): " + ", ".join(f"{n} {mib(b)}" for n, b in zip(names, layer_bytes)),
            f"  weights of two stages : 2 x {mib(stage)} = {mib(weights)} MiB",
            f"  working set           : forward+backward {mib(ws.forward_backward)} (measured, plain "
            f"PyTorch) + fp32 grads {mib(ws.accumulator)} + in/out {mib(ws.activations)} + workspace "
            f"{mib(ws.workspace)} = {mib(ws.total)} MiB",
            f"  in flight             : fp32 grads downloading {mib(ws.accumulator)} + next inputs "
            f"{mib(ws.activations)} + context {mib(context)} = {mib(in_flight)} MiB",
            f"  plan per worker       : {mib(plan)} MiB (strict, nothing in flight: {mib(strict)} MiB)"
            f"; bound {mib(bound)} MiB" + (f" for {workers} workers on the GPU" if gpu else " per device"),
            "  measured peak per step: "
            + "; ".join("/".join(mib(x) for x in p) for p in peaks)
            + f" MiB {'(GPU, above ' + mib(base) + ' MiB before)' if gpu else '(per device)'}",
            "  active peak per step  : " + "; ".join("/".join(mib(x) for x in p) for p in active) + " MiB",
            "  reserved peak per step: "
            + "; ".join("/".join(mib(x) for x in p) for p in reserved)
            + f" MiB (bound + allocator slack {mib(slack)} MiB per worker: {mib(reserved_bound)} MiB)",
            f"  num_alloc_retries     : {retries[-1]} (the allocator freed its cache and retried: a device sync)",
            "  ledger peak per step  : "
            + "; ".join("/".join(mib(x) for x in p) for p in ledger_peaks)
            + " MiB",
            f"  above weights + working set: {mib(measured - strict * (workers if gpu else 1))} MiB "
            f"= {(measured - strict * (workers if gpu else 1)) / ws.accumulator:.2f} x a stage's fp32 "
            "accumulator",
            f"  within plan: {measured <= bound}; within the strict plan: "
            f"{measured <= (strict * workers if gpu else strict)}",
            "  runtime's plan:\n    " + plan_text.replace("\n", "\n    "),
        ]
    )
    print("\n" + figures)
    assert measured >= stage, (
        "the peak is below one layer's weights: measured on the wrong device?\n" + figures
    )
    assert measured <= bound, figures
    assert max(max(p) for p in active) <= bound, figures
    assert max(max(p) for p in reserved) <= reserved_bound, figures
