"""The sharded part of a checkpoint: a dict split across ranks by key, one set of files per rank.

With ``optimizer_sharding: nodes`` each rank holds the AdamW state of the parameters it owns and
no other rank holds it, so every rank writes its own part (``Shard``) into the checkpoint's write
directory: ``rank-00001-of-00004.safetensors`` (``-part-00002-of-00003`` when it is cut into files
of ``shard_bytes``). The rank hashes what it wrote and hands rank 0 the names, sizes, sha256 and
the JSON skeleton of its part (``write_rank_part``); rank 0 puts the skeletons into ``state.json``
and the files into the one manifest (``CheckpointManager.save`` does the exchange).

Reading needs no rank count: ``ShardUnion`` is the union of every rank's part, by key, read lazily
from the files (a key's tensors are read when it is looked up), so a resumed rank that owns a few
parameters reads only theirs, whatever the number of ranks that wrote the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roundpipe.errors import CheckpointError
from roundpipe.train.tensor_files import (
    flatten_state,
    sha256_file,
    shard_groups,
    unflatten_state,
    write_shard,
)

RANK_FILE = re.compile(r"^rank-(\d{5})-of-(\d{5})(-part-(\d{5})-of-(\d{5}))?\.safetensors$")


@dataclass(frozen=True)
class Shard:
    """This rank's part of a dict that the ranks split by key.

    ``path``: where the whole dict sits in the checkpoint's state (e.g. ``("pipeline",
    "optimizer", "state")``); the state rank 0 saves leaves it out, and ``load`` puts the union
    of every rank's ``part`` there. ``part``: this rank's keys and their values (anything
    ``flatten_state`` stores)."""

    path: tuple[str, ...]
    part: Mapping[Any, Any]

    def __post_init__(self):
        if not self.path or not all(isinstance(k, str) for k in self.path):
            raise CheckpointError(f"a shard's path is a non-empty tuple of dict keys, got {self.path!r}")
        if not isinstance(self.part, Mapping):
            raise CheckpointError(f"a shard's part is a dict, got a {type(self.part).__qualname__}")


def rank_file_names(rank: int, world_size: int, count: int) -> list[str]:
    head = f"rank-{rank:05d}-of-{world_size:05d}"
    if count == 1:
        return [f"{head}.safetensors"]
    return [f"{head}-part-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_rank_part(tmp: Path, shard: Shard, rank: int, world_size: int, shard_bytes: int) -> dict:
    """Write this rank's part into ``tmp``; return what rank 0 needs to seal the checkpoint:
    ``{"rank", "tensor_files", "skeleton", "files": {name: {bytes, sha256}}}``."""
    tensors, skeleton = flatten_state(dict(shard.part))
    names: list[str] = []
    if tensors:
        groups = shard_groups(tensors, shard_bytes)
        names = rank_file_names(rank, world_size, len(groups))
        for name, group in zip(names, groups):
            write_shard(tmp / name, group)
    files = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in names
    }
    return {"rank": rank, "tensor_files": names, "skeleton": skeleton, "files": files}


def shards_doc(path: tuple[str, ...], parts: list[dict]) -> dict:
    """The ``shards`` entry of ``state.json``: where the dict goes and each rank's files and skeleton."""
    return {
        "path": list(path),
        "world_size": len(parts),
        "ranks": [{k: part[k] for k in ("rank", "tensor_files", "skeleton")} for part in parts],
    }


def _tensor_refs(node: Any, out: set[str]) -> set[str]:
    """Every tensor name a skeleton node refers to (without reading a tensor)."""
    if isinstance(node, dict) and len(node) == 1:
        ((kind, body),) = node.items()
        if kind in ("tensor", "ndarray", "numpy_scalar") and isinstance(body, str):
            out.add(body)
        elif kind == "dict" and isinstance(body, list):
            for item in body:
                if isinstance(item, list) and len(item) == 2:
                    _tensor_refs(item[1], out)
        elif kind in ("list", "tuple") and isinstance(body, list):
            for item in body:
                _tensor_refs(item, out)
    return out


