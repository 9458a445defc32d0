"""The byte layout of a frozen weight kept compressed (``RunConfig.quantization``), in pure Python.

One rule for three readers: the parameter store sizes its host copy by it, the device unpacks
views of it (``runtime/quantized.py``), and the cost model counts its bytes over PCIe, in host RAM
and on the device. A compressed weight is one flat byte buffer, so it is uploaded, chunked and
released exactly like any other weight; its sections (byte ranges, each starting on a 4-byte
boundary so that a float32 section can be viewed in place):

- ``nf4`` (bitsandbytes' 4-bit NormalFloat with double quantization, blocks of 64 values): the
  4-bit codes, two per byte (first value in the high nibble); each block's absmax as an 8-bit code
  of bitsandbytes' dynamic map, quantized in blocks of 256 after subtracting their mean; the fp32
  absmax of each such block; that mean (fp32). About 0.516 bytes per value.
- ``int8`` (LLM.int8()'s weight format): one int8 per value, scaled per row (the last dimension)
  by ``127 / absmax``; the rows' fp32 absmax (bitsandbytes' ``SCB``). 1 + 4/row bytes per value.
- ``fp8`` (e4m3, per-row scales): one ``float8_e4m3fn`` per value, scaled per row to the format's
  largest finite value 448; the rows' fp32 scales. 1 + 4/row bytes per value.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

from roundpipe.errors import ConfigError

QUANTIZATIONS = ("nf4", "int8", "fp8")
NF4_BLOCK = 64  # values per absmax (bitsandbytes' default 4-bit blocksize)
NESTED_BLOCK = 256  # absmax values per second-level scale (bitsandbytes' double quantization)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127


@dataclass(frozen=True)
class QuantLayout:
    """Where each part of one compressed tensor of ``shape`` sits in its byte buffer."""

    format: str
    shape: tuple[int, ...]
    sections: tuple[tuple[str, int, int], ...]  # (name, first byte, end byte)

    @property
    def nbytes(self) -> int:
        return self.sections[-1][2]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows of the per-row formats: every dimension but the last."""
        return self.numel // self.shape[-1]

    def section(self, name: str) -> tuple[int, int]:
        for n, a, b in self.sections:
            if n == name:
                return a, b
        raise KeyError(name)


def check_quantization(value) -> None:
    """Raise :class:`ConfigError` unless ``value`` is None or one of :data:`QUANTIZATIONS`."""
    if value is not None and value not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (frozen weights in the "
            f"run dtype), got {value!r}"
        )


def _sections(parts: list[tuple[str, int]]) -> tuple[tuple[str, int, int], ...]:
    out, at = [], 0
    for name, size in parts:
        at = -(-at // 4) * 4
        out.append((name, at, at + size))
        at += size
    return tuple(out)


def quant_layout(fmt: str, shape: tuple[int, ...]) -> QuantLayout:
    """The layout of a tensor of ``shape`` (at least 2-D) compressed as ``fmt``."""
    check_quantization(fmt)
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ConfigError(f"only weights of 2 or more dimensions are kept compressed, not {shape}")
    n = prod(shape)
    if fmt == "nf4":
        blocks = ceil(n / NF4_BLOCK)
        nested = ceil(blocks / NESTED_BLOCK)
        parts = [("codes", ceil(n / 2)), ("absmax", blocks), ("absmax_scale", 4 * nested), ("offset", 4)]
    else:
        parts = [("values", n), ("scales", 4 * (n // shape[-1]))]
    return QuantLayout(fmt, shape, _sections(parts))


def quantized_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` compressed as ``fmt`` (host RAM, PCIe, device)."""
    return quant_layout(fmt, shape).nbytes


def bytes_per_value(fmt: str, row: int, count: int) -> float:
    """Bytes per value of ``count`` values in rows of ``row`` compressed as ``fmt`` (the cost
    model's figure for a linear's weight, from its exact layout)."""
    rows = max(1, count // max(row, 1))
    return quantized_bytes(fmt, (rows, max(row, 1))) / max(count, 1)


# How the device unpacks (``runtime/quantized.py``), for the cost model: pieces of at most
# UNPACK_VALUES values; beside the result a piece holds int32 indices and fp32 values (and, for
# int8, their product before its last scaling) -- UNPACK_TRANSIENT bytes per value; and it reads
# and writes UNPACK_TRAFFIC bytes per value besides writing the result: nf4 reads half a packed
# byte and writes an int32 index per byte (0.5 + 2), gathers fp32 value pairs (2 + 4), then scales
# them into the result (4); int8 and fp8 convert to fp32 (1 + 4) and scale (4; int8 4 + 4 more
# for its second factor). About six launches per piece.
UNPACK_VALUES = 1 << 25
UNPACK_TRANSIENT = {"nf4": 6, "int8": 9, "fp8": 5}
UNPACK_TRAFFIC = {"nf4": 12.5, "int8": 17.0, "fp8": 9.0}
UNPACK_LAUNCHES = 6
# The unpacking tables every block layer with a compressed weight holds (fp32: the NF4 value pair
# of each of the 256 byte values, then the 256-value dynamic map).
TABLE_VALUES = 2 * 256 + 256
TABLE_BYTES = 4 * TABLE_VALUES


@dataclass(frozen=True)
class PackedWeights:
    """A layer's weights kept compressed, as the cost model counts them."""

    values: int  # weights kept compressed
    packed_bytes: int  # their bytes (host RAM, PCIe, resident on the device), tables included
    unpacked_bytes: int  # in the run dtype, bound while the layer runs
    transient_bytes: int  # an unpack's largest piece beside its result
    traffic_bytes: float  # DRAM bytes the unpacks read and write
    launches: int


def packed_weights(fmt: str, tensors: list[tuple[int, int]], b: int) -> PackedWeights:
    """``tensors``: ``(values, row)`` of each compressed weight of a layer (a linear's weight: its
    ``fan_in * fan_out`` values in rows of ``fan_in``, times its copies for experts); ``b``: bytes
    of the run dtype the device unpacks into."""
    check_quantization(fmt)
    values = sum(n for n, _ in tensors)
    packed = sum(bytes_per_value(fmt, row, n) * n for n, row in tensors)
    return PackedWeights(
        values=values,
        packed_bytes=round(packed) + (TABLE_BYTES if tensors else 0),
        unpacked_bytes=values * b,
        transient_bytes=min(max((n for n, _ in tensors), default=0), UNPACK_VALUES) * UNPACK_TRANSIENT[fmt],
        traffic_bytes=values * (UNPACK_TRAFFIC[fmt] + b),
        launches=sum(-(-n // UNPACK_VALUES) for n, _ in tensors) * UNPACK_LAUNCHES,
    )


# AdamW's moments on the host (``OptimizerConfig.state_dtype``, ``optim/low_precision_state.py``):
# fp32, bf16, or bitsandbytes' 8-bit blockwise state (a code per value, an fp32 absmax per block).
STATE_DTYPES = ("fp32", "bf16", "int8")
STATE_BLOCK = 256


def moment_bytes_per_param(state_dtype: str) -> float:
    """Host bytes of AdamW's two moments per parameter (the fp32 master comes on top)."""
    if state_dtype not in STATE_DTYPES:
        raise ConfigError(
            f"optimizer state must be one of {', '.join(STATE_DTYPES)} (AdamW's moments on the host), "
            f"got {state_dtype!r}"
        )
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / STATE_BLOCK}[state_dtype]
