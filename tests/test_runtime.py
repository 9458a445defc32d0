"""Runtime behaviour beyond numerics: memory residency, bad input, faults."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.memory_oracle import (
    device_of,
    gradients_downloading,
    hand_offs_in_flight,
    microbatches_of,
    working_set,
)
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.errors import (
    ConfigError,
    DeviceOutOfMemory,
    DeviceSpecError,
    InputError,
    OptimizerError,
    PipelineStateError,
    StageError,
    UnsupportedModel,
)

torch.set_num_threads(1)

# These tests are about what a worker holds and where a stage runs under roundpipe's deal of one
# layer per stage, so they name it instead of letting the automatic choice pick a plan.
ONE_LAYER_PER_STAGE = {"policy": "roundpipe", "partition": None}


def _fb(pipe, batch):
    return pipe.forward_backward(
        batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
    )


def _weights_at_marks(trace):
    """``(mark, names of the layers whose weights are placed)`` at each task's mark of a ledger trace."""
    resident: set[str] = set()
    for op, what, _nbytes, _in_use in trace:
        if what.startswith("weights:"):
            (resident.add if op == "reserve" else resident.discard)(what.removeprefix("weights:"))
        elif op == "mark":
            yield what, resident


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("microbatches", [1, 4])
def test_a_worker_holds_only_the_running_layer_and_the_prefetched_one(microbatches):
    model = make_model("llama", num_layers=3)
    batch = make_batch(batch=4)
    with roundpipe.wrap(
        model, roundpipe.RunConfig(devices="cpu:1", num_microbatches=microbatches, **ONE_LAYER_PER_STAGE)
    ) as pipe:
        ledger = pipe.backend.devices[0].ledger
        ledger.trace = []
        _fb(pipe, batch)
        flows = pipe.last_plan.flows[0]
        names = [layer.name for layer in pipe.adapter.layers]
        k = 0
        for what, resident in _weights_at_marks(ledger.trace):
            flow = flows[k]
            following = next((f.layers for f in flows[k + 1 :] if f.layers != flow.layers), range(0))
            allowed = {names[i] for i in [*flow.layers, *following]}
            assert {names[i] for i in flow.layers} <= resident, f"{what}: weights not resident"
            assert resident <= allowed, (
                f"{what}: holds {sorted(resident - allowed)} besides the current and next layer"
            )
            k += 1
        assert k == len(flows)
        assert ledger.in_use == 0, "everything placed on the device was released"
        largest_two = sum(sorted(pipe.store.layer_bytes)[-2:])
        assert ledger.by_tag.get("weights", 0) == 0
        assert ledger.peak >= max(pipe.store.layer_bytes)
        assert ledger.peak < largest_two + 2_000_000  # weights of two layers + one microbatch's activations


@pytest.mark.parametrize("backward", [(3, 3), (2, 4)])
def test_the_next_stages_weights_are_uploaded_while_the_current_one_runs(backward):
    """Prefetch looks past the tasks that run no layer of their own (a last forward stage that the
    first backward stage recomputes whole): at every task, the weights of the next stage that runs layers are
    already placed on the device. Missed, a stage's whole upload waited for the stage before it to
    finish (Llama-3.1-8B on a virtual RTX 4090: two gaps of 130-150 ms in a 2.2 s step)."""
    model = make_model("llama", num_layers=4)
    with roundpipe.wrap(
        model,
        roundpipe.RunConfig(
            devices="cpu:1",
            num_microbatches=2,
            policy="roundpipe",
            partition=(4, 2),
            backward_partition=backward,
        ),
    ) as pipe:
        ledger = pipe.backend.devices[0].ledger
        ledger.trace = []
        _fb(pipe, make_batch(batch=4))
        flows = pipe.last_plan.flows[0]
        assert any(not f.layers for f in flows)  # the case this test is about: F1 runs no layer
        names = [layer.name for layer in pipe.adapter.layers]
        position = {f"compute {f.task}": k for k, f in enumerate(flows)}
        marks = 0
        for what, resident in _weights_at_marks(ledger.trace):
            k = position[what]  # a task that runs no layer computes nothing: no mark
            following = next(
                (f.layers for f in flows[k + 1 :] if f.layers and f.layers != flows[k].layers), None
            )
            if following is not None:
                missing = {names[i] for i in following} - resident
                assert not missing, f"{what}: the next stage's {sorted(missing)} not uploading yet"
            marks += 1
        assert marks == sum(1 for f in flows if f.layers)


def test_a_device_as_small_as_two_layers_plus_one_working_set_still_trains():
    """Capacity counts what is really alive (temporaries included): two layers' weights, what one
    microbatch needs in plain PyTorch, the next task's incoming hand-offs and the previous stage's
    fp32 gradients still on their way down are enough."""
    model = make_model("qwen3", num_layers=3)
    batch = make_batch(batch=4)
    probe = roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1"))
    split = microbatches_of(batch, 2)
    downloading = gradients_downloading(probe.store)
    need = (
        sum(sorted(probe.store.layer_bytes)[-2:])
        + downloading
        + working_set(model, split)
        + hand_offs_in_flight(model, split)
    )
    probe.close()
    with roundpipe.wrap(
        model,
        roundpipe.RunConfig(
            devices="cpu:2", num_microbatches=2, device_capacity=device_of(need), **ONE_LAYER_PER_STAGE
        ),
    ) as pipe:
        out = _fb(pipe, batch)
        assert out.loss > 0
        assert all(d.memory.peak <= need for d in pipe.backend.devices)


