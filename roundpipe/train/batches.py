"""Samples -> the padded (or packed) batches the pipeline trains and evaluates on.

``Batches`` cuts the training samples into batches of exactly ``batch_size`` rows, epoch after
epoch, deterministically and resumably (its position goes into the checkpoint); ``eval_batches``
cuts the held-out samples in order. A batch is a dict of ``[B, T]`` int64 tensors: ``input_ids``;
``labels``, unshifted (the pipeline shifts them), ``-100`` where there is no loss;
``attention_mask``, 1 for a token and 0 for right padding; and, for packed rows only,
``position_ids``, restarting at 0 at every sample (and at the padding after the last one).
:func:`model_inputs` turns a batch into the arguments of ``Pipeline.forward_backward``.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from roundpipe.errors import CheckpointError, DataError
from roundpipe.train.data import IGNORE, Sample

GROUP_WINDOW = 50  # group_by_length sorts windows of this many batches


def _collate(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    length: int,
    pad_id: int,
    positions: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad ``(input_ids, labels)`` rows to ``length``: the batch dict the pipeline takes.
    ``positions``: each row's position ids (packed rows), padded by a sequence of its own that
    restarts at 0, so that no token of the row attends to it, nor it to them."""
    input_ids, labels, mask, position_ids = [], [], [], []
    for k, (ids, row_labels) in enumerate(rows):
        pad = length - len(ids)
        input_ids.append([*ids, *[pad_id] * pad])
        labels.append([*row_labels, *[IGNORE] * pad])
        mask.append([1] * len(ids) + [0] * pad)
        if positions is not None:
            position_ids.append([*positions[k], *range(pad)])
    batch = {
        "input_ids": torch.tensor(input_ids, dtype=torch.int64),
        "labels": torch.tensor(labels, dtype=torch.int64),
        "attention_mask": torch.tensor(mask, dtype=torch.int64),
    }
    if positions is not None:
        batch["position_ids"] = torch.tensor(position_ids, dtype=torch.int64)
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """``input_ids``, ``labels``, ``attention_mask`` and ``position_ids`` for
    ``Pipeline.forward_backward`` (or a Hugging Face model's forward).

    A packed batch goes without its attention mask and with its position ids: transformers then
    finds the samples of a row where the position ids restart and masks attention per sample
    (``masking_utils.find_packed_sequence_indices``), for every mask it builds (causal, sliding
    window, eager or sdpa). Given an attention mask, it would not look, and a token would attend to
    the earlier samples of its row. The row's padding is its own sequence, after every token.
    """
    packed = "position_ids" in batch
    return {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "attention_mask": None if packed else batch["attention_mask"],
        "position_ids": batch.get("position_ids"),
    }


def _pack(samples: Sequence[Sample], order: list[int], max_length: int) -> list[tuple[int, ...]]:
    """Greedy packing in ``order``: a sample goes into the current row if it fits, else opens the next."""
    rows, row, used = [], [], 0
    for index in order:
        n = len(samples[index].input_ids)
        if n > max_length:
            raise DataError(f"a sample of {n} tokens does not fit a packed row of max_length={max_length}")
        if row and used + n > max_length:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(index)
        used += n
    if row:
        rows.append(tuple(row))
    return rows


