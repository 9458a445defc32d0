"""Build the model a recipe names, and read a HF directory's weights without a second copy in RAM.

``build_model(model_cfg, lora_cfg, seed)`` returns a ``LoadedModel``:

- ``model.path`` (a local HF directory): the model is built from its ``config.json`` under
  ``accelerate.init_empty_weights()`` -- every parameter on the meta device, buffers real -- in
  the checkpoint's dtype, LoRA added if enabled (the LoRA parameters are made on the CPU and
  initialised as peft does, seeded). ``weights`` is a ``SafetensorsWeights`` of the directory:
  ``roundpipe.wrap(model, config, weights=weights)`` reads each meta parameter straight into the
  parameter store's buffer for it, so host RAM holds the model once (``runtime/store.py``).
- ``model.config`` (config numbers): a randomly initialised model (seeded), LoRA if enabled;
  ``weights`` is None.

``SafetensorsWeights`` parses each safetensors header itself (8-byte little-endian length, then
JSON: ``dtype``, ``shape``, ``data_offsets`` per tensor) and reads a tensor with ``readinto``
straight into the destination's memory, or through a bounded temporary when the dtypes differ.
Files are never memory-mapped: mapped pages count in the process's resident memory, so mapping a
235B checkpoint would look (and be accounted) like a second copy.

Names: the store asks for the model's parameter names; ``file_key`` maps a peft model's names to
the checkpoint's, and a MoE layer's fused expert tensors (transformers >= 5) are assembled from the
checkpoint's per-expert tensors. Other transformers weight conversions (renames of legacy
checkpoints) are not applied: such a tensor is reported missing, by name.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.number_codes import NF4_VALUES, dynamic_values
from roundpipe.train.config import LoraConfig, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
READ_CHUNK_BYTES = 64 << 20  # the most a dtype conversion holds in a temporary at once
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header

# safetensors dtype names <-> torch dtypes (the subset torch has)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# transformers >= 5 holds a MoE layer's experts as fused 3-D tensors, while checkpoints (and its own
# save_pretrained) keep one 2-D tensor per expert: (fused name suffix, per-expert parts, in order
# along the expert's first dimension). The qwen2_moe-style rule of transformers' conversion_mapping.
_FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
    "mlp.experts.down_proj": ("down_proj.weight",),
}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lies in a safetensors file: ``offset`` is absolute (header included)."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: Path) -> dict[str, TensorRecord]:
    """The tensors of one safetensors file, from its header (no tensor data is read).

    Raises:
        CheckpointError: the file is truncated, its header is not valid safetensors JSON, a
            tensor's dtype is unknown, or its byte range disagrees with its shape and dtype.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{path} is truncated or not a safetensors file: its header claims {header_bytes:,} bytes "
                f"of {size:,}; download the file again"
            )
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({err})") from err
    data_start = 8 + header_bytes
    records = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name!r} has an unreadable header entry {info!r}") from err
        nbytes = math.prod(shape) * dtype.itemsize
        if stop - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {stop - start:,} bytes but {info['dtype']} {list(shape)} "
                f"needs {nbytes:,}"
            )
        if data_start + stop > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {data_start + stop:,} of {size:,}; "
                f"download the file again"
            )
        records[name] = TensorRecord(path, dtype, shape, data_start + start, nbytes)
    return records


NF4_STATE = ".quant_state.bitsandbytes__nf4"  # bitsandbytes' JSON quant state beside a packed weight


def _scb(key: str) -> str:
    """Where bitsandbytes saves an int8 weight's row scales: beside the module's ``weight``."""
    return key.removesuffix(".weight") + ".SCB"


