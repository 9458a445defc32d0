"""Held-out evaluation during a run: the loss, exact match, and a few greedy answers to read.

``evaluate`` runs the held-out samples through the pipeline (``Pipeline.evaluate``, in order, in
batches of ``eval.batch_size``; a short one runs with fewer microbatches) and logs one ``eval``
row; an error in a held-out batch names the evaluation and the batch; with
``eval.exact_match`` it also exports the weights into the model and measures on rank 0 the share
of answers a greedy decoder gets right (``exact_match``). ``show_samples`` prints a few greedy
answers at the end of a run.
"""

from __future__ import annotations

import math

import torch

from roundpipe.train.batches import eval_batches
from roundpipe.train.config import TrainConfig


def eval_chunks(samples, size: int, pad_id: int) -> list[dict]:
    """Held-out samples in order, as about equal batches of at most ``size`` samples (all of them
    when there are fewer)."""
    count = max(1, math.ceil(len(samples) / size))
    bounds = [round(i * len(samples) / count) for i in range(count + 1)]
    return [batch for a, b in zip(bounds, bounds[1:]) for batch in eval_batches(samples[a:b], b - a, pad_id)]


def evaluate(pipe, model, samples, tokenizer, step: int, metrics, *, cfg: TrainConfig, is_main: bool) -> dict:
    """One evaluation at ``step`` (every rank calls it): the token-mean loss over the held-out
    samples (at most ``eval.max_samples``) and, with ``eval.exact_match``, rank 0's exact match.
    The row goes to ``metrics``; the values come back by name (``loss``, ``exact_match``)."""
    samples = samples[: cfg.eval.max_samples] if cfg.eval.max_samples else samples
    batches = eval_chunks(samples, cfg.eval.batch_size or cfg.run.batch_size, tokenizer.pad_token_id)
    loss_sum, tokens = 0.0, 0
    for index, b in enumerate(batches):
        try:
            out = pipe.evaluate(b["input_ids"], labels=b["labels"], attention_mask=b["attention_mask"])
        except Exception as err:
            where = f"held-out evaluation at step {step}, batch {index + 1} of {len(batches)}"
            _in_evaluation(err, f"{where} ({len(b['input_ids'])} samples)")
            raise
        loss_sum += out.loss * out.num_tokens
        tokens += out.num_tokens
    row = {"kind": "eval", "step": step, "loss": loss_sum / tokens}
    if cfg.eval.exact_match:
        pipe.export_to(model)  # on every rank (as every pipeline call), the answers on rank 0 only
        if is_main:
            try:
                row["exact_match"] = exact_match(model, batches, samples)
            except Exception as err:
                _in_evaluation(err, f"held-out exact match at step {step} (eval.exact_match)")
                raise
    metrics.log(row)
    return {k: v for k, v in row.items() if k not in ("kind", "step")}


def _in_evaluation(err: Exception, where: str) -> None:
    """Put ``where`` (the evaluation and its batch) in front of ``err``'s message: a failure
    there says it was not a training step. Every roundpipe error keeps its message in ``args[0]``."""
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{where}: {err.args[0]}", *err.args[1:])
    elif hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(where)


def eval_line(step: int, ev: dict) -> str:
    """The log line of an evaluation's values."""
    return f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items())


def exact_match(model, batches, samples) -> float:
    """Share of ``samples`` whose whole answer (``input_ids[prompt_len:]``, end-of-sequence
    included) is the model's greedy choice at every position, fed the reference prefix. That is
    exactly the share a greedy decoder answers correctly: each answer token is then predicted from
    the correct prefix. ``batches`` hold ``samples`` in order (``eval_batches``)."""
    was_training = model.training
    model.eval()
    hits, index = 0, 0
    try:
        with torch.no_grad():
            for b in batches:
                logits = model(
                    input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False
                ).logits
                pred = logits[:, :-1].argmax(-1)
                for row in range(b["input_ids"].shape[0]):
                    s = samples[index]
                    index += 1
                    start, end = s.prompt_len, len(s.input_ids)
                    if start == 0:
                        continue  # no answer to match (text format)
                    want = b["input_ids"][row, start:end]
                    hits += bool(torch.equal(pred[row, start - 1 : end - 1], want))
    finally:
        model.train(was_training)
    answered = sum(1 for s in samples[:index] if s.prompt_len > 0)
    return hits / answered if answered else 0.0


def show_samples(model, samples, tokenizer, max_new_tokens: int, log) -> None:
    """Log the model's greedy answer to each of ``samples`` beside the reference answer."""
    was_training = model.training
    model.eval()
    log("held-out samples (greedy):")
    try:
        with torch.no_grad():
            for s in samples:
                prompt = torch.tensor([s.input_ids[: s.prompt_len]])
                out = model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )[0, prompt.shape[1] :].tolist()
                got = tokenizer.decode(out, skip_special_tokens=True)
                want = tokenizer.decode(list(s.input_ids[s.prompt_len :]), skip_special_tokens=True)
                mark = "ok " if got.strip() == want.strip() else "MISS"
                shown = tokenizer.decode(list(s.input_ids[: s.prompt_len]), skip_special_tokens=True)
                log(f"  {mark} {shown!r} -> {got!r} (answer {want!r})")
    finally:
        model.train(was_training)
