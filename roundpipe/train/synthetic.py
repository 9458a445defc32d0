"""Built-in synthetic tasks for demos: data with real structure that a small model built from a
config learns in minutes on a CPU, written as ordinary data files so the whole data path runs.

``reverse``: reverse a string of 4 to 9 lowercase letters (instruction format: the instruction is
the string, the output its reverse). Every held-out prompt is absent from the training file, so
exact match on it measures the rule, not memorisation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from roundpipe.errors import RecipeError

TASKS = ("reverse",)


def _reverse_sample(rng: random.Random) -> dict[str, str]:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))
    return {"instruction": word, "input": "", "output": word[::-1]}


def write_task(
    name: str, train_path: str | Path, eval_path: str | Path, counts: list[int], seed: int
) -> bool:
    """Write ``counts = [train, eval]`` samples of task ``name`` as JSONL, unless both files exist.

    Returns whether the files were written. The held-out prompts are drawn first and excluded from
    the training file. Where the paths may lie is the caller's rule: a recipe's run writes them only
    inside its run directory (``TrainConfig.check`` and ``Trainer.fit`` refuse others, see
    ``roundpipe.train.paths``).
    """
    if name not in TASKS:
        raise RecipeError(f"unknown data.synthetic task {name!r}; choose one of {', '.join(TASKS)}")
    if len(counts) != 2 or min(counts) < 1:
        raise RecipeError(f"data.synthetic_samples must be two positive counts [train, eval], got {counts}")
    train_path, eval_path = Path(train_path), Path(eval_path)
    if train_path.exists() and eval_path.exists():
        return False
    rng = random.Random(seed)
    held_out: dict[str, dict[str, str]] = {}
    while len(held_out) < counts[1]:
        s = _reverse_sample(rng)
        held_out.setdefault(s["instruction"], s)
    train = []
    while len(train) < counts[0]:
        s = _reverse_sample(rng)
        if s["instruction"] not in held_out:
            train.append(s)
    for path, rows in ((train_path, train), (eval_path, list(held_out.values()))):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)
    return True
