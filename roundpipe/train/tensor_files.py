"""Nested training state as flat tensors plus a JSON skeleton, and the safetensors files they go in.

``flatten_state`` splits a nested structure (dicts, lists, tensors, numpy values, scalars) into a
dict of tensors keyed by path and a JSON-able skeleton; ``unflatten_state`` inverts it exactly.
``shard_groups`` cuts the tensors into files of a bounded size, ``write_shard`` writes one durably
and ``sha256_file`` hashes a file without holding it in memory. A checkpoint (``checkpoint.py``)
and each rank's part of one (``checkpoint_shards.py``) are written and read with these.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from roundpipe.errors import CheckpointError

_HASH_CHUNK = 8 * 1024**2


# ---------------------------------------------------------------------------------------------
# Nested state <-> flat tensors + JSON skeleton
# ---------------------------------------------------------------------------------------------


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split nested state into a flat dict of tensors and a JSON-able skeleton.

    ``state`` may nest dicts (keys ``str``, ``int`` or ``bool``), lists, tuples, tensors, numpy
    arrays and scalars, ``int``/``float``/``bool``/``str`` and ``None``. Each tensor is keyed by
    its path, e.g. ``state["optimizer"]["state"][3]["exp_avg"]`` becomes
    ``"optimizer/state/3/exp_avg"`` (a suffix ``~2``, ``~3``, ... keeps colliding paths apart),
    and the skeleton holds ``{"tensor": path}`` in its place. ``unflatten_state`` inverts this
    exactly: int keys stay int, tuples stay tuples, tensors keep dtype, shape and every bit.

    Skeleton nodes: plain JSON scalars for ``None``/bool/int/str/finite floats;
    ``{"float": "nan"|"inf"|"-inf"}``; ``{"dict": [[key, node], ...]}`` (order kept);
    ``{"list": [...]}``; ``{"tuple": [...]}``; ``{"tensor": path}``; ``{"ndarray": path}``;
    ``{"numpy_scalar": path}``. It dumps with ``json.dumps(..., allow_nan=False)``.

    The returned tensors are detached, on the CPU, dense and contiguous, and no two share
    storage (safetensors refuses shared storage), so aliased tensors are stored twice and come
    back as separate tensors. A CPU tensor that is already contiguous and owns its whole storage
    is *not* copied: the flat dict shares its memory, so do not modify the state until the save
    returns. ``requires_grad`` and tensor subclasses (``nn.Parameter``) are not kept; dict, tuple
    and scalar subclasses (``OrderedDict``, namedtuples, ``IntEnum``) come back as the base type.

    Raises:
        CheckpointError: a value of another type (its path is named), or a sparse, quantized or
            meta tensor.
    """
    flat: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()
    skeleton = _encode(state, (), flat, storages)
    return flat, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuild the nested state that ``flatten_state`` split into ``tensors`` and ``skeleton``.

    The tensors are used as they are (no copy): the result holds the very objects in
    ``tensors``. Tensors that the skeleton does not mention are ignored.

    Raises:
        CheckpointError: the skeleton is malformed or names a tensor missing from ``tensors``.
    """
    return decode_skeleton(skeleton, tensors, set())


def _encode(value: Any, path: tuple[str, ...], flat: dict, storages: set) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return _encode_float(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": _add_tensor(_storable(value, path), path, flat, storages)}
    if type(value).__module__ == "numpy":
        return _encode_numpy(value, path, flat, storages)
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if type(key) not in (str, int, bool):
                raise CheckpointError(
                    f"cannot store {_where(path)}: its key {key!r} is a {type(key).__qualname__}; "
                    f"checkpoint dict keys must be str or int"
                )
            items.append([key, _encode(item, (*path, str(key)), flat, storages)])
        return {"dict": items}
    if isinstance(value, (list, tuple)):
        nodes = [_encode(item, (*path, str(i)), flat, storages) for i, item in enumerate(value)]
        return {"list" if isinstance(value, list) else "tuple": nodes}
    if isinstance(value, bool):  # subclasses of the JSON scalars: keep the value, drop the class
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, str):
        return str(value)
    raise CheckpointError(
        f"cannot store {_where(path)}: it is a {type(value).__module__}.{type(value).__qualname__}; "
        f"a checkpoint holds dicts, lists, tuples, tensors, numpy arrays, numbers, strings and None. "
        f"Store its state_dict() or convert it to one of those"
    )


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _encode_numpy(value: Any, path: tuple[str, ...], flat: dict, storages: set) -> Any:
    import numpy as np

    if not isinstance(value, (np.ndarray, np.generic)):
        raise CheckpointError(f"cannot store {_where(path)}: it is a numpy {type(value).__qualname__}")
    array = np.ascontiguousarray(value)
    try:
        tensor = torch.from_numpy(array)
    except TypeError as e:
        raise CheckpointError(
            f"cannot store {_where(path)}: a numpy array of dtype {array.dtype} has no torch "
            f"equivalent ({e}); convert it to a numeric dtype"
        ) from e
    name = _add_tensor(_storable(tensor, path), path, flat, storages)
    return {"ndarray" if isinstance(value, np.ndarray) else "numpy_scalar": name}


def _storable(tensor: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise CheckpointError(
            f"cannot store {_where(path)}: a {tensor.layout} tensor on {tensor.device}"
            f"{' (quantized)' if tensor.is_quantized else ''}; checkpoints hold dense tensors with "
            f"data: convert it (e.g. .to_dense() or .dequantize()) first"
        )
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def _add_tensor(tensor: torch.Tensor, path: tuple[str, ...], flat: dict, storages: set) -> str:
    storage = tensor.untyped_storage()
    owner = (str(tensor.device), storage.data_ptr())
    whole = tensor.data_ptr() == storage.data_ptr() and tensor.nbytes == storage.nbytes()
    if storage.nbytes() and (owner in storages or not whole):
        tensor = tensor.clone()
        owner = (str(tensor.device), tensor.untyped_storage().data_ptr())
    if tensor.untyped_storage().nbytes():
        storages.add(owner)
    base = "/".join(path) or "tensor"
    name, n = base, 1
    while name in flat:
        n += 1
        name = f"{base}~{n}"
    flat[name] = tensor
    return name


def decode_skeleton(node: Any, tensors: Mapping[str, torch.Tensor], used: set[str]) -> Any:
    """The value a skeleton ``node`` stands for; adds the names of the tensors it takes to ``used``
    (a checkpoint's load checks that every tensor of its files was taken)."""
    if node is None or type(node) in (bool, int, float, str):
        return node
    if isinstance(node, dict) and len(node) == 1:
        ((kind, body),) = node.items()
        if kind == "dict" and isinstance(body, list):
            if not all(
                isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int, bool)
                for item in body
            ):
                raise CheckpointError(f"malformed dict node in the state skeleton: {str(node)[:200]}")
            return {key: decode_skeleton(item, tensors, used) for key, item in body}
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [decode_skeleton(item, tensors, used) for item in body]
            return items if kind == "list" else tuple(items)
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind in ("tensor", "ndarray", "numpy_scalar") and isinstance(body, str):
            if body not in tensors:
                raise CheckpointError(
                    f"the state skeleton refers to tensor {body!r}, which the tensor files do not hold"
                )
            used.add(body)
            tensor = tensors[body]
            if kind == "tensor":
                return tensor
            return tensor.numpy() if kind == "ndarray" else tensor.numpy()[()]
    raise CheckpointError(f"unknown node in the state skeleton: {str(node)[:200]}")


def _where(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "the state"


# ---------------------------------------------------------------------------------------------
# Files: durable writes, streaming hashes
# ---------------------------------------------------------------------------------------------


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors shard and fsync it (a test slows it down by replacing
    ``checkpoint.write_shard``)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    fsync_file(path)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 8 MiB chunks so a file of tens of GB never sits in memory."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def shard_groups(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``shard_bytes`` (a bigger tensor sits alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if groups[-1] and size + tensor.nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += tensor.nbytes
    return groups


__all__ = [
    "decode_skeleton",
    "flatten_state",
    "fsync_file",
    "sha256_file",
    "shard_groups",
    "unflatten_state",
    "write_shard",
]