class _FileTensors(Mapping):
    """Tensor name -> tensor, read from the safetensors file that holds it when asked for."""

    def __init__(self, index: dict[str, Path]):
        self._index = index

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._index[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class ShardUnion(Mapping):
    """The union by key of every rank's part of a sharded dict (``Shard``), read lazily: looking a
    key up reads its tensors from that rank's file, so holding the union costs nothing until then.
    ``dict(union)`` reads all of it. Built by ``CheckpointManager.load`` after the manifest is
    verified; every file's tensor names are checked against the skeletons there (headers only)."""

    def __init__(self, entries: dict[Any, tuple[Any, _FileTensors]], world_size: int):
        self._entries = entries
        self.world_size = world_size  # how many ranks wrote it

    def __getitem__(self, key: Any) -> Any:
        node, tensors = self._entries[key]
        return unflatten_state(tensors, node)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ShardUnion({len(self)} keys written by {self.world_size} ranks)"


def read_union(
    doc: Any, checkpoint: Path, files: Mapping[str, Any], damaged
) -> tuple[tuple[str, ...], ShardUnion]:
    """Check ``state.json``'s ``shards`` entry against the manifest's ``files`` and the tensor files'
    headers, and return (path in the state, the union). ``damaged(file, problem)`` makes the error."""
    from safetensors import safe_open

    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("path"), list)
        or not doc["path"]
        or not all(isinstance(k, str) for k in doc["path"])
        or type(doc.get("world_size")) is not int
        or doc["world_size"] < 1
        or not isinstance(doc.get("ranks"), list)
    ):
        raise damaged(checkpoint / "state.json", "has a malformed shards entry")
    world = doc["world_size"]
    ranks = sorted(doc["ranks"], key=lambda r: r.get("rank", -1) if isinstance(r, dict) else -1)
    if [r.get("rank") if isinstance(r, dict) else None for r in ranks] != list(range(world)):
        raise damaged(
            checkpoint / "state.json",
            f"lists the shards of ranks {[r.get('rank') if isinstance(r, dict) else r for r in ranks]}, "
            f"not of every rank 0..{world - 1}",
        )
    entries: dict[Any, tuple[Any, _FileTensors]] = {}
    for part in ranks:
        rank, names, skeleton = part["rank"], part.get("tensor_files"), part.get("skeleton")
        if not isinstance(names, list) or not isinstance(skeleton, dict) or "dict" not in skeleton:
            raise damaged(checkpoint / "state.json", f"has a malformed shard entry for rank {rank}")
        index: dict[str, Path] = {}
        for name in names:
            match = RANK_FILE.match(name) if isinstance(name, str) else None
            if (
                match is None
                or int(match.group(1)) != rank
                or int(match.group(2)) != world
                or name not in files
            ):
                raise damaged(
                    checkpoint / str(name), f"is named by state.json for rank {rank} but not in the manifest"
                )
            try:
                with safe_open(str(checkpoint / name), framework="pt") as f:
                    keys = list(f.keys())
            except Exception as e:  # safetensors raises its own error type for unreadable files
                raise damaged(checkpoint / name, f"cannot be read as safetensors ({e})") from e
            for key in keys:
                if key in index:
                    raise damaged(checkpoint / name, f"repeats tensor {key!r} of another file of rank {rank}")
                index[key] = checkpoint / name
        refs = _tensor_refs(skeleton, set())
        if refs != index.keys():
            missing, stray = sorted(refs - index.keys())[:5], sorted(index.keys() - refs)[:5]
            raise damaged(
                checkpoint / "state.json",
                f"and rank {rank}'s tensor files disagree (named but absent: {missing}; present but unnamed: {stray})",
            )
        tensors = _FileTensors(index)
        body = skeleton["dict"]
        if not isinstance(body, list):
            raise damaged(checkpoint / "state.json", f"has a malformed shard entry for rank {rank}")
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int, bool)):
                raise damaged(checkpoint / "state.json", f"has a malformed key in rank {rank}'s shard")
            key, node = item
            if key in entries:
                raise damaged(checkpoint / "state.json", f"gives {key!r} to two ranks' shards")
            entries[key] = (node, tensors)
    return tuple(doc["path"]), ShardUnion(entries, world)


def place(state: Any, path: tuple[str, ...], value: Any, problem) -> None:
    """Put ``value`` at ``path`` in ``state``; ``problem(text)`` makes the error when the path's
    parent is not a dict or the key is there already."""
    node = state
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            raise problem(f"has no {'/'.join(path[:-1])} to put the shards in")
        node = node[key]
    if not isinstance(node, dict):
        raise problem(f"has no {'/'.join(path[:-1])} to put the shards in")
    if path[-1] in node:
        raise problem(f"holds {'/'.join(path)} both in the main state and in the shards")
    node[path[-1]] = value
