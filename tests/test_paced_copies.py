"""Bulk copies are paced so that urgent copies pass them (runtime/paced_copies.py).

A copy engine runs copies in the order they were issued, whatever the streams' priorities, so the
order in which the worker *issues* copies is what decides whether an activation copy waits behind a
stage's weights or gradients. These tests read that issue order: first of the queue itself on a
stream that only records, then of a whole roundpipe step on the cpu backend, where every closure
given to a stream is logged as it is issued (as on CUDA, issue order is host order).
"""

from __future__ import annotations

import torch
from support.reference import assert_same_run, pipeline_train, reference_train
from support.tiny_models import make_batch, make_model

import roundpipe
from roundpipe.runtime.paced_copies import PacedCopies

torch.set_num_threads(1)


class _Recorder:
    """A stream that records what is issued to it: ``("wait", e)``, ``("chunk", label)``, ``("event", n)``."""

    def __init__(self):
        self.log: list[tuple] = []

    def wait_event(self, event):
        self.log.append(("wait", event))

    def submit(self, fn, label=None, name=None):
        fn()
        self.log.append(("chunk", label))

    def record_event(self):
        self.log.append(("event", len(self.log)))
        return self.log[-1]


def _group(copies: PacedCopies, name: str, n: int, done: dict):
    chunks = [(lambda: None, (name, str(i))) for i in range(n)]
    return copies.add([f"after:{name}"], chunks, lambda event: done.setdefault(name, event))


def test_pacing_spreads_the_queued_chunks_over_the_turns_left_and_issues_in_order():
    stream, done = _Recorder(), {}
    copies = PacedCopies(stream)
    _group(copies, "a", 5, done)
    _group(copies, "b", 2, done)
    copies.pace(3)  # 7 chunks over 3 turns: 3 now
    assert [e[1] for e in stream.log if e[0] == "chunk"] == [("a", "0"), ("a", "1"), ("a", "2")]
    assert stream.log[0] == ("wait", "after:a")  # the group's waits go before its first chunk
    assert done == {} and copies.pending == 4
    copies.pace(2)  # 4 over 2 turns: 2 now, and a's last chunk records its event
    assert "a" in done and "b" not in done and copies.pending == 2
    assert ("wait", "after:b") not in stream.log  # b's waits go with its first chunk
    copies.pace(1)
    assert stream.log.index(("wait", "after:b")) > stream.log.index(done["a"]) and "b" in done


def test_finishing_a_group_issues_it_and_every_group_before_it_and_an_empty_group_still_fires():
    stream, done = _Recorder(), {}
    copies = PacedCopies(stream)
    _group(copies, "a", 2, done)
    empty = _group(copies, "empty", 0, done)
    last = _group(copies, "c", 3, done)
    copies.finish(empty)
    assert set(done) == {"a", "empty"} and copies.pending == 3
    copies.finish(last)
    assert set(done) == {"a", "empty", "c"} and copies.pending == 0
    copies.finish(last)  # issued already: nothing more
    assert sum(e[0] == "chunk" for e in stream.log) == 5


def _issue_log(pipe) -> dict[int, list[tuple[str, str, str]]]:
    """Per device, ``(stream, name, kind)`` of every labelled closure in the order it is issued."""
    logs: dict[int, list] = {}
    for d, dev in enumerate(pipe.backend.devices):
        log = logs.setdefault(d, [])
        for lane, stream in dev.streams.items():
            submit = stream.submit

            def logged(fn, label=None, name=None, work=None, *, _submit=submit, _stream=lane, _log=log):
                if label is not None:
                    _log.append((_stream, label[0], label[1]))
                return _submit(fn, label, name, work)

            stream.submit = logged
    return logs


def _passed(log, bulk_stream: str, bulk_prefix: str, urgent_stream: str) -> list[str]:
    """Bulk transfers (a run of chunks of one name on ``bulk_stream``; a layer is uploaded once per
    stage that runs it) that a copy on ``urgent_stream`` was issued in the middle of."""
    bulk = [(i, n) for i, (s, n, _) in enumerate(log) if s == bulk_stream and n.startswith(bulk_prefix)]
    runs: list[tuple[str, int, int]] = []  # (name, first index, last index) in the log
    for i, n in bulk:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1], i)
        else:
            runs.append((n, i, i))
    return [n for n, a, b in runs if any(log[i][0] == urgent_stream for i in range(a, b))]


def test_activation_copies_are_issued_between_a_prefetched_stages_weight_chunks_and_gradient_chunks():
    """roundpipe prefetches the next stage's weights at the first microbatch of a stage and flushes a
    stage's gradients after its last: issued at once, every activation copy of the stage's other
    microbatches would queue behind all of them on the copy engine. Paced, the copies of the next
    microbatches are issued between their chunks, and the step still trains like plain PyTorch."""
    model, batch = make_model("llama", num_layers=4), make_batch(batch=4)
    config = dict(
        devices="cpu:2",
        num_microbatches=4,
        policy="roundpipe",
        partition=None,
        copy_chunk_bytes=4096,
        sanitize=True,
    )
    with roundpipe.wrap(model, roundpipe.RunConfig(**config)) as pipe:
        logs = _issue_log(pipe)
        pipe.forward_backward(
            batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
        )
        assert pipe.stats()["host_syncs"]["count"] == 0
    weights = [n for log in logs.values() for n in _passed(log, "h2d_weights", "W:", "h2d")]
    grads = [n for log in logs.values() for n in _passed(log, "d2h_grads", "grads:", "d2h")]
    assert weights, "no activation upload was issued between a prefetched layer's weight chunks"
    assert grads, "no activation download was issued between a stage's gradient chunks"

    got = pipeline_train(model, batch, 2, **config)
    assert_same_run(got, reference_train(model, batch, 2))


def test_gradients_cut_into_chunks_land_in_their_rows_of_a_sharded_head():
    """A vocabulary shard's gradient covers only its rows of the embedding (tied) or head matrix;
    cut into row chunks on the way down, each chunk is added into its own rows on the host."""
    model, batch = make_model("llama", num_layers=2, tied=True), make_batch(batch=4)
    got = pipeline_train(
        model, batch, 2, devices="cpu:2", num_microbatches=2, head_shards=2, copy_chunk_bytes=1024
    )
    assert_same_run(got, reference_train(model, batch, 2))
