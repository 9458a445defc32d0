"""Checkpoints on disk: nested training state in, a verified directory out, and back.

The trainer hands ``CheckpointManager.save`` one nested structure (master weights or LoRA adapters,
optimizer, LR scheduler, loss scaler, RNG states, data position, ...). This module knows nothing
about pipelines: it splits that structure into tensors and a JSON skeleton (``flatten_state`` of
``tensor_files.py``), writes them as safetensors shards plus ``state.json``, and seals the
directory with a manifest of every file's size and sha256. A write is atomic: it happens in a
``.tmp-*`` directory that is renamed into place only when complete, so a crash at any instant
leaves the previous checkpoints intact. ``load`` verifies the manifest before it trusts a byte.

Layout (see docs/checkpoints.md)::

    ROOT/step-00000012/
        tensors.safetensors              # or tensors-00001-of-00003.safetensors, ... (~2 GB each)
        state.json                       # format version, step, shard names, skeleton
        rank-00000-of-00002.safetensors  # with shards: each rank's part (format 2)
        <extra files>                    # whatever the caller passed in extra_files
        manifest.json                    # written last: {file: {bytes, sha256}}, step, format

A data-parallel run saves from every rank at once (``save(..., shard=, group=)``): each rank writes
its own part of a sharded dict (the optimizer state of the parameters it owns) as
``rank-00001-of-00004.safetensors`` into the write directory rank 0 named, and rank 0 seals one
manifest over every rank's files (``checkpoint_shards``). ``load`` reads such a checkpoint on any
number of ranks: the union of the parts comes back where the dict was (``ShardUnion``).

One run writes to a root at a time (its rank 0 deletes every ``.tmp-*`` directory it finds there).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.testing import faults
from roundpipe.train.checkpoint_shards import RANK_FILE, Shard, place, read_union, shards_doc, write_rank_part
from roundpipe.train.paths import escape
from roundpipe.train.tensor_files import (
    decode_skeleton,
    flatten_state,
    fsync_file,
    sha256_file,
    shard_groups,
    write_shard,
)

FORMAT_VERSION = 2  # the newest written and read: 2 adds per-rank shards; a checkpoint without them is 1
MANIFEST = "manifest.json"
STATE = "state.json"
SHARD_BYTES = 2 * 1024**3
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")
_SHARD_NAME = re.compile(r"^tensors(-\d{5}-of-\d{5})?\.safetensors$")
_TMP_PREFIX = ".tmp-"
_REPLACED_PREFIX = ".replaced-"


# ---------------------------------------------------------------------------------------------
# Files: durable writes, streaming hashes
# ---------------------------------------------------------------------------------------------


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory to fsync it; renames are durable there
        return
    fsync_file(path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode()


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["tensors.safetensors"]
    return [f"tensors-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def _complete_checkpoints(root: Path) -> list[Path]:
    """``step-*`` directories of ``root`` that have a manifest, by step, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (step, entry)
        for entry in root.iterdir()
        if (step := _checkpoint_step(entry)) is not None and (entry / MANIFEST).is_file()
    ]
    return [entry for _, entry in sorted(found)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


class _Alone:
    """The ranks of a save by one process (no exchange needed)."""

    rank = 0
    world_size = 1


_ALONE = _Alone()


@dataclass(frozen=True)
class _Failed:
    """What a rank hands the others when its part of a save raised."""

    text: str

    @classmethod
    def of(cls, err: BaseException) -> _Failed:
        return cls(f"raised {type(err).__name__}: {err}")


@dataclass
class _Prepared:
    """Rank 0's state, split: its tensors, its JSON skeleton, the extra files."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any
    extra: dict[str, bytes]


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Writes, lists, verifies and reads the checkpoints of one run under ``root``.

    Args:
        root: the run's checkpoint directory (created on the first save). One run writes
            to it at a time (a data-parallel run through all its ranks, see ``save``).
        keep_last: after each save, keep this many newest checkpoints (highest steps) and delete
            the rest. The checkpoint just written is never deleted.
        shard_bytes: tensors go into safetensors shards of at most this many bytes (a single
            larger tensor gets a shard of its own). Default ~2 GB.

    Constructing a manager repairs the one state a crash can leave behind that hides a
    checkpoint: if a save that replaced step N died between its two renames, the old step N is
    renamed back from ``.replaced-step-N-*``. ``repair=False`` leaves that to another process
    (the other ranks of a data-parallel run leave it to rank 0).

    Raises:
        ConfigError: ``keep_last`` or ``shard_bytes`` below 1.
    """

    def __init__(
        self, root: str | Path, keep_last: int = 2, *, shard_bytes: int = SHARD_BYTES, repair: bool = True
    ):
        if type(keep_last) is not int or keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be an integer of at least 1, got {keep_last!r}")
        if type(shard_bytes) is not int or shard_bytes < 1:
            raise ConfigError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.shard_bytes = shard_bytes
        if repair:
            self._restore_replaced()

    # -- writing ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict | None,
        *,
        extra_files: dict[str, bytes] | None = None,
        shard: Shard | None = None,
        group=None,
    ) -> Path:
        """Write ``state`` as checkpoint ``root/step-{step:08d}`` atomically; return its path.

        Every file is written into ``root/.tmp-step-…-XXXX`` and fsynced, ``manifest.json``
        last, the directory is fsynced and renamed to its final name, then ``root`` is fsynced.
        Until that rename the checkpoint does not exist for ``latest``/``list``/``resolve``;
        after it, it is complete on disk. Saving a step that exists replaces it: the old one is
        renamed aside, the new one renamed in, the old one deleted. Then older checkpoints
        beyond ``keep_last`` and leftovers of crashed writes (``.tmp-*``, ``.replaced-*``) are
        deleted; a failure to delete is a warning, not an error (the new checkpoint is fine).

        With ``group`` (the ranks of a data-parallel run: ``rank``, ``world_size``,
        ``broadcast_object``, ``all_gather_object``) every rank calls ``save`` with the same step:
        rank 0 names the write directory, every rank writes its ``shard`` into it and hands rank 0
        the names, sizes and sha256 of its files, and rank 0 writes ``state`` and seals the one
        manifest over all of them once every rank's files are written. A rank that fails fails the
        save on every rank (``CheckpointError`` naming it), and nothing of this checkpoint is left
        behind. The checkpoint directory must be on a filesystem every rank sees.

        Args:
            step: the optimizer step the state belongs to (>= 0).
            state: nested state, as ``flatten_state`` accepts (rank 0's; other ranks' is ignored).
                Do not modify its tensors until this returns: contiguous CPU tensors are written
                from their own memory.
            extra_files: more files to store byte for byte (e.g. the recipe), by plain file
                name; ``load`` returns them. Names may not start with ``.``, contain a path
                separator, or be ``manifest.json``, ``state.json``, ``tensors*.safetensors`` or
                ``rank-*.safetensors``. Rank 0's.
            shard: this rank's part of a dict split across the ranks by key, which ``load``
                puts back at ``shard.path`` as the union of every rank's part (``ShardUnion``);
                ``state`` leaves that key out. Give one on every rank or on none.
            group: the ranks that save together; None: this process alone.

        Raises:
            CheckpointError: a bad step, extra-file name or state value, or the write failed
                (disk full, permissions) on this or another rank; nothing of this checkpoint is
                left behind then.
        """
        if type(step) is not int or step < 0:
            raise CheckpointError(f"a checkpoint step must be an integer >= 0, got {step!r}")
        group = group if group is not None else _ALONE
        main = group.rank == 0
        final = self.root / f"step-{step:08d}"
        tmp: Path | None = None
        prepared = None
        try:
            # 1. Rank 0 checks what it is to write and opens the write directory for every rank.
            opened = self._on_one(
                group, lambda: self._open(final.name, state, extra_files), main, public=lambda r: r[1].name
            )
            if isinstance(opened, _Failed):
                raise CheckpointError(f"checkpoint {final} not written: rank 0 {opened.text}")
            prepared, tmp = opened if main else (None, self.root / opened)
            # 2. Every rank writes its files (rank 0 the state's tensors too) and says what they are.
            parts = self._on_all(group, lambda: self._write_part(tmp, step, group, shard, prepared))
            failed = [(rank, part) for rank, part in enumerate(parts) if isinstance(part, _Failed)]
            if failed:
                rank, part = failed[0]
                hint = (
                    " (the run directory must be on a filesystem every rank sees)"
                    if "No such file or directory" in part.text
                    else ""
                )
                raise CheckpointError(
                    f"writing checkpoint {final} failed on rank {rank}: {part.text}{hint}; "
                    "the older checkpoints are untouched"
                )
            # 3. Rank 0 seals the manifest over every rank's files and renames the directory in.
            sealed = self._on_one(group, lambda: self._seal(tmp, final, step, prepared, parts), main)
            if isinstance(sealed, _Failed):
                raise CheckpointError(f"checkpoint {final} not written: rank 0 {sealed.text}")
        except BaseException as e:
            if main and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # the original error below is what matters
            if isinstance(e, OSError):
                raise CheckpointError(
                    f"writing checkpoint {final} failed: {e}. Free disk space or fix the permissions "
                    f"of {self.root}; the older checkpoints are untouched"
                ) from e
            raise
        if main:
            self._clean(keep=final)
        return final

    @staticmethod
    def _on_one(group, work, main: bool, public=lambda result: None):
        """Rank 0 runs ``work``; rank 0 gets its result and every other rank ``public(result)``, or a
        ``_Failed`` where it raised; rank 0 itself re-raises its exception once the others know."""
        if group is _ALONE:
            return work()
        result = error = None
        if main:
            try:
                result = work()
                shared = public(result)
            except Exception as e:
                error, shared = e, _Failed.of(e)
        shared = group.broadcast_object(shared if main else None)
        if error is not None:
            raise error
        return result if main else shared

    @staticmethod
    def _on_all(group, work) -> list:
        """Every rank runs ``work``; each gets the list of every rank's result (a ``_Failed`` where one
        raised); the rank that raised re-raises its own exception once the others know."""
        if group is _ALONE:
            return [work()]
        error = None
        try:
            mine = work()
        except Exception as e:
            error, mine = e, _Failed.of(e)
        parts = group.all_gather_object(mine)
        if error is not None:
            raise error
        return parts

    def _open(self, name: str, state: Any, extra_files: dict | None):
        """Rank 0: check the extra files, split the state, create the write directory."""
        extra = dict(extra_files or {})
        for extra_name, data in extra.items():
            self._check_extra_name(extra_name)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise CheckpointError(
                    f"extra file {extra_name!r} must be bytes, got a {type(data).__qualname__}"
                )
        tensors, skeleton = flatten_state(state)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f"{_TMP_PREFIX}{name}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory in {self.root}: {e}") from e
        return _Prepared(tensors, skeleton, extra), tmp

    def _write_part(self, tmp: Path, step: int, group, shard: Shard | None, prepared) -> dict:
        """This rank's files: rank 0 the state's tensor shards; every rank its ``shard``'s part."""
        written: dict = {"shard": None}
        if prepared is not None:
            groups = shard_groups(prepared.tensors, self.shard_bytes)
            written["tensor_files"] = _shard_names(len(groups))
            for shard_name, tensors in zip(written["tensor_files"], groups):
                write_shard(tmp / shard_name, tensors)
        if shard is not None:
            written["shard"] = write_rank_part(tmp, shard, group.rank, group.world_size, self.shard_bytes)
            written["shard_path"] = list(shard.path)
        faults.point("checkpoint", step=step)  # half-written: the reliability tests fail or kill here
        return written

    def _seal(self, tmp: Path, final: Path, step: int, prepared, parts: list[dict]) -> None:
        """Rank 0: ``state.json``, the extra files and the manifest over every rank's files, then the
        rename that makes the checkpoint exist."""
        shard_names = parts[0]["tensor_files"]
        shards = [part["shard"] for part in parts]
        if any(s is None for s in shards) and any(s is not None for s in shards):
            given = [rank for rank, s in enumerate(shards) if s is not None]
            raise CheckpointError(f"only ranks {given} gave a shard of the state; every rank or none must")
        state_doc = {
            "format_version": FORMAT_VERSION if shards[0] is not None else 1,
            "step": step,
            "torch": torch.__version__,
            "tensor_files": shard_names,
            "skeleton": prepared.skeleton,
        }
        files: dict[str, dict] = {}
        if shards[0] is not None:
            state_doc["shards"] = shards_doc(tuple(parts[0]["shard_path"]), shards)
            for part in shards:
                for name, entry in part["files"].items():
                    size = (tmp / name).stat().st_size if (tmp / name).is_file() else None
                    if size != entry["bytes"]:
                        raise CheckpointError(
                            f"rank {part['rank']} wrote {name} ({entry['bytes']:,} bytes) but rank 0 "
                            f"{'finds ' + format(size, ',') + ' bytes' if size is not None else 'does not see it'}: "
                            "the run directory must be on a filesystem every rank sees"
                        )
                    files[name] = entry
        _write_bytes(tmp / STATE, _json_bytes(state_doc))
        for extra_name, data in prepared.extra.items():
            _write_bytes(tmp / extra_name, bytes(data))
        for file_name in [*shard_names, STATE, *prepared.extra]:
            files[file_name] = {
                "bytes": (tmp / file_name).stat().st_size,
                "sha256": sha256_file(tmp / file_name),
            }
        manifest = {
            "format_version": state_doc["format_version"],
            "step": step,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
        }
        _write_bytes(tmp / MANIFEST, _json_bytes(manifest))
        _fsync_dir(tmp)
        self._move_into_place(tmp, final)

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        if final.exists():
            aside = self.root / f"{_REPLACED_PREFIX}{final.name}-{secrets.token_hex(4)}"
            os.rename(final, aside)
            os.rename(tmp, final)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)

    def _clean(self, keep: Path) -> None:
        doomed = [
            entry for entry in self.root.iterdir() if entry.name.startswith((_TMP_PREFIX, _REPLACED_PREFIX))
        ]
        complete = self.list()
        newest = set(complete[-self.keep_last :]) | {keep}
        for old in complete:
            if old not in newest:
                # Rename first so a crash mid-delete leaves a .tmp-* leftover, never a half checkpoint.
                dying = self.root / f"{_TMP_PREFIX}deleting-{old.name}-{secrets.token_hex(4)}"
                try:
                    os.rename(old, dying)
                except OSError as e:
                    warnings.warn(f"could not delete old checkpoint {old}: {e}", stacklevel=3)
                    continue
                doomed.append(dying)
        for entry in doomed:
            try:
                _remove(entry)
            except OSError as e:
                warnings.warn(
                    f"could not delete {entry} (left by an older or crashed save): {e}", stacklevel=3
                )

    def _restore_replaced(self) -> None:
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            if not entry.name.startswith(_REPLACED_PREFIX) or not (entry / MANIFEST).is_file():
                continue
            original = self.root / entry.name[len(_REPLACED_PREFIX) :].rsplit("-", 1)[0]
            if _checkpoint_step(original) is not None and not original.exists():
                try:
                    os.rename(entry, original)
                    _fsync_dir(self.root)
                except OSError as e:
                    raise CheckpointError(
                        f"{original} was being replaced when a save died; renaming {entry} back failed "
                        f"({e}). Rename it to {original.name} by hand"
                    ) from e

    @staticmethod
    def _check_extra_name(name: Any) -> None:
        if (
            not isinstance(name, str)
            or not name
            or name.startswith(".")
            or any(sep in name for sep in ("/", "\\", "\0"))
            or name in (MANIFEST, STATE)
            or (name.startswith(("tensors", "rank-")) and name.endswith(".safetensors"))
        ):
            raise CheckpointError(
                f"extra file name {name!r} is not allowed: use a plain file name (no path separator, "
                f"not starting with '.') other than {MANIFEST}, {STATE}, tensors*.safetensors and "
                "rank-*.safetensors"
            )

    # -- finding ------------------------------------------------------------------------------

    def list(self) -> list[Path]:
        """Complete checkpoints (``step-*`` directories with a manifest), oldest step first.

        Nothing is verified beyond the manifest's presence; ``load`` verifies.
        """
        return _complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None if there is none.

        ``.tmp-*`` directories (writes in progress or crashed) never count.
        """
        complete = self.list()
        return complete[-1] if complete else None

    def latest_step(self) -> int | None:
        """The step of :meth:`latest`, or None if there is no complete checkpoint."""
        path = self.latest()
        return None if path is None else int(_CHECKPOINT_NAME.match(path.name).group(1))

    def resolve(self, resume: str) -> Path | None:
        """Turn a ``--resume`` argument into a checkpoint directory.

        Args:
            resume: ``"auto"`` (the latest checkpoint, or None when there is none yet: a fresh
                start), or a path to one checkpoint directory: absolute, relative to the working
                directory, or a name inside ``root`` such as ``step-00000012``.

        Returns:
            The checkpoint's directory (its files are verified by ``load``, not here), or None.

        Raises:
            CheckpointError: the path does not exist, or is not a complete checkpoint (no
                manifest; a checkpoints folder rather than one checkpoint).
        """
        if resume == "auto":
            return self.latest()
        path = Path(resume).expanduser()
        if not path.exists() and not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        if not path.is_dir():
            hint = self.latest()
            raise CheckpointError(
                f"--resume {resume}: no such checkpoint directory. Pass `auto` or a checkpoint "
                f"directory" + (f", e.g. --resume {hint}" if hint else f" (none exist yet in {self.root})")
            )
        if not (path / MANIFEST).is_file():
            inside = _complete_checkpoints(path)
            if inside:
                raise CheckpointError(
                    f"--resume {resume}: {path} holds checkpoints but is not one itself; pass one of "
                    f"them, e.g. --resume {inside[-1]}, or `auto`"
                )
            raise CheckpointError(
                f"--resume {resume}: {path} has no {MANIFEST}, so it is not a complete checkpoint "
                f"(its write never finished, or it is another kind of directory); {self._older_hint(path)}"
            )
        return path

    # -- reading ------------------------------------------------------------------------------

    def verify(self, path: str | Path, *, hash_files: bool = True) -> dict:
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
        self._refuse_outside(path / MANIFEST, path)
        manifest = self._read_json(path / MANIFEST, path, what="manifest")
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if type(version) is not int or not isinstance(files, dict) or type(manifest.get("step")) is not int:
            raise self._damaged(path / MANIFEST, "lacks its format_version, step or file list", path)
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
                raise self._damaged(path / MANIFEST, f"has a malformed entry for {name!r}", path)
            self._refuse_outside(file, path)
            if not file.is_file():
                raise self._damaged(
                    file, f"is missing but the manifest lists it ({entry['bytes']:,} bytes)", path
                )
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise self._damaged(file, f"is {size:,} bytes but the manifest says {entry['bytes']:,}", path)
            digest = sha256_file(file) if hash_files else entry["sha256"]
            if digest != entry["sha256"]:
                raise self._damaged(
                    file,
                    f"has sha256 {digest[:16]}… but the manifest says {entry['sha256'][:16]}…: its bytes "
                    f"changed after it was written (a disk error or an edit)",
                    path,
                )
        if STATE not in files:
            raise self._damaged(path / STATE, "is not in the manifest", path)
        return manifest

    def load(self, path: str | Path, *, hash_files: bool = True) -> tuple[int, dict, dict[str, bytes]]:
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
        manifest = self.verify(path, hash_files=hash_files)
        files = manifest["files"]
        doc = self._read_json(path / STATE, path, what="state file")
        shard_names = doc.get("tensor_files") if isinstance(doc, dict) else None
        if not isinstance(shard_names, list) or "skeleton" not in doc:
            raise self._damaged(path / STATE, "lacks its tensor_files or skeleton", path)
        if doc.get("step") != manifest["step"]:
            raise self._damaged(
                path / STATE,
                f"is for step {doc.get('step')!r} but the manifest says {manifest['step']}",
                path,
            )
        tensors: dict[str, torch.Tensor] = {}
        for shard_name in shard_names:
            if (
                not isinstance(shard_name, str)
                or shard_name not in files
                or not _SHARD_NAME.match(shard_name)
            ):
                raise self._damaged(
                    path / str(shard_name), "is named by state.json but not in the manifest", path
                )
            try:
                shard = load_file(str(path / shard_name))
            except Exception as e:  # safetensors raises its own error type for unreadable files
                raise self._damaged(path / shard_name, f"cannot be read as safetensors ({e})", path) from e
            if tensors.keys() & shard.keys():
                raise self._damaged(path / shard_name, "repeats tensors of an earlier shard", path)
            tensors.update(shard)
        used: set[str] = set()
        state = decode_skeleton(doc["skeleton"], tensors, used)
        if used != tensors.keys():
            stray = sorted(tensors.keys() - used)[:5]
            raise self._damaged(path / STATE, f"does not refer to tensors {stray} of the tensor files", path)
        rank_files: set[str] = set()
        if "shards" in doc:
            where, union = read_union(
                doc["shards"], path, files, lambda file, problem: self._damaged(file, problem, path)
            )
            place(state, where, union, lambda problem: self._damaged(path / STATE, problem, path))
            rank_files = {name for part in doc["shards"]["ranks"] for name in part["tensor_files"]}
        extra = {}
        for name in files:
            if name == STATE or name in shard_names or name in rank_files:
                continue
            if _SHARD_NAME.match(name) or RANK_FILE.match(name):
                raise self._damaged(path / name, "is in the manifest but state.json does not use it", path)
            extra[name] = (path / name).read_bytes()
        return manifest["step"], state, extra

    def _read_json(self, file: Path, checkpoint: Path, *, what: str) -> Any:
        if not file.is_file():
            raise CheckpointError(
                f"{file} does not exist: {checkpoint} is not a complete checkpoint (its write never "
                f"finished, or the {what} was deleted); {self._older_hint(checkpoint)}"
            )
        try:
            return json.loads(file.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise self._damaged(file, f"is not valid JSON ({e})", checkpoint) from e

    def _refuse_outside(self, file: Path, checkpoint: Path) -> None:
        """A symlink in a checkpoint that leads outside it would make ``load`` read what it points
        to (with a manifest edited to match): refused, naming the file. One inside it is fine."""
        outside = escape(checkpoint, file)
        if outside is not None:
            raise self._damaged(
                file,
                f"{outside}: load reads only files inside the checkpoint directory",
                checkpoint,
            )

    def _damaged(self, file: Path, problem: str, checkpoint: Path) -> CheckpointError:
        return CheckpointError(f"{file} {problem}: the checkpoint is damaged; {self._older_hint(checkpoint)}")

    @staticmethod
    def _older_hint(checkpoint: Path) -> str:
        step = _checkpoint_step(checkpoint)
        older = [
            other
            for other in _complete_checkpoints(checkpoint.parent)
            if other != checkpoint and (step is None or (_checkpoint_step(other) or 0) < step)
        ]
        if older:
            return f"resume from an older one: --resume {older[-1]}"
        return f"no older checkpoint exists in {checkpoint.parent}: start the run afresh (without --resume)"