def test_capacity_smaller_than_the_largest_layer_names_the_layer_and_bytes():
    model = make_model("llama")
    with pytest.raises(DeviceOutOfMemory) as info:
        roundpipe.wrap(model, roundpipe.RunConfig(devices="cpu:1", device_capacity=40_000))
    msg = str(info.value)
    assert "embed" in msg or "head" in msg
    assert "65,536" in msg  # the 256 x 64 fp32 embedding
    assert info.value.nbytes == 65_536


# ----------------------------------------------------------------------------- bad input
def test_a_model_that_is_not_a_causal_lm_is_rejected():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(UnsupportedModel, match="LlamaModel has no LM head"):
        roundpipe.wrap(transformers.LlamaModel(config), roundpipe.RunConfig(devices="cpu:1"))


@pytest.fixture(scope="module")
def pipe():
    p = roundpipe.wrap(
        make_model("llama"), roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, **ONE_LAYER_PER_STAGE)
    )
    yield p
    p.close()


def test_the_head_gets_logits_only_for_tokens_with_a_label(pipe, monkeypatch):
    import roundpipe.models.adapter as adapter_module

    seen = []
    original = adapter_module.chunked_lm_loss

    def recording(hidden, shift_labels, lm_head, **kwargs):
        seen.append(kwargs["positions"].numel())  # a count: holding the device tensor would leak it
        return original(hidden, shift_labels, lm_head, **kwargs)

    monkeypatch.setattr(adapter_module, "chunked_lm_loss", recording)
    batch = make_batch(batch=8)
    _fb(pipe, batch)
    assert len(seen) == 4  # one head run per microbatch, each with its label positions
    assert sum(seen) == int((batch["labels"][:, 1:] != -100).sum())


def test_more_microbatches_than_samples_is_an_input_error(pipe):
    batch = make_batch(batch=3)
    with pytest.raises(InputError, match="num_microbatches=4 is larger than the batch"):
        _fb(pipe, batch)


def test_labels_of_the_wrong_shape_are_an_input_error(pipe):
    batch = make_batch(batch=4)
    with pytest.raises(InputError, match="labels must have the shape"):
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"][:, :-1])


def test_all_labels_ignored_is_an_input_error(pipe):
    batch = make_batch(batch=4)
    with pytest.raises(InputError, match="every label is -100"):
        pipe.forward_backward(batch["input_ids"], labels=torch.full_like(batch["labels"], -100))


def test_token_ids_outside_the_vocabulary_are_an_input_error(pipe):
    batch = make_batch(batch=4)
    with pytest.raises(InputError, match="vocab_size"):
        pipe.forward_backward(batch["input_ids"] + 1000, labels=batch["labels"])


def test_step_without_optimizer_or_gradients_is_a_state_error(pipe):
    with pytest.raises(PipelineStateError, match="configure_optimizer"):
        pipe.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
        ({"policy": "zigzag"}, "unknown policy 'zigzag'"),
        ({"num_microbatches": 0}, "num_microbatches must be a positive int"),
    ],
)
def test_bad_run_config_is_a_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        roundpipe.RunConfig(**kwargs)


@pytest.mark.parametrize("spec", ["gpu:1", "cpu:0", "cpu:two", "cuda:a"])
def test_malformed_device_spec_is_rejected(spec):
    with pytest.raises(DeviceSpecError):
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices=spec))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_says_to_use_cpu():
    with pytest.raises(DeviceSpecError, match="no CUDA device"):
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cuda:0"))


def test_optimizer_settings_are_validated(pipe):
    with pytest.raises(ConfigError, match="betas"):
        pipe.configure_optimizer(betas=(0.9, 1.5))


# ----------------------------------------------------------------------------- faults
def _threads_of(pipe) -> list[str]:
    """Threads of this pipeline's backend and host queue still alive."""
    mine = [s._thread for d in pipe.backend.devices for s in d.streams.values()] + [pipe._hostq._thread]
    return [t.name for t in mine if t.is_alive()]


def _roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-worker")]


def test_an_error_inside_a_layer_reaches_the_caller_with_where_it_happened():
    model = make_model("llama", num_layers=3)
    calls = []

    def explode(module, args, output):
        calls.append(1)
        if len(calls) == 3:  # third microbatch through layers.1, once
            raise RuntimeError("boom")

    batch = make_batch(batch=4)
    with roundpipe.wrap(
        model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=4, **ONE_LAYER_PER_STAGE)
    ) as pipe:
        model.model.layers[1].register_forward_hook(explode)  # after the wrap-time probe ran it
        t0 = time.monotonic()
        with pytest.raises(StageError) as info:
            _fb(pipe, batch)
        assert time.monotonic() - t0 < 5
        err = info.value
        assert (err.stage, err.layer, err.microbatch) == (2, "layers.1", 2)
        assert err.device == "cpu:0"  # stage 2 of 5 dealt round-robin to 2 devices
        assert "boom" in str(err) and isinstance(err.__cause__, RuntimeError)
        assert _roundpipe_threads() == []
        # The pipeline recovers: the hook has fired its one fault, and the same batch trains.
        assert _fb(pipe, batch).loss > 0
    assert _threads_of(pipe) == []