class SafetensorsWeights:
    """The tensors of a HF model directory's ``model.safetensors`` or sharded
    ``model.safetensors.index.json``, read on demand into buffers the caller owns.

    Names are the model's parameter names; ``base_model.model.`` (a peft wrapper) and
    ``.base_layer`` (a LoRA-wrapped module) are stripped before looking a name up in the files, and
    a fused MoE expert tensor (``...mlp.experts.gate_up_proj`` / ``down_proj``) is assembled from
    the per-expert tensors when the files hold those. Every header is read and checked up front;
    tensor data only by ``fill``, which opens the file it reads and keeps no state between calls.

    Raises (on construction):
        ConfigError: ``directory`` is missing, or holds no safetensors weights (the message says
            how to convert ``.bin`` weights).
        CheckpointError: a shard the index names is missing, or a header is broken.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        files = _weight_files(self.directory)
        self.records: dict[str, TensorRecord] = {}
        for path in files:
            self.records.update(read_header(path))

    def stored_names(self) -> list[str]:
        """The tensor names as stored in the files."""
        return list(self.records)

    def __contains__(self, name: str) -> bool:
        key = file_key(name)
        return key in self.records or self._expert_parts(key) is not None

    def fill(self, name: str, out: torch.Tensor) -> None:
        """Write tensor ``name`` into ``out`` (a CPU tensor of its shape), converting its dtype.

        With matching dtypes and a contiguous ``out`` the bytes are read straight into ``out``;
        otherwise through a temporary of at most ``READ_CHUNK_BYTES`` (a whole tensor when ``out`` is
        not contiguous).

        Raises:
            CheckpointError: no tensor of that name, a shape that disagrees with ``out``, or a file
                that ends early.
        """
        key = file_key(name)
        out = out.detach()
        if key in self.records:
            self._read(key, out)
            return
        parts = self._expert_parts(key)
        if parts is None:
            raise CheckpointError(
                f"{self.directory} holds no tensor {key!r} (asked for {name!r}); the directory does not "
                f"match the model"
            )
        experts = parts[0]
        if out.ndim < 2 or out.shape[0] != len(experts):
            raise CheckpointError(
                f"{name}: the model's fused tensor has shape {list(out.shape)} but {self.directory} holds "
                f"{len(experts)} experts"
            )
        for e in range(len(experts)):
            row = 0
            for part in parts:
                rec = self.records[part[e]]
                rows = rec.shape[0] if rec.shape else 1
                self._read(part[e], out[e, row : row + rows], what=name)
                row += rows
            if row != out.shape[1]:
                raise CheckpointError(
                    f"{name}: expert {e}'s parts have {row} rows in {self.directory}, the model's {out.shape[1]}"
                )

    def packed_format(self, name: str) -> str | None:
        """The format tensor ``name`` is stored packed in by bitsandbytes (transformers'
        ``BitsAndBytesConfig``, then ``save_pretrained``): ``"nf4"`` (a 4-bit quant state beside it)
        or ``"int8"`` (int8 rows and the module's ``SCB``); None for a tensor stored as it is."""
        key = file_key(name)
        if key + NF4_STATE in self.records:
            return "nf4"
        return "int8" if _scb(key) in self.records and self.records[key].dtype == torch.int8 else None

    def fill_packed(self, name: str, layout, out: torch.Tensor) -> None:
        """Write the packed tensor ``name`` into ``out`` (uint8, ``layout.nbytes``) in roundpipe's
        layout of it (``partition/quant_layout.py``): the same codes and scales bitsandbytes
        stored, moved into their sections, after checking they are the format roundpipe unpacks.

        Raises:
            CheckpointError: another 4-bit type, block size or code table, or a shape that
                disagrees with the model's.
        """
        key = file_key(name)
        fmt = self.packed_format(name)
        if fmt != layout.format:
            raise CheckpointError(f"{name} is stored as {fmt or 'unpacked'}, not {layout.format}")

        def section(part: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            a, b = layout.section(part)
            return out[a:b].view(dtype)

        if fmt == "int8":
            self._read(key, section("values", torch.int8).view(layout.rows, -1), what=name)
            self._read(_scb(key), section("scales", torch.float32), what=name)
            return
        raw = torch.empty(self.records[key + NF4_STATE].shape, dtype=torch.uint8)
        self._read(key + NF4_STATE, raw)
        state = json.loads(bytes(raw.tolist()).decode())
        want = {"quant_type": "nf4", "blocksize": 64, "nested_blocksize": 256, "shape": list(layout.shape)}
        got = {k: state.get(k) for k in want}
        if got != want or "nested_offset" not in state:
            raise CheckpointError(
                f"{name}: {self.directory} stores it as {got}; roundpipe reads nf4 with blocks of 64, double "
                f"quantization in blocks of 256, shape {list(layout.shape)} (BitsAndBytesConfig(load_in_4bit=True, "
                f"bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True)); or load the unquantized checkpoint"
            )
        for table, values in ((".quant_map", NF4_VALUES), (".nested_quant_map", dynamic_values())):
            stored = torch.empty(len(values))
            self._read(key + table, stored, what=name)
            if not torch.equal(stored, torch.tensor(values, dtype=torch.float32)):
                raise CheckpointError(
                    f"{name}: {self.directory} packs it with another {table[1:]} than nf4's"
                )
        self._read(key, section("codes").view(self.records[key].shape), what=name)
        self._read(key + ".absmax", section("absmax"), what=name)
        self._read(key + ".nested_absmax", section("absmax_scale", torch.float32), what=name)
        section("offset", torch.float32).fill_(float(state["nested_offset"]))

    def _expert_parts(self, key: str) -> list[list[str]] | None:
        """Per part, the per-expert file names a fused expert tensor is made of (None: not one)."""
        for suffix, part_names in _FUSED_EXPERTS.items():
            if key == suffix or key.endswith("." + suffix):
                prefix = key.removesuffix(suffix.rsplit(".", 1)[1])  # ends with "experts."
                count = 0
                while f"{prefix}{count}.{part_names[0]}" in self.records:
                    count += 1
                parts = [[f"{prefix}{e}.{p}" for e in range(count)] for p in part_names]
                if count and all(n in self.records for part in parts for n in part):
                    return parts
        return None

    def _read(self, key: str, out: torch.Tensor, what: str | None = None) -> None:
        rec = self.records[key]
        if rec.shape != tuple(out.shape):
            raise CheckpointError(
                f"{what or key}: {rec.path.name} holds shape {list(rec.shape)}, the model expects "
                f"{list(out.shape)}; the directory does not match the model's config"
            )
        if rec.nbytes == 0:
            return
        with open(rec.path, "rb", buffering=0) as f:
            f.seek(rec.offset)
            if rec.dtype == out.dtype and out.is_contiguous():
                _read_exact(f, out, rec)
            elif not out.is_contiguous():
                tmp = torch.empty(rec.shape, dtype=rec.dtype)
                _read_exact(f, tmp, rec)
                out.copy_(tmp)
            else:
                flat = out.view(-1)
                step = max(1, READ_CHUNK_BYTES // rec.dtype.itemsize)
                tmp = torch.empty(min(step, flat.numel()), dtype=rec.dtype)
                for start in range(0, flat.numel(), step):
                    chunk = tmp[: min(step, flat.numel() - start)]
                    _read_exact(f, chunk, rec)
                    flat[start : start + chunk.numel()].copy_(chunk)


def split_fused_experts(key: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, int]]] | None:
    """How a fused MoE expert tensor is written per expert, the inverse of what ``fill`` reads:
    ``[(file name, expert, (first row, end row) of out[expert])]``; None for any other tensor."""
    for suffix, part_names in _FUSED_EXPERTS.items():
        if len(shape) == 3 and (key == suffix or key.endswith("." + suffix)):
            prefix = key.removesuffix(suffix.rsplit(".", 1)[1])
            rows = shape[1] // len(part_names)
            return [
                (f"{prefix}{e}.{part}", e, (i * rows, (i + 1) * rows))
                for e in range(shape[0])
                for i, part in enumerate(part_names)
            ]
    return None


def file_key(name: str) -> str:
    """The name a model parameter has in a HF checkpoint: without peft's ``base_model.model.``
    prefix and LoRA's ``.base_layer`` level."""
    name = name.removeprefix("base_model.model.")
    return re.sub(r"\.base_layer(?=\.)", "", name)


def _read_exact(f, dest: torch.Tensor, rec: TensorRecord) -> None:
    """Fill contiguous ``dest`` with the next bytes of ``f`` (``readinto`` may return fewer)."""
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{rec.path} ended early while reading a tensor; download the file again")
        got += n


def _weight_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ConfigError(
            f"model.path {str(directory)!r} is not a directory: give a local Hugging Face model directory "
            f"(config.json + model*.safetensors), e.g. one made by `huggingface-cli download`"
        )
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"{directory} has no config.json; give a Hugging Face model directory (config.json + "
            f"model*.safetensors)"
        )
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {err}") from err
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names shards that are missing: {', '.join(missing)}; download them again"
            )
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    if any(directory.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"{directory} holds only PyTorch .bin weights; roundpipe reads safetensors (no pickle, no "
            f"second copy in RAM). Convert once with transformers: AutoModelForCausalLM.from_pretrained"
            f"(dir).save_pretrained(new_dir) writes safetensors (it needs RAM for the model once)"
        )
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    raise ConfigError(
        f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}"
        + (f" (found {', '.join(others)})" if others else "")
        + "; give a Hugging Face model directory saved with save_pretrained (safetensors)"
    )


