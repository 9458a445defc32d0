"""Many stateless workers: every policy x devices x microbatches, orders, irregular tables, the
asynchronous optimizer, memory behaviour and what a run reports about itself."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.gpu_check_support import policy_accepts
from support.memory_oracle import hand_offs_in_flight, microbatches_of, working_set
from support.reference import (
    assert_same_run,
    pipeline_train,
    reference_train,
    reference_train_one_step_stale,
)
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import ConfigError, ScheduleError
from roundpipe.schedule import Partition, ScheduleTable, build_table
from roundpipe.schedule.deps import TASK_KINDS
from roundpipe.schedule.flow import FUSED

torch.set_num_threads(1)

STEPS = 2  # the second step runs on weights the first one updated
NUM_LAYERS = 8  # embed + 6 blocks + head: enough stages for hanayo / interleaved on 4 devices
_refs: dict = {}


def _reference(lora):
    if lora not in _refs:
        model = make_model("qwen3", num_layers=NUM_LAYERS - 2, tied=True, lora=lora)
        batch = make_batch(batch=8, padding="left")
        _refs[lora] = (model, batch, reference_train(model, batch, STEPS))
    return _refs[lora]


def _matrix():
    """Every (policy, devices, microbatches) the policy accepts; LoRA/full x strict/ready rotate
    over the grid so each policy meets all four combinations without running 4x the cases. Eight
    microbatches run with the slow tests (CI runs them) except RoundPipe's on four devices, the
    longest pipeline: ``make test`` keeps that and every other count on every device number."""
    variants = itertools.cycle(
        [(None, "strict"), ("default", "ready"), ("default", "strict"), (None, "ready")]
    )
    cases = []
    for policy in ("roundpipe", "gpipe", "1f1b", "interleaved", "chimera", "hanayo"):
        for devices in (1, 2, 3, 4):
            for microbatches in (1, 2, 4, 8):
                lora, order = next(variants)
                cases.append(
                    pytest.param(
                        policy,
                        devices,
                        microbatches,
                        lora,
                        order,
                        id=f"{policy}-d{devices}-m{microbatches}-{lora or 'full'}-{order}",
                        marks=(pytest.mark.slow,)
                        if microbatches == 8 and (devices < 4 or policy != "roundpipe")
                        else (),
                    )
                )
    return cases


@pytest.mark.parametrize(("policy", "devices", "microbatches", "lora", "order"), _matrix())
def test_every_policy_trains_like_plain_pytorch(policy, devices, microbatches, lora, order):
    if not policy_accepts(policy, devices, microbatches):
        with pytest.raises((ScheduleError, ConfigError)):
            model, batch, _ = _reference(lora)
            pipeline_train(
                model, batch, 1, devices=f"cpu:{devices}", num_microbatches=microbatches, policy=policy,
                partition=None,
            )  # fmt: skip
        return
    model, batch, want = _reference(lora)
    got = pipeline_train(
        model,
        batch,
        STEPS,
        devices=f"cpu:{devices}",
        num_microbatches=microbatches,
        policy=policy,
        order=order,
        partition=None,  # the policy's own default stages: the table under test
    )
    assert_same_run(got, want)


def test_asymmetric_partitions_with_smaller_backward_stages():
    model, batch, want = _reference(None)
    got = pipeline_train(
        model,
        batch,
        STEPS,
        devices="cpu:3",
        num_microbatches=4,
        partition=(3, 3, 2),
        backward_partition=(2, 1, 2, 1, 2),
    )
    assert_same_run(got, want)


def test_a_partition_that_misses_layers_is_rejected():
    model, batch, _ = _reference(None)
    with pytest.raises(ConfigError, match=r"partition=\(3, 3\) covers 6 layers but the model has 8"):
        pipeline_train(model, batch, 1, devices="cpu:2", num_microbatches=2, partition=(3, 3))


def test_a_policy_the_runtime_cannot_run_says_so():
    with pytest.raises(ConfigError, match="'zb' cannot run yet"):
        roundpipe.RunConfig(policy="zb")


def test_too_many_stages_for_the_model_is_a_config_error():
    model = make_model("llama", num_layers=2)  # 4 layers: embed, 2 blocks, head
    with (
        roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:3", policy="interleaved")) as pipe,
        pytest.raises(ConfigError, match="needs 6 stages but the model has only 4 layers"),
    ):
        pipe.forward_backward(make_batch(batch=2)["input_ids"], labels=make_batch(batch=2)["labels"])


# ----------------------------------------------------------------------------- hand-written tables
def _irregular_table() -> ScheduleTable:
    """Two devices, four stages, two microbatches, dealt by hand in an order no policy produces:
    device 1 lists a backward before the forward it waits on from device 0."""
    part = Partition.from_sizes([2, 2, 2, 2])
    text = """
    d0: F0.0 F0.1 F2.0 F2.1 B1.1 B1.0 B0.0 B0.1
    d1: B2.1 F1.0 F1.1 F3.1 B3.1 F3.0 B3.0 B2.0
    """
    return ScheduleTable.from_text(text, part, part, 2)


def test_an_irregular_hand_written_table_runs_ready_first_and_matches():
    model, batch, want = _reference(None)
    table = _irregular_table()
    got = pipeline_train(
        model, batch, STEPS, devices="cpu:2", num_microbatches=2, schedule=table, order="ready"
    )
    assert_same_run(got, want)


def test_the_same_table_in_strict_order_is_rejected_with_the_waiting_cycle():
    model, batch, _ = _reference(None)
    with pytest.raises(ScheduleError, match="waiting cycle"):
        pipeline_train(model, batch, 1, devices="cpu:2", num_microbatches=2, schedule=_irregular_table())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    devices=st.integers(1, 3),
    policy=st.sampled_from(["roundpipe", "1f1b", "gpipe"]),
)
def test_ready_order_completes_any_shuffle_of_a_valid_table(seed, devices, policy):
    """Shuffling each device's list keeps the dependency graph acyclic, so ready-first must finish."""
    model, batch, want = _reference(None)
    stages = NUM_LAYERS if policy == "roundpipe" else devices
    part = Partition.from_sizes(
        [NUM_LAYERS // stages + (1 if i < NUM_LAYERS % stages else 0) for i in range(stages)]
    )
    base = build_table(policy, part, part, devices, 2)
    rng = random.Random(seed)
    rows = [list(r) for r in base.devices]
    for r in rows:
        rng.shuffle(r)
    table = ScheduleTable(tuple(tuple(r) for r in rows), part, part, 2, policy="shuffled")
    got = pipeline_train(
        model, batch, 1, devices=f"cpu:{devices}", num_microbatches=2, schedule=table, order="ready"
    )
    assert got.losses[0] == pytest.approx(want.losses[0], rel=1e-5)


@pytest.mark.parametrize("head_shards", [1, 3])
def test_a_microbatch_without_any_label_adds_nothing_and_breaks_nothing(head_shards):
    """The head gathers no row for it: an empty chunk loop, a zero loss and zero gradients."""
    model = make_model("llama")
    batch = make_batch(batch=4)
    batch["labels"][:2] = -100  # microbatch 0 (samples 0 and 1) has no label at all
    want = reference_train(model, batch, 2)
    got = pipeline_train(model, batch, 2, devices="cpu:2", num_microbatches=2, head_shards=head_shards)
    assert_same_run(got, want)


@pytest.mark.slow
def test_a_prefetched_layer_released_unused_waits_for_its_upload(monkeypatch):
    """Under ready order the task that runs next need not be the one whose layers were prefetched;
    releasing such a layer must wait for its (slowed) upload instead of freeing it mid-copy."""
    from roundpipe.backend.base import Device

    slow_copy = Device.copy_in

    def copy_in(self, dst, src):
        time.sleep(0.002)
        slow_copy(self, dst, src)

    monkeypatch.setattr(Device, "copy_in", copy_in)
    model, batch, want = _reference(None)
    part = Partition.per_layer(NUM_LAYERS)
    rows = [list(r) for r in build_table("roundpipe", part, part, 1, 2).devices]
    for seed in range(6):
        shuffled = [r[:] for r in rows]
        for r in shuffled:
            random.Random(seed).shuffle(r)
        table = ScheduleTable(tuple(tuple(r) for r in shuffled), part, part, 2, policy="shuffled")
        got = pipeline_train(
            model, batch, 1, devices="cpu:1", num_microbatches=2, schedule=table, order="ready"
        )
        assert got.losses[0] == pytest.approx(want.losses[0], rel=1e-5)


# ----------------------------------------------------------------------------- async optimizer
@pytest.mark.parametrize("devices", ["cpu:1", pytest.param("cpu:3", marks=pytest.mark.slow)])
def test_async_optimizer_equals_plain_pytorch_with_a_one_step_delay(devices):
    model, batch, _ = _reference(None)
    want = reference_train_one_step_stale(model, batch, 5)
    got = pipeline_train(model, batch, 5, devices=devices, num_microbatches=4, optimizer_mode="async")
    assert_same_run(got, want)


# ----------------------------------------------------------------------------- memory
def _peaks(policy, microbatches, devices="cpu:2"):
    model, batch, _ = _reference(None)
    batch = make_batch(batch=8)
    config = roundpipe.RunConfig(
        devices=devices, num_microbatches=microbatches, policy=policy, partition=None
    )
    with roundpipe.wrap(model, config) as pipe:  # the policy's default stages (roundpipe: one layer each)
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        stats = pipe.stats()
        largest = sorted(pipe.store.layer_bytes)
    # What the live tensors asked for (the caching allocator rounds each up to 512 bytes, as CUDA's
    # does; the oracles count the tensors' own bytes).
    peak = max(d["allocator"]["requested_bytes_peak"] for d in stats["devices"])
    return peak, stats["host_handoff_peak_bytes"], largest


@pytest.mark.slow
def test_roundpipe_device_memory_does_not_grow_with_microbatches():
    """What is alive on a worker: two stages' weights (current + prefetched), one microbatch's
    working set (measured in plain PyTorch, its stage's fp32 gradient accumulator included), the
    next task's incoming hand-offs and at most one earlier stage's fp32 gradients still on their
    way down (the runtime allows one: docs/design.md §5). None of it depends on the number of
    microbatches."""
    model, _, _ = _reference(None)
    batch = make_batch(batch=8)
    for microbatches in (2, 4, 8):
        peak, _, layer_bytes = _peaks("roundpipe", microbatches)
        split = microbatches_of(batch, microbatches)
        need = working_set(model, split) + hand_offs_in_flight(model, split)
        downloading = layer_bytes[-1]  # fp32 full fine-tuning: a stage's gradients = its weights
        assert peak <= 2 * layer_bytes[-1] + need + downloading, microbatches


@pytest.mark.slow
def test_gpipe_keeps_every_microbatch_while_1f1b_keeps_only_the_pipeline_depth():
    """What the CPU holds between stages (hand-offs), on 2 devices with a batch of 8 samples.

    One sample's activation at a stage boundary is 12 tokens x 64 hidden x 4 bytes. GPipe runs every
    forward before any backward, so it holds one boundary activation for every microbatch: the whole
    batch, however it is cut. 1F1B keeps at most as many microbatches in flight as there are
    devices, so what it holds shrinks with the microbatch.
    """
    sample = 12 * 64 * 4
    for microbatches in (4, 8):
        per_microbatch = sample * 8 // microbatches
        _, gpipe, _ = _peaks("gpipe", microbatches)
        _, one_f_one_b, _ = _peaks("1f1b", microbatches)
        assert gpipe == microbatches * per_microbatch == 8 * sample
        assert one_f_one_b <= 2 * per_microbatch


# ----------------------------------------------------------------------------- reporting
def test_stats_and_timeline_describe_the_last_step():
    model, batch, _ = _reference(None)
    with roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=4)) as pipe:
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        stats = pipe.stats()
        timeline = pipe.last_timeline()
        flows = pipe.last_plan.flows
    assert stats["step_s"] > 0
    for d in stats["devices"]:
        assert 0 < d["busy_s"] <= stats["step_s"]
        assert d["busy_s"] + d["idle_s"] == pytest.approx(stats["step_s"])
        assert d["bytes_to_device"] > 0 and d["bytes_to_host"] > 0
    # One compute span per task with layers to run (a fused last F and B is one task): which plan
    # the automatic choice takes (GPipe, Hanayo and Chimera have tasks with no layers to run)
    # depends on the measured times.
    compute = [s.name for s in timeline.spans if s.lane == "compute" and s.kind in (*TASK_KINDS, FUSED)]
    issued = [
        f"{f.task}" + (f"+{f.fused_with}" if f.fused_with else "")
        for row in flows
        for f in row
        if len(f.layers)
    ]
    assert sorted(compute) == sorted(issued)
    assert all(s.end >= s.start >= 0 for s in timeline.spans)
    assert {s.lane for s in timeline.spans} >= {"compute", "h2d", "d2h", "host"}


