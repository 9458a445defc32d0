"""Exports of a trained model: a peft adapter directory, or a full model ``from_pretrained`` loads.

Call ``pipe.export_to(model)`` first: it writes the trained fp32 masters into the model.

- ``export_adapter(model, directory)``: the peft adapter only (``adapter_config.json`` +
  ``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base, directory)``.
- ``export_merged(model, directory, tokenizer=None, dtype=None)``: a plain HF model directory
  (``config.json``, ``generation_config.json``, ``model.safetensors`` or shards + index, the
  tokenizer if given) with every LoRA update merged into its base weight.

Both refuse a directory holding a symlink that leads outside it: the files are written by name
(some by transformers or peft), and writing through such a link would land elsewhere.

The merge trade-off. ``merge_and_unload`` on the training model would change it (the LoRA layers
are gone, the base weights -- the parameter store's compute copies -- hold the merged values), and
``merge_adapter`` + ``unmerge_adapter`` leaves the base weights off by round-off; on a deep copy it
holds the model twice in host RAM, which a large model cannot afford. ``export_merged`` instead
streams: it writes the safetensors files itself, one tensor at a time, and computes each merged
weight (``W + sum of the adapters' get_delta_weight``, in fp32, then cast) only while writing it.
The training model is never modified and the extra host memory is one tensor (the largest merged
weight, plus its cast), whatever the model's size. The cost: the files are written here rather
than by ``save_pretrained``, so the layout follows it by hand -- tied weights written once under
their first name, a MoE layer's fused experts split back into per-expert tensors (what
transformers' own ``save_pretrained`` writes), ``{"format": "pt"}`` metadata, 5 GB shards.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ConfigError
from roundpipe.train.loading import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, file_key, split_fused_experts
from roundpipe.train.paths import check_filled_dir

MAX_SHARD_BYTES = 5 << 30

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def export_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the LoRA adapter of a ``peft.PeftModel`` (``save_pretrained``, safetensors).

    Returns:
        The directory, holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        RecipeError: a symlink in ``directory`` leads outside it (it would be written through).
        ConfigError: ``model`` is not a peft model (a full fine-tune has no adapter: use
            ``export_merged``).
    """
    if not _is_peft(model):
        raise ConfigError(
            f"export_adapter needs a peft model (LoRA), got {type(model).__name__}: a full fine-tune has "
            f"no adapter; use export_merged"
        )
    directory = Path(directory)
    check_filled_dir(directory, "checkpoint.export", value=directory)  # peft picks the file names
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def export_merged(
    model: nn.Module,
    directory: str | os.PathLike,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    base_values: Mapping[int, Callable[[], torch.Tensor]] | None = None,
    merged_from: str | None = None,
) -> Path:
    """Write ``model`` as a full HF model directory, LoRA merged, without modifying ``model``.

    Args:
        model: a HF causal LM or a ``peft.PeftModel`` around one (LoRA adapters, active ones merged).
        directory: created if missing; weight files a previous export left there are replaced.
        tokenizer: saved alongside (``tokenizer.save_pretrained``) when given.
        dtype: the dtype of every floating tensor written (e.g. ``torch.bfloat16``); None keeps
            each one's dtype in ``model``. ``config.json`` records it.
        max_shard_bytes: the most bytes of tensors per safetensors file.
        base_values: for tensors of ``model`` that do not hold the values the run trained on (its
            weights kept compressed: ``ParameterStore.unpacked_weights``), keyed by ``id`` of the
            model's tensor, how to make those values; the LoRA update is merged into them.
        merged_from: what those values are (e.g. ``"nf4"``), recorded in ``config.json`` as
            ``roundpipe_merged_from``: the merged weights are the dequantized ones plus the update.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        RecipeError: a symlink in ``directory`` leads outside it (it would be written through).
        ConfigError: the model holds adapters this merge does not reproduce (DoRA, LoRA bias,
            ``modules_to_save``) or LoRA on a tied weight (merging would untie it).
    """
    base = model.get_base_model() if _is_peft(model) else model
    tensors = _merged_tensors(base, dtype, base_values or {})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    check_filled_dir(directory, "checkpoint.export", value=directory)  # HF writes config.json & co
    for old in [*directory.glob("model-*-of-*.safetensors"), directory / SINGLE_FILE, directory / INDEX_FILE]:
        if old.is_file():
            old.unlink()
    shards = _shards(tensors, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards):
        write_safetensors(directory / name, shard)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _save_config(base, directory, {t.dtype for t in tensors if t.dtype.is_floating_point}, merged_from)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an export: its name, shape and dtype in the file, and how to make it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_safetensors(path: Path, tensors: list[OutTensor]) -> None:
    """Write a safetensors file: the header from the shapes first, then each tensor as it is made
    (so one tensor at a time is in memory). Raises ``ValueError`` if a made tensor disagrees with
    its declared shape or dtype (a bug here, not user input)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            data = t.make().detach().contiguous()
            if tuple(data.shape) != t.shape or data.dtype != t.dtype:
                raise ValueError(
                    f"{t.name}: made {data.dtype} {list(data.shape)}, declared {t.dtype} {list(t.shape)}"
                )
            if data.numel():
                f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def _is_peft(model: nn.Module) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def _lora_targets(base: nn.Module) -> tuple[dict[int, list[tuple[nn.Module, str]]], set[int]]:
    """``({id(base weight): [(LoRA layer, adapter), ...]}, ids of every LoRA parameter)``."""
    try:
        from peft.tuners.lora import LoraLayer, ParamWrapper
    except ImportError:
        return {}, set()
    targets: dict[int, list[tuple[nn.Module, str]]] = {}
    lora_params: set[int] = set()
    for name, m in base.named_modules():
        if type(m).__name__ in ("ModulesToSaveWrapper", "TrainableTokensWrapper"):
            raise ConfigError(
                f"{name} is a peft {type(m).__name__}; export_merged merges LoRA only: export the adapter, or "
                f"merge with peft's merge_and_unload"
            )
        if not isinstance(m, LoraLayer):
            continue
        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
            lora_params |= {id(p) for p in getattr(m, attr).parameters()}
        inner = m.get_base_layer()
        weight = getattr(inner, m.parameter_name) if isinstance(m, ParamWrapper) else inner.weight
        for adapter in m.active_adapters:
            if adapter in m.merged_adapters or (
                adapter not in m.lora_A and adapter not in m.lora_embedding_A
            ):
                continue
            if m.use_dora.get(adapter) or m.lora_bias.get(adapter):
                raise ConfigError(
                    f"{name}: export_merged does not merge DoRA or LoRA bias adapters; export the adapter, or "
                    f"merge with peft's merge_and_unload"
                )
            targets.setdefault(id(weight), []).append((m, adapter))
    return targets, lora_params


def _merged_tensors(
    base: nn.Module, dtype: torch.dtype | None, base_values: Mapping[int, Callable[[], torch.Tensor]]
) -> list[OutTensor]:
    """Every tensor of the exported model in file order, each made on demand."""
    targets, lora_params = _lora_targets(base)
    seen: dict[int, str] = {}  # id(tensor) -> the name it is written under (tied weights: once)
    out: list[OutTensor] = []
    for name, t in base.state_dict(keep_vars=True).items():
        if id(t) in lora_params:
            continue
        if id(t) in seen:
            if id(t) in targets:
                raise ConfigError(
                    f"LoRA adapts {seen[id(t)]}, which is tied to {file_key(name)}: merging would untie them; "
                    f"export the adapter instead"
                )
            continue
        seen[id(t)] = file_key(name)
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        make = _maker(t, targets.get(id(t), []), out_dtype, base_values.get(id(t)))
        key = file_key(name)
        parts = split_fused_experts(key, tuple(t.shape))
        if parts is None:
            out.append(OutTensor(key, tuple(t.shape), out_dtype, make))
            continue
        whole = _OneTensorCache(make)
        for part_name, expert, rows in parts:
            shape = (rows[1] - rows[0], *t.shape[2:])
            out.append(OutTensor(part_name, shape, out_dtype, whole.slicer(expert, rows)))
    return out


def _maker(
    t: torch.Tensor,
    adapters: list[tuple[nn.Module, str]],
    dtype: torch.dtype,
    value: Callable[[], torch.Tensor] | None = None,
) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        with torch.no_grad():
            base = t.detach() if value is None else value()
            if not adapters:
                return base.to(dtype)
            merged = base.to(torch.float32, copy=True)
            for module, adapter in adapters:
                merged += module.get_delta_weight(adapter).to(torch.float32)
            return merged.to(dtype)

    return make


class _OneTensorCache:
    """Makes a fused tensor once for the consecutive writes of its per-expert parts."""

    def __init__(self, make: Callable[[], torch.Tensor]):
        self._make = make
        self._value: torch.Tensor | None = None
        self._left = 0

    def slicer(self, expert: int, rows: tuple[int, int]) -> Callable[[], torch.Tensor]:
        self._left += 1

        def part() -> torch.Tensor:
            if self._value is None:
                self._value = self._make()
            value = self._value[expert, rows[0] : rows[1]]
            self._left -= 1
            if self._left == 0:
                self._value = None  # the last part: let the fused tensor go
            return value

        return part


def _shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _save_config(
    base: nn.Module, directory: Path, float_dtypes: set[torch.dtype], merged_from: str | None = None
) -> None:
    config = copy.deepcopy(base.config)
    if merged_from is not None:
        config.roundpipe_merged_from = f"LoRA merged into {merged_from}-dequantized base weights"
    elif hasattr(config, "roundpipe_merged_from"):
        del config.roundpipe_merged_from
    if len(float_dtypes) == 1:
        config.dtype = str(next(iter(float_dtypes))).removeprefix("torch.")
    config.architectures = [type(base).__name__]
    if getattr(config, "auto_map", None):  # custom code: copy its files, as save_pretrained does
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(base, directory, config=config)
    config.save_pretrained(str(directory))
    generation = getattr(base, "generation_config", None)
    if generation is not None and getattr(base, "can_generate", lambda: False)():
        generation.save_pretrained(str(directory))