class Batches:
    """Endless, deterministic, resumable training batches of exactly ``batch_size`` rows.

    An epoch shuffles the rows with ``random.Random(seed + epoch)`` (no global RNG), drops the
    incomplete tail (``len(rows) % batch_size`` rows, different ones each epoch when shuffled), and
    cuts the rest into batches; epochs roll over forever and the caller decides when to stop. A
    batch is padded on the right to its longest row (``labels`` -100 and ``attention_mask`` 0 on
    padding).

    ``group_by_length``: the kept rows of an epoch are cut into windows of ``GROUP_WINDOW`` batches,
    each window sorted by length and cut into batches, and the batches shuffled (when ``shuffle``),
    so a batch holds samples of similar length.

    ``packing``: the samples (each ending with its eos) are packed once, in a seeded order, into rows
    of ``max_length`` positions; a sample is never split, and the rest of a row is padding. Each
    sample keeps its labels, except its first token, which nothing in the row before predicts
    (-100, as transformers' ``DataCollatorWithFlattening`` does), and its position ids restart at
    0, so that the model attends within each sample only (:func:`model_inputs`).
    ``group_by_length`` has no effect (every row is ``max_length`` long).

    The position is ``(epoch, position)``: the next batch is batch ``position`` of epoch ``epoch``,
    so ``epoch`` counts completed epochs. ``state_dict`` / ``load_state_dict`` carry it, and after
    loading, ``next()`` returns exactly the batches an uninterrupted run would have.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        group_by_length: bool = True,
        packing: bool = False,
        max_length: int | None = None,
        pad_id: int,
    ):
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        if packing and (max_length is None or max_length < 1):
            raise DataError("packing needs max_length: the length of a packed row (data.max_length)")
        self.samples = list(samples)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.group_by_length, self.packing, self.max_length, self.pad_id = (
            group_by_length and not packing,
            packing,
            max_length,
            pad_id,
        )
        if packing:
            order = list(range(len(self.samples)))
            if shuffle:
                random.Random(f"roundpipe-pack-{seed}").shuffle(order)
            self._rows = _pack(self.samples, order, max_length)
        else:
            self._rows = [(i,) for i in range(len(self.samples))]
        self._row_lengths = [sum(len(self.samples[i].input_ids) for i in row) for row in self._rows]
        if len(self._rows) < batch_size:
            what = "packed rows" if packing else "training samples"
            raise DataError(
                f"{len(self._rows)} {what} make no full batch of {batch_size}: lower run.batch_size, or "
                f"give more training data"
            )
        self._epoch, self._position = 0, 0
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, its batches of row indices)

    @property
    def epoch(self) -> int:
        """Epochs completed: the epoch the next batch comes from."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches already taken from the current epoch."""
        return self._position

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``rows // batch_size`` (the same every epoch)."""
        return len(self._rows) // self.batch_size

    def _batches_of(self, epoch: int) -> list[list[int]]:
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = random.Random(self.seed + epoch)
        order = list(range(len(self._rows)))
        if self.shuffle:
            rng.shuffle(order)
        size = self.batch_size
        order = order[: self.steps_per_epoch * size]
        if self.group_by_length:
            batches = []
            for start in range(0, len(order), GROUP_WINDOW * size):
                window = sorted(
                    order[start : start + GROUP_WINDOW * size], key=lambda r: -self._row_lengths[r]
                )
                batches += [window[k : k + size] for k in range(0, len(window), size)]
            if self.shuffle:
                rng.shuffle(batches)
        else:
            batches = [order[k : k + size] for k in range(0, len(order), size)]
        self._plan = (epoch, batches)
        return batches

    def _row(self, row: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
        """A row's ids, labels and position ids (restarting at every sample)."""
        ids, labels, positions = [], [], []
        for index in row:
            sample = self.samples[index]
            ids += sample.input_ids
            labels += sample.labels
            positions += range(len(sample.input_ids))
            if self.packing:
                labels[len(ids) - len(sample.input_ids)] = IGNORE
        return ids, labels, positions

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch: ``input_ids``, ``labels``, ``attention_mask`` (and ``position_ids`` when
        packing), each ``[batch_size, T]`` int64, ``T`` the longest row of the batch (``max_length``
        when packing)."""
        batch = self._batches_of(self._epoch)[self._position]
        self._position += 1
        if self._position == self.steps_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
        rows = [self._row(self._rows[r]) for r in batch]
        length = self.max_length if self.packing else max(len(ids) for ids, _, _ in rows)
        positions = [p for _, _, p in rows] if self.packing else None
        return _collate([(ids, labels) for ids, labels, _ in rows], length, self.pad_id, positions)

    def _fingerprint(self) -> dict[str, Any]:
        lengths = b"".join(len(s.input_ids).to_bytes(4, "little") for s in self.samples)
        return {
            "samples": len(self.samples),
            "lengths_crc32": zlib.crc32(lengths),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "group_by_length": self.group_by_length,
            "packing": self.packing,
            "max_length": self.max_length if self.packing else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position (``epoch``, ``position``) and what it is valid for (``fingerprint``)."""
        return {"epoch": self._epoch, "position": self._position, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``.

        Raises:
            CheckpointError: the state was saved with other samples or batching settings, or its
                position lies outside an epoch.
        """
        saved = state.get("fingerprint")
        if saved is not None:
            ours = self._fingerprint()
            differ = [
                f"{key}: saved {saved.get(key)!r}, now {value!r}"
                for key, value in ours.items()
                if saved.get(key) != value
            ]
            if differ:
                raise CheckpointError(
                    f"the data position in this checkpoint belongs to other data or batching ({'; '.join(differ)}). "
                    f"Resume with the same data files, tokenizer, data settings, run.batch_size and run.seed, "
                    f"or start a new run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise CheckpointError(
                f"data position epoch {epoch}, batch {position} is outside an epoch of {self.steps_per_epoch} batches"
            )
        self._epoch, self._position = epoch, position


def eval_batches(
    samples: Sequence[Sample], batch_size: int, pad_id: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Evaluation batches over ``samples`` in order; the last one may be smaller.

    Each batch is the dict ``Batches.next`` returns, right-padded to its longest row.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    for start in range(0, len(samples), batch_size):
        rows = [(s.input_ids, s.labels) for s in samples[start : start + batch_size]]
        yield _collate(rows, max(len(ids) for ids, _ in rows), pad_id)