@dataclass
class LoadedModel:
    """What ``build_model`` returns.

    Attributes:
        model: the HF causal LM, or the ``peft.PeftModel`` around it when LoRA is enabled.
        weights: for a model loaded from a directory, the source of its meta parameters: pass it as
            ``roundpipe.wrap(model, config, weights=weights)``. None for a model built from config
            numbers (its weights are real).
    """

    model: nn.Module
    weights: SafetensorsWeights | None


def build_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, seed: int) -> LoadedModel:
    """The model of a recipe's ``model:`` and ``lora:`` sections (see the module docstring).

    Args:
        model_cfg: ``path`` (a local HF directory) or ``config`` (a dict with ``model_type`` and
            that family's config fields); ``trust_remote_code`` is passed to transformers.
        lora_cfg: LoRA through peft when ``enabled`` (rank, alpha, dropout, target modules).
        seed: seeds the random initialisation (every weight of a ``config`` model; the LoRA
            parameters of a loaded one). The same seed gives the same model.

    Raises:
        ConfigError: neither or both of ``path`` and ``config``; a missing directory, one without
            safetensors weights; a config dict without a known ``model_type``.
        CheckpointError: a broken or incomplete safetensors file set.
    """
    if (model_cfg.path is None) == (model_cfg.config is None):
        raise ConfigError("set exactly one of model.path (a HF directory) and model.config (config numbers)")
    import transformers

    remote = bool(model_cfg.trust_remote_code)
    if model_cfg.path is not None:
        weights = SafetensorsWeights(model_cfg.path)
        import accelerate

        config = transformers.AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=remote)
        with accelerate.init_empty_weights():  # parameters on meta, buffers real
            model = transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=remote, dtype=_checkpoint_dtype(config, weights)
            )
        model.tie_weights()  # init_empty_weights re-creates each assigned parameter: ties are lost
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if not buf.is_meta and name in weights:  # persistent buffers saved in the checkpoint
                    weights.fill(name, buf)
        if lora_cfg.enabled:
            model = _add_lora(model, lora_cfg)
            _materialize_lora(model, seed)
        return LoadedModel(model, weights)

    fields = dict(model_cfg.config)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError("model.config needs model_type: the HF family, e.g. qwen3 or llama")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"model.config: {err}") from err
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    if lora_cfg.enabled:
        model = _add_lora(model, lora_cfg)
    return LoadedModel(model, None)