# ----------------------------------------------------------------------------- sharded head
@pytest.mark.parametrize(
    ("family", "tied", "lora", "shards", "devices"),
    [
        ("llama", False, None, 3, "cpu:2"),
        ("qwen3", True, None, 2, "cpu:3"),
        ("gemma2", True, "default", 5, "cpu:2"),
    ],
)
def test_a_sharded_chunked_head_trains_like_the_unsharded_plain_model(family, tied, lora, shards, devices):
    model = make_model(family, tied=tied, lora=lora)
    batch = make_batch(batch=6, padding="right")
    want = reference_train(model, batch, STEPS)
    got = pipeline_train(
        model, batch, STEPS, devices=devices, num_microbatches=3, head_shards=shards, head_chunk_tokens=5
    )
    assert_same_run(got, want)


def test_an_activation_upload_passes_a_large_weight_upload_in_flight():
    """On the cpu backend every stream has its own thread: a small activation issued on ``h2d``
    after a big weight upload on ``h2d_weights`` arrives while the weights are still copying. (A CUDA
    copy engine runs copies in issue order whatever the streams' priorities; what lets activations
    pass there is the order the worker issues weight chunks in, tests/test_paced_copies.py.)"""
    from roundpipe.backend import make_backend

    backend = make_backend("cpu:1")
    try:
        dev = backend.devices[0]
        big = torch.randn(4096, 4096)  # 64 MiB of weights
        small = torch.randn(4, 64)
        weights, acts = dev.streams["h2d_weights"], dev.streams["h2d"]
        held = {}

        def allocate():
            held["dst"] = dev.empty(big.shape, big.dtype)
            dev.ledger.reserve(held["dst"], "weights", "weights")

        weights.submit(allocate)
        for a in range(0, 4096, 256):  # 16 chunks of 4 MiB, as the worker cuts them
            weights.submit(lambda a=a: dev.copy_in(held["dst"][a : a + 256], big[a : a + 256]))
        weights_done = weights.record_event()

        def upload():
            held["act"] = dev.to_device(small)
            dev.ledger.reserve(held["act"], "act", "activations")

        acts.submit(upload)
        act_done = acts.record_event()
        act_done.synchronize()
        assert not weights_done.query()  # the activation passed the weights still in flight
        weights_done.synchronize()
        held.clear()
    finally:
        backend.close()


@pytest.mark.slow
def test_weights_cut_into_small_chunks_train_the_same():
    model, batch, want = _reference("default")
    got = pipeline_train(model, batch, STEPS, devices="cpu:2", num_microbatches=4, copy_chunk_bytes=1000)
    assert_same_run(got, want)
