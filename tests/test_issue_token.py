"""The issue token (roundpipe/backend/issue_token.py): on backends whose workers issue from Python
beside each other (the virtual server, CUDA), one closure is issued at a time; a closure that
waits for another thread lets it issue meanwhile; a thread waiting for its turn gives up when the
backend aborts. Without the token, eight workers on the virtual 8x RTX 4090 server handed the
interpreter lock back and forth at nearly every operation (docs/virtual.md)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from roundpipe.backend import make_backend
from roundpipe.errors import Aborted

torch.set_num_threads(1)


@pytest.fixture
def virtual2():
    backend = make_backend("virtual:2xrtx4090", sanitize=False)
    try:
        yield backend
    finally:
        backend.close()


def _issue_on(backend, index: int, fn, times: int = 1) -> threading.Thread:
    """A worker of device ``index``: issues ``fn`` on its compute stream ``times`` times."""
    stream = backend.devices[index].streams["compute"]

    def worker():
        for _ in range(times):
            stream.submit(fn, name=f"probe {index}")

    t = threading.Thread(target=worker)
    t.start()
    return t


def test_two_workers_issue_one_closure_at_a_time(virtual2):
    """Two threads issue closures on two virtual devices; each closure lets go of the interpreter
    lock for a while (as every torch operation does). No closure starts while the other is in."""
    inside, overlaps = [0], []
    lock = threading.Lock()

    def closure():
        with lock:
            inside[0] += 1
            overlaps.append(inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    threads = [_issue_on(virtual2, i, closure, times=2) for i in range(2)]
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert overlaps == [1, 1, 1, 1], f"closures issued at once: {overlaps}"


def test_a_closure_that_waits_lets_the_other_worker_issue(virtual2):
    """A closure on device 0 waits (``Device.waiting``) for what a closure on device 1 does: the
    token is free meanwhile, so both finish (a token held through the wait would never let the
    second closure in)."""
    done = threading.Event()

    def waiter():
        with virtual2.devices[0].waiting():
            assert done.wait(10), "the other closure never ran: the wait kept the turn to issue"

    first = _issue_on(virtual2, 0, waiter)
    time.sleep(0.05)
    second = _issue_on(virtual2, 1, done.set)
    for t in (first, second):
        t.join(15)
    assert done.is_set() and not first.is_alive() and not second.is_alive()
    assert virtual2.errors == []


def test_a_thread_waiting_for_its_turn_gives_up_when_the_backend_aborts(virtual2):
    """A closure stalls holding the token; another thread waits for its turn; an abort ends that
    wait with ``Aborted`` (the stream's error, not a failure of its own), not a hang."""
    release = threading.Event()

    def stall():
        release.wait(10)

    first = _issue_on(virtual2, 0, stall)
    time.sleep(0.05)
    ran = threading.Event()
    second = _issue_on(virtual2, 1, ran.set)
    time.sleep(0.1)
    assert not ran.is_set()
    virtual2.abort()
    second.join(5)
    assert not second.is_alive() and not ran.is_set()
    poisoned = virtual2.devices[1].streams["compute"]._error  # what a wait on the stream raises
    assert isinstance(poisoned, Aborted) or isinstance(poisoned.__cause__, Aborted), repr(poisoned)
    release.set()
    first.join(5)


def test_the_cpu_backend_has_no_token():
    """The cpu backend keeps its per-device issue gate and no process-wide turn: its stream threads
    run real kernels, and its tests measure overlap between devices."""
    backend = make_backend("cpu:2", sanitize=False)
    try:
        assert not backend.issue_token.enabled
    finally:
        backend.close()
