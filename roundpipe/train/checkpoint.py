"""Checkpoints on disk: nested training state in, a verified directory out, and back.

The trainer hands ``CheckpointManager.save`` one nested structure (master weights or LoRA adapters,
optimizer, LR scheduler, loss scaler, RNG states, data position, ...). This module knows nothing
about pipelines: it splits that structure into tensors and a JSON skeleton (``flatten_state`` of
``tensor_files.py``), writes them as safetensors shards plus ``state.json``, and seals the
directory with a manifest of every file's size and sha256. A write is atomic: it happens in a
``.tmp-*`` directory that is renamed into place only when complete, so a crash at any instant
leaves the previous checkpoints intact. ``load`` verifies the manifest before it trusts a byte
(``checkpoint_reading.py``); the names of the files are ``checkpoint_layout.py``'s.

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
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.testing import faults
from roundpipe.train.checkpoint_layout import (
    CHECKPOINT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    REPLACED_PREFIX,
    STATE,
    TMP_PREFIX,
    checkpoint_step,
    complete_checkpoints,
    older_hint,
    tensor_file_names,
)
from roundpipe.train.checkpoint_ranks import ALONE, Failed, on_every_rank, on_rank_0
from roundpipe.train.checkpoint_reading import load_checkpoint, verify_checkpoint
from roundpipe.train.checkpoint_shards import Shard, shards_doc, write_rank_part
from roundpipe.train.tensor_files import (
    flatten_state,
    fsync_file,
    sha256_file,
    shard_groups,
    write_shard,
)

SHARD_BYTES = 2 * 1024**3


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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


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
        group = group if group is not None else ALONE
        main = group.rank == 0
        final = self.root / f"step-{step:08d}"
        tmp: Path | None = None
        prepared = None
        try:
            # 1. Rank 0 checks what it is to write and opens the write directory for every rank.
            opened = on_rank_0(
                group, lambda: self._open(final.name, state, extra_files), main, public=lambda r: r[1].name
            )
            if isinstance(opened, Failed):
                raise CheckpointError(f"checkpoint {final} not written: rank 0 {opened.text}")
            prepared, tmp = opened if main else (None, self.root / opened)
            # 2. Every rank writes its files (rank 0 the state's tensors too) and says what they are.
            parts = on_every_rank(group, lambda: self._write_part(tmp, step, group, shard, prepared))
            failed = [(rank, part) for rank, part in enumerate(parts) if isinstance(part, Failed)]
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
            sealed = on_rank_0(group, lambda: self._seal(tmp, final, step, prepared, parts), main)
            if isinstance(sealed, Failed):
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
            tmp = self.root / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory in {self.root}: {e}") from e
        return _Prepared(tensors, skeleton, extra), tmp

    def _write_part(self, tmp: Path, step: int, group, shard: Shard | None, prepared) -> dict:
        """This rank's files: rank 0 the state's tensor shards; every rank its ``shard``'s part."""
        written: dict = {"shard": None}
        if prepared is not None:
            groups = shard_groups(prepared.tensors, self.shard_bytes)
            written["tensor_files"] = tensor_file_names(len(groups))
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
            aside = self.root / f"{REPLACED_PREFIX}{final.name}-{secrets.token_hex(4)}"
            os.rename(final, aside)
            os.rename(tmp, final)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)

    def _clean(self, keep: Path) -> None:
        doomed = [
            entry for entry in self.root.iterdir() if entry.name.startswith((TMP_PREFIX, REPLACED_PREFIX))
        ]
        complete = self.list()
        # A damaged checkpoint (a file missing or of another size) counts for nothing and is left
        # for the user to look at: keep_last good ones stay, and the only good one is never deleted.
        good = [c for c in complete if c == keep or self._sizes_match(c)]
        newest = set(good[-self.keep_last :]) | {keep}
        for old in good:
            if old not in newest:
                # Rename first so a crash mid-delete leaves a .tmp-* leftover, never a half checkpoint.
                dying = self.root / f"{TMP_PREFIX}deleting-{old.name}-{secrets.token_hex(4)}"
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

    @staticmethod
    def _sizes_match(path: Path) -> bool:
        """The cheap check (names, presence, sizes; no hashing) that ``path`` is whole."""
        try:
            verify_checkpoint(path, hash_files=False)
        except CheckpointError:
            return False
        return True

    def _restore_replaced(self) -> None:
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            if not entry.name.startswith(REPLACED_PREFIX) or not (entry / MANIFEST).is_file():
                continue
            original = self.root / entry.name[len(REPLACED_PREFIX) :].rsplit("-", 1)[0]
            if checkpoint_step(original) is not None and not original.exists():
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
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None if there is none.

        ``.tmp-*`` directories (writes in progress or crashed) never count.
        """
        complete = self.list()
        return complete[-1] if complete else None

    def latest_step(self) -> int | None:
        """The step of :meth:`latest`, or None if there is no complete checkpoint."""
        path = self.latest()
        return None if path is None else int(CHECKPOINT_NAME.match(path.name).group(1))

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
            return self._newest_whole()
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
            inside = complete_checkpoints(path)
            if inside:
                raise CheckpointError(
                    f"--resume {resume}: {path} holds checkpoints but is not one itself; pass one of "
                    f"them, e.g. --resume {inside[-1]}, or `auto`"
                )
            raise CheckpointError(
                f"--resume {resume}: {path} has no {MANIFEST}, so it is not a complete checkpoint "
                f"(its write never finished, or it is another kind of directory); {older_hint(path)}"
            )
        return path

    def _newest_whole(self) -> Path | None:
        """``--resume auto``: the checkpoint of the highest step, None when there is none. When
        that one is damaged (no manifest, a file missing or of another size) it is an error naming
        it and the newest whole one before it: an older checkpoint is never taken silently."""
        if not self.root.is_dir():
            return None
        found = sorted(
            (step, entry)
            for entry in self.root.iterdir()
            if (step := checkpoint_step(entry)) is not None and entry.is_dir()
        )
        if not found:
            return None
        newest = found[-1][1]
        try:
            verify_checkpoint(newest, hash_files=False)
        except CheckpointError as err:
            whole = [entry for _, entry in reversed(found[:-1]) if self._sizes_match(entry)]
            then = (
                f"resume from the newest whole one with --resume {whole[0]}"
                if whole
                else f"no older whole checkpoint exists in {self.root}: start afresh with --overwrite"
            )
            reason = (
                f"it has no {MANIFEST} (removed, or lost with the disk)"
                if not (newest / MANIFEST).exists()
                else str(err).split(": the checkpoint is damaged")[0]
            )
            raise CheckpointError(
                f"--resume auto: the newest checkpoint {newest} is damaged: {reason}. roundpipe does "
                f"not fall back to an older one by itself: {then} (a later save of step "
                f"{checkpoint_step(newest)} replaces the damaged one), or repair {newest}"
            ) from err
        return newest

    # -- reading ------------------------------------------------------------------------------

    def verify(self, path: str | Path, *, hash_files: bool = True) -> dict:
        """Check every file of a checkpoint against its manifest; return the manifest.
        ``verify_checkpoint`` says what is checked and refused."""
        return verify_checkpoint(path, hash_files=hash_files)

    def load(self, path: str | Path, *, hash_files: bool = True) -> tuple[int, dict, dict[str, bytes]]:
        """Verify a checkpoint, then read it back: ``(step, state, extra_files)``, as
        ``load_checkpoint`` says."""
        return load_checkpoint(path, hash_files=hash_files)
