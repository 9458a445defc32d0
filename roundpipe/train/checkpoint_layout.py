"""Where checkpoints lie and what their files are called: the names a writer and a reader share.

A run's checkpoints are ``ROOT/step-{step:08d}`` directories; a complete one has its
``manifest.json``, written last (docs/checkpoints.md has the layout). Writes happen in ``.tmp-*``
directories and a replaced checkpoint waits in ``.replaced-*`` until the new one is in place:
neither ever counts as a checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 2  # the newest written and read: 2 adds per-rank shards; a checkpoint without them is 1
MANIFEST = "manifest.json"
STATE = "state.json"
CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")
SHARD_NAME = re.compile(r"^tensors(-\d{5}-of-\d{5})?\.safetensors$")
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"


def tensor_file_names(count: int) -> list[str]:
    """The names of a checkpoint's ``count`` tensor files (one: ``tensors.safetensors``)."""
    if count == 1:
        return ["tensors.safetensors"]
    return [f"tensors-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def checkpoint_step(path: Path) -> int | None:
    """The step a ``step-NNNNNNNN`` directory is named for; None for any other name."""
    match = CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-*`` directories of ``root`` that have a manifest, by step, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (step, entry)
        for entry in root.iterdir()
        if (step := checkpoint_step(entry)) is not None and (entry / MANIFEST).is_file()
    ]
    return [entry for _, entry in sorted(found)]


def older_hint(checkpoint: Path) -> str:
    """What a message about a damaged ``checkpoint`` tells the user to do: resume from the newest
    older checkpoint beside it, or start afresh when there is none."""
    step = checkpoint_step(checkpoint)
    older = [
        other
        for other in complete_checkpoints(checkpoint.parent)
        if other != checkpoint and (step is None or (checkpoint_step(other) or 0) < step)
    ]
    if older:
        return f"resume from an older one: --resume {older[-1]}"
    return f"no older checkpoint exists in {checkpoint.parent}: start the run afresh (without --resume)"
