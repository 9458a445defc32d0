"""The host thread's intra-op threads: the CPU optimizer's jobs run with ``host_threads`` threads
(default: the usable cores less one per worker device), while worker and cpu-backend stream threads
keep one each, whatever order the threads set theirs in."""

from __future__ import annotations

import threading

import pytest
import torch
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.backend.threads import own_intra_op_threads
from roundpipe.errors import ConfigError
from roundpipe.runtime import hostqueue
from roundpipe.runtime.hostqueue import HostQueue, default_host_threads, usable_cores
from roundpipe.runtime.optimizer_steps import OptimizerSteps

torch.set_num_threads(1)

FIXED = {"devices": "cpu:2", "policy": "roundpipe", "partition": None, "num_microbatches": 2}
OPENMP = "OpenMP" in torch.__config__.parallel_info()


def _threads_after_another_sets(own) -> int:
    """The intra-op threads a thread runs its first kernel with, when it set 1 (``own``) and then
    another thread set 2."""
    seen: list[int] = []
    mine_set, other_set = threading.Event(), threading.Event()

    def first():
        own(1)
        mine_set.set()
        other_set.wait()
        torch.ones(8).add(1)  # a first parallel kernel
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=first)
    t.start()
    mine_set.wait()
    other = threading.Thread(target=lambda: torch.set_num_threads(2))
    other.start()
    other.join()
    other_set.set()
    t.join()
    torch.set_num_threads(1)  # this process's default again
    return seen[0]


@pytest.mark.skipif(not OPENMP, reason="the finding is about torch's OpenMP build")
def test_a_threads_own_count_survives_another_thread_setting_its_own_later():
    # torch alone: the count set before the thread's first kernel is replaced by the process
    # default then (what backend/threads.py's docstring records) ...
    assert _threads_after_another_sets(torch.set_num_threads) == 2
    # ... so a thread initialises first and then sets, and keeps its count.
    assert _threads_after_another_sets(own_intra_op_threads) == 1


def test_jobs_on_the_host_queue_run_with_its_thread_count():
    q = HostQueue(threads=3)
    seen: list[int] = []
    q.submit(lambda: seen.append(torch.get_num_threads()))
    q.drain()
    q.close()
    assert seen == [3]


def test_the_default_is_the_usable_cores_less_one_per_worker_at_least_one(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_host_threads(2, cores=16) == 14
    assert default_host_threads(4, cores=4) == 1
    assert default_host_threads(1, cores=1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this node share its cores
    assert default_host_threads(2, cores=16) == 6
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_host_threads(2) == max(1, usable_cores() - 2)


def _optimizer_threads(monkeypatch, config: roundpipe.RunConfig) -> set[tuple[str, int]]:
    """(thread name, intra-op threads) of every layer step of one eager training step."""
    seen: set[tuple[str, int]] = set()
    step_group = OptimizerSteps.step_group

    def recording(self, *args, **kwargs):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return step_group(self, *args, **kwargs)

    monkeypatch.setattr(OptimizerSteps, "step_group", recording)
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), config) as pipe:
        pipe.configure_optimizer(lr=1e-3)
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
        pipe.step()
    return seen


def test_the_optimizer_steps_layers_with_host_threads(monkeypatch):
    seen = _optimizer_threads(monkeypatch, roundpipe.RunConfig(**FIXED, host_threads=2))
    assert seen == {("roundpipe-host", 2)}


def test_without_host_threads_the_optimizer_takes_the_default(monkeypatch):
    monkeypatch.setattr(hostqueue, "usable_cores", lambda: 5)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    seen = _optimizer_threads(monkeypatch, roundpipe.RunConfig(**FIXED))
    assert seen == {("roundpipe-host", 3)}  # 5 cores less one per worker (cpu:2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True])
def test_host_threads_must_be_a_positive_count(bad):
    with pytest.raises(ConfigError, match="host_threads must be a positive int or None"):
        roundpipe.RunConfig(host_threads=bad)