def _checkpoint_dtype(config: Any, weights: SafetensorsWeights) -> torch.dtype:
    """The dtype the checkpoint was saved in: its config's, else its most common float dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    counts: dict[torch.dtype, int] = {}
    for rec in weights.records.values():
        if rec.dtype.is_floating_point:
            counts[rec.dtype] = counts.get(rec.dtype, 0) + rec.nbytes
    return max(counts, key=counts.get) if counts else torch.float32


def _add_lora(model: nn.Module, lora_cfg: LoraConfig) -> nn.Module:
    import peft

    config = peft.LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft reads `model.is_gradient_checkpointing`, which transformers 5 deprecated for
        # `is_activation_checkpointing` (same value) with a FutureWarning on every run; the call is
        # peft's, and older transformers, without the new name, do not warn.
        if hasattr(type(model), "is_activation_checkpointing"):
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
        return peft.get_peft_model(model, config)


def _materialize_lora(model: nn.Module, seed: int) -> None:
    """peft leaves the LoRA parameters on meta when the base layer is: make them on the CPU and
    initialise them with peft's own ``reset_lora_parameters`` (A kaiming-uniform, B zeros; an
    embedding's A zeros, B normal), seeded. The base layers stay on meta for the store to fill."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters: dict[str, None] = {}
        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            container = getattr(module, attr)
            if any(p.is_meta for p in container.parameters()):
                container.to_empty(device="cpu")
                adapters.update(dict.fromkeys(container.keys()))
        for adapter in adapters:
            module.reset_lora_parameters(adapter, True)
    left = [n for n, p in model.named_parameters() if p.is_meta and p.requires_grad]
    if left:
        raise ConfigError(
            f"LoRA parameters {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} could not be made "
            f"without the base weights (DoRA and trainable modules_to_save need them); use plain LoRA"
        )