def test_an_error_in_a_copy_reaches_the_caller_with_its_traceback(monkeypatch):
    from roundpipe.backend.base import Device

    def broken(self, dst, src):
        raise RuntimeError("the copy engine broke")

    monkeypatch.setattr(Device, "copy_in", broken)
    batch = make_batch(batch=4)
    with (
        roundpipe.wrap(make_model("llama"), roundpipe.RunConfig(devices="cpu:1")) as pipe,
        pytest.raises(StageError, match="the copy engine broke") as info,
    ):
        _fb(pipe, batch)
    causes, e = [], info.value
    while e is not None:
        causes.append(e)
        e = e.__cause__
    assert any(isinstance(c, RuntimeError) and c.__traceback__ is not None for c in causes[1:])


def test_an_optimizer_error_names_the_layer():
    with roundpipe.wrap(
        make_model("llama"), roundpipe.RunConfig(devices="cpu:1", num_microbatches=2)
    ) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        last = max(pipe._optimizer.optimizers)

        def broken_step(*a, **k):
            raise RuntimeError("optimizer exploded")

        pipe._optimizer.optimizers[last].step = broken_step
        with pytest.raises(OptimizerError, match="optimizer exploded") as info:
            _fb(pipe, make_batch(batch=4))
        assert info.value.layer == pipe.adapter.layers[last].name
    assert _threads_of(pipe) == []


# ----------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_resumes_training_exactly():
    import copy

    model = make_model("llama", lora="default")
    batch = make_batch(batch=4)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, **ONE_LAYER_PER_STAGE)

    def train(pipe, steps):
        return [(_fb(pipe, batch).loss, pipe.step())[0] for _ in range(steps)]

    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        pipe.configure_optimizer(lr=1e-2)
        straight = train(pipe, 4)
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        pipe.configure_optimizer(lr=1e-2)
        first = train(pipe, 2)
        checkpoint = pipe.state_dict()
    with roundpipe.wrap(copy.deepcopy(model), config) as pipe:
        pipe.configure_optimizer(lr=1e-2)
        pipe.load_state_dict(checkpoint)
        resumed = first + train(pipe, 2)
    assert resumed == pytest.approx(straight, rel=1e-6)


def test_a_stalled_step_becomes_a_watchdog_error_naming_what_each_worker_waits_for():
    from roundpipe.errors import WatchdogTimeout

    model = make_model("llama", num_layers=2)
    stalled = []

    def stall(module, args, output):
        if not stalled:
            stalled.append(1)
            time.sleep(3.0)  # a forward that hangs while it is issued, as a stuck hook would on CUDA

    batch = make_batch(batch=4)
    with roundpipe.wrap(
        model, roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, watchdog_s=1.0, **ONE_LAYER_PER_STAGE)
    ) as pipe:
        model.model.layers[0].register_forward_hook(stall)  # after the wrap-time probe ran it
        t0 = time.monotonic()
        with pytest.raises(WatchdogTimeout) as info:
            _fb(pipe, batch)
        assert time.monotonic() - t0 < 5
        msg = str(info.value)
        assert "no progress for 1s" in msg and "cpu:0:" in msg and "cpu:1:" in msg
        assert "compute issuing F1.0" in msg  # the stalled task (layers.0 is stage 1), on cpu:1
        assert "waiting for act[2]" in msg  # and the worker that depends on it says so
        assert _fb(pipe, batch).loss > 0  # and the pipeline recovers


def test_the_watchdogs_progress_poll_queries_each_finished_task_once():
    """The watchdog polls every 2 ms: a poll that queried every compute event of the step would
    cost the host time quadratic in its tasks (about 1.6k tasks per step on 8 GPUs). Compute events
    happen in issue order (one compute stream), so each poll starts where the last one stopped."""

    class Event:
        def __init__(self, done):
            self.done, self.queries = done, 0

        def query(self):
            self.queries += 1
            return self.done

    with roundpipe.wrap(
        make_model("llama"), roundpipe.RunConfig(devices="cpu:1", num_microbatches=2)
    ) as pipe:
        worker = pipe.workers[0]
        events = [Event(True) for _ in range(40)] + [Event(False) for _ in range(10)]
        worker._computed = events
        for _ in range(20):
            assert worker.progress() == 40
        events[40].done = True
        assert worker.progress() == 41
        assert sum(e.queries for e in events) <= 40 + 21 + 2  # each finished one once, the next per poll
        worker._computed = [Event(True)]  # a new step's list starts from its first event
        assert worker.progress() == 1
