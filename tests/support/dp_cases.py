"""The training runs tests/test_data_parallel.py compares: one function, run in a single process
or as one rank of several (then ``pipe.dp`` is the group and every rank passes the global batch)."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import torch

import roundpipe
from roundpipe.testing import faults
from support.reference import EPS, LR, trainable_weights
from support.tiny_models import make_batch, make_model, place_flag_token, with_flag_token


def optimizer_state_bytes(pipe) -> int:
    """Bytes of the AdamW state tensors this process holds (what is alive, not a ledger)."""
    seen, total = set(), 0
    for opt in pipe._updates.optimizer.optimizers.values():
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.data_ptr() not in seen and v.numel() > 1:
                    seen.add(v.data_ptr())
                    total += v.numel() * v.element_size()
    return total


def train_case(
    family="llama",
    lora=None,
    steps=3,
    batch=8,
    fault_rank=None,
    fault_step=None,
    kill_rank=None,
    kill_step=None,
    kill_stamp=None,
    stop_on_error=True,
    faults_injected=(),
    accumulate=1,
    in_place_bytes=None,
    flag_rows=None,
    weight_decay=0.0,
    **config,
) -> dict:
    """Train a tiny model ``steps`` AdamW steps with ``RunConfig(**config)`` (default ``cpu:2``,
    one layer per stage); ``fault_rank`` raises on that rank before step ``fault_step``;
    ``flag_rows``: give layer 0 a parameter that only rows ``flag_rows[t % len(flag_rows)]`` of
    the batch reach at step ``t`` (``tiny_models.with_flag_token``)."""
    if in_place_bytes is not None:  # which gradients the reduction sums in place (tiny models: none)
        from roundpipe.distributed import reducer

        reducer.IN_PLACE_BYTES = in_place_bytes
    model = make_model(family, lora=lora, num_layers=3)
    data = make_batch(batch=batch, padding="left")
    step_data = [data]
    if flag_rows is not None:
        token = with_flag_token(model)
        step_data = [place_flag_token(data, token, rows) for rows in flag_rows]
    config = {"devices": "cpu:2", "partition": None, **config}
    clip = config.pop("max_grad_norm", None)
    model = copy.deepcopy(model)
    losses = []
    skipped = None
    with roundpipe.wrap(model, roundpipe.RunConfig(**config)) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=weight_decay, max_grad_norm=clip)
        for step in range(steps):
            if pipe.dp is not None and pipe.dp.rank == fault_rank and step == fault_step:
                raise RuntimeError(f"injected failure on rank {fault_rank} at step {step}")
            if pipe.dp is not None and pipe.dp.rank == kill_rank and step == kill_step:
                if kill_stamp:
                    Path(kill_stamp).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            with faults.injected(*(faults.Fault(**f) for f in faults_injected)):
                out = _forward_backward(pipe, step_data[step % len(step_data)], accumulate)
                pipe.step()
            losses.append(out.loss)
        skipped = pipe.skipped_steps
        plan = str(pipe.plan)
        state = optimizer_state_bytes(pipe)
        spans = [(lane, kind, start, stop) for _, lane, _, kind, start, stop in pipe._recorder.last_spans]
        pipe.last_timeline()  # the reduction's host spans render
        pipe.export_to(model)
        rank = None if pipe.dp is None else pipe.dp.rank
    return {"losses": losses, "weights": trainable_weights(model), "optimizer_bytes": state, "rank": rank, "spans": spans, "skipped": skipped, "plan": plan,
            "time": time.time(), "pid": os.getpid()}  # fmt: skip


def _forward_backward(pipe, data, accumulate: int):
    """One optimizer step's forward and backward: the batch whole, or in ``accumulate`` slices
    (every slice's gradient divided by the label tokens of all of them)."""
    if accumulate == 1:
        return pipe.forward_backward(
            data["input_ids"], labels=data["labels"], attention_mask=data["attention_mask"]
        )
    parts = [{k: v.tensor_split(accumulate)[i] for k, v in data.items()} for i in range(accumulate)]
    tokens = sum(int((p["labels"][:, 1:] != -100).sum()) for p in parts)
    for i, p in enumerate(parts):
        out = pipe.forward_backward(
            p["input_ids"], labels=p["labels"], attention_mask=p["attention_mask"],
            accumulate=i < accumulate - 1, loss_tokens=tokens,
        )  # fmt: skip
    return out
