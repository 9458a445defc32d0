"""Reading a checkpoint back: every file checked against the manifest before a byte is trusted.

``verify_checkpoint`` checks a checkpoint directory's files against its ``manifest.json`` (names,
sizes, sha256; no symlink leading out of it); ``load_checkpoint`` verifies, then reads the state
back from ``state.json`` and the tensor files (a sharded dict as the union of every rank's part).
Every refusal is a ``CheckpointError`` naming the file and the older checkpoint to resume from.
``CheckpointManager.verify`` / ``load`` call these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from roundpipe.errors import CheckpointError
from roundpipe.train.checkpoint_layout import FORMAT_VERSION, MANIFEST, SHARD_NAME, STATE, older_hint
from roundpipe.train.checkpoint_shards import RANK_FILE, place, read_union
from roundpipe.train.paths import escape
from roundpipe.train.tensor_files import decode_skeleton, sha256_file


def verify_checkpoint(path: str | Path, *, hash_files: bool = True) -> dict:
    """Check every file of a checkpoint against its manifest; return the manifest.

    Reads each listed file once, in chunks, to hash it: about as long as reading the
    checkpoint from disk. ``hash_files=False`` checks names, presence and sizes only (the
    ranks of a data-parallel run other than 0, after rank 0 hashed the same files).

    Raises:
        CheckpointError: no or unreadable manifest, a newer format, a listed file missing
            or of another size or sha256, a listed name that is not a plain file name or a
            symlink that leads outside the checkpoint directory, or ``state.json`` / a tensor
            shard not listed.
            The message names the file and the older checkpoint to resume from instead.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist or is a file)")
    _refuse_outside(path / MANIFEST, path)
    manifest = _read_json(path / MANIFEST, path, what="manifest")
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if type(version) is not int or not isinstance(files, dict) or type(manifest.get("step")) is not int:
        raise _damaged(path / MANIFEST, "lacks its format_version, step or file list", path)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written in checkpoint format {version} by a newer roundpipe; this one "
            f"reads format {FORMAT_VERSION}. Upgrade roundpipe to resume from it"
        )
    for name, entry in files.items():
        file = path / name
        if (
            not isinstance(entry, dict)
            or type(entry.get("bytes")) is not int
            or not isinstance(entry.get("sha256"), str)
            or Path(name).name != name
            or name in ("", ".", "..", MANIFEST)
        ):
            raise _damaged(path / MANIFEST, f"has a malformed entry for {name!r}", path)
        _refuse_outside(file, path)
        if not file.is_file():
            raise _damaged(file, f"is missing but the manifest lists it ({entry['bytes']:,} bytes)", path)
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise _damaged(file, f"is {size:,} bytes but the manifest says {entry['bytes']:,}", path)
        digest = sha256_file(file) if hash_files else entry["sha256"]
        if digest != entry["sha256"]:
            raise _damaged(
                file,
                f"has sha256 {digest[:16]}… but the manifest says {entry['sha256'][:16]}…: its bytes "
                f"changed after it was written (a disk error or an edit)",
                path,
            )
    if STATE not in files:
        raise _damaged(path / STATE, "is not in the manifest", path)
    return manifest


def load_checkpoint(path: str | Path, *, hash_files: bool = True) -> tuple[int, dict, dict[str, bytes]]:
    """Verify a checkpoint (see ``verify``; ``hash_files`` as there), then read it back.

    Args:
        path: a checkpoint directory, e.g. from ``latest()`` or ``resolve()``.

    Returns:
        ``(step, state, extra_files)``: the step it was saved at, the state exactly as
        ``save`` got it (tensors on the CPU, in memory of their own, see ``flatten_state``
        for what is kept), and the extra files' bytes by name. A checkpoint saved with
        shards has, at the shard's path, a ``ShardUnion``: every rank's part, read from its
        files when a key is looked up, whatever the number of ranks that reads it.

    Raises:
        CheckpointError: anything ``verify`` refuses, a ``state.json`` that disagrees with
            the manifest (another step, a tensor file not listed) or with the tensor files.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, hash_files=hash_files)
    files = manifest["files"]
    doc = _read_json(path / STATE, path, what="state file")
    shard_names = doc.get("tensor_files") if isinstance(doc, dict) else None
    if not isinstance(shard_names, list) or "skeleton" not in doc:
        raise _damaged(path / STATE, "lacks its tensor_files or skeleton", path)
    if doc.get("step") != manifest["step"]:
        raise _damaged(
            path / STATE,
            f"is for step {doc.get('step')!r} but the manifest says {manifest['step']}",
            path,
        )
    tensors: dict[str, torch.Tensor] = {}
    for shard_name in shard_names:
        if not isinstance(shard_name, str) or shard_name not in files or not SHARD_NAME.match(shard_name):
            raise _damaged(path / str(shard_name), "is named by state.json but not in the manifest", path)
        try:
            shard = load_file(str(path / shard_name))
        except Exception as e:  # safetensors raises its own error type for unreadable files
            raise _damaged(path / shard_name, f"cannot be read as safetensors ({e})", path) from e
        if tensors.keys() & shard.keys():
            raise _damaged(path / shard_name, "repeats tensors of an earlier shard", path)
        tensors.update(shard)
    used: set[str] = set()
    state = decode_skeleton(doc["skeleton"], tensors, used)
    if used != tensors.keys():
        stray = sorted(tensors.keys() - used)[:5]
        raise _damaged(path / STATE, f"does not refer to tensors {stray} of the tensor files", path)
    rank_files: set[str] = set()
    if "shards" in doc:
        where, union = read_union(
            doc["shards"], path, files, lambda file, problem: _damaged(file, problem, path)
        )
        place(state, where, union, lambda problem: _damaged(path / STATE, problem, path))
        rank_files = {name for part in doc["shards"]["ranks"] for name in part["tensor_files"]}
    extra = {}
    for name in files:
        if name == STATE or name in shard_names or name in rank_files:
            continue
        if SHARD_NAME.match(name) or RANK_FILE.match(name):
            raise _damaged(path / name, "is in the manifest but state.json does not use it", path)
        extra[name] = (path / name).read_bytes()
    return manifest["step"], state, extra


def _read_json(file: Path, checkpoint: Path, *, what: str) -> Any:
    if not file.is_file():
        raise CheckpointError(
            f"{file} does not exist: {checkpoint} is not a complete checkpoint (its write never "
            f"finished, or the {what} was deleted); {older_hint(checkpoint)}"
        )
    try:
        return json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(file, f"is not valid JSON ({e})", checkpoint) from e


def _refuse_outside(file: Path, checkpoint: Path) -> None:
    """A symlink in a checkpoint that leads outside it would make ``load`` read what it points
    to (with a manifest edited to match): refused, naming the file. One inside it is fine."""
    outside = escape(checkpoint, file)
    if outside is not None:
        raise _damaged(
            file,
            f"{outside}: load reads only files inside the checkpoint directory",
            checkpoint,
        )


def _damaged(file: Path, problem: str, checkpoint: Path) -> CheckpointError:
    return CheckpointError(f"{file} {problem}: the checkpoint is damaged; {older_hint(checkpoint)}")
