"""Frozen weights kept compressed: packed on the host, unpacked on the device inside a layer's task.

``RunConfig.quantization`` (``nf4``, ``int8`` or ``fp8``) keeps every frozen weight a block layer
multiplies with -- an ``nn.Linear``'s weight, and fused expert tensors of 3 or more dimensions --
as one flat byte buffer in the layout of ``partition/quant_layout.py``. The store fills it once
(:func:`pack`: from the model's tensor, or from the checkpoint one tensor at a time, so no
full-precision copy of the model is ever held), the device uploads those bytes like any weight,
and binding the layer for a task unpacks them in the run dtype on the compute stream
(:func:`unpack`), so the full-precision weight lives on the device only while the layer runs (a
forward) or while its stage backpropagates (autograd keeps what the matmuls read).

The ``nf4`` and ``int8`` packings are bitsandbytes' own (``quantize_4bit(..., quant_type="nf4",
compress_statistics=True)`` with blocks of 64; ``int8_vectorwise_quant``'s int8 rows and ``SCB``),
written here in torch so that they run wherever torch does, bitsandbytes installed or not; the
unpacking computes what bitsandbytes' ``dequantize_4bit`` does, in fp32, then casts. Tests check
both against bitsandbytes where it is installed. Unpacking works on the meta device (the virtual
server) as on any other.
"""

from __future__ import annotations

import torch
from torch import nn

from roundpipe.number_codes import NF4_VALUES, blockwise, dynamic_map, nearest
from roundpipe.partition import quant_layout as rules
from roundpipe.partition.quant_layout import (
    FP8_MAX,
    INT8_MAX,
    NESTED_BLOCK,
    NF4_BLOCK,
    TABLE_VALUES,
    QuantLayout,
)

TABLES_NAME = "roundpipe.quantization_tables"  # the store entry that carries them to each device


def table_bytes() -> torch.Tensor:
    """The constant tables an unpack reads, as bytes (a uint8 CPU tensor): a frozen store entry
    every block layer with a compressed weight holds (``ParameterStore``), so each device gets
    them with the layer's weights, copied like them and released with them -- no host sync, no
    tensor shared between devices, nothing kept across steps."""
    nf4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack((nf4[byte >> 4], nf4[byte & 0xF]), dim=1)  # high nibble first
    dynamic = dynamic_map()
    return torch.cat((pairs.reshape(-1), dynamic)).view(torch.uint8)


class Tables:
    """Views of the tables' bytes (:func:`table_bytes`, on whatever device they are)."""

    def __init__(self, raw: torch.Tensor):
        values = raw.view(torch.float32)
        self.nf4_pairs = values[:512].view(256, 2)
        self.nf4 = self.nf4_pairs[::16, 0]  # each value once, sorted
        self.dynamic = values[512:TABLE_VALUES]


def _section(buf: torch.Tensor, layout: QuantLayout, name: str, dtype: torch.dtype = torch.uint8):
    a, b = layout.section(name)
    part = buf[a:b]
    return part if dtype == torch.uint8 else part.view(dtype)


@torch.no_grad()
def pack(weight: torch.Tensor, layout: QuantLayout, out: torch.Tensor) -> None:
    """Compress ``weight`` (any float dtype, shape ``layout.shape``) into ``out`` (uint8,
    ``layout.nbytes``), on ``out``'s device."""
    if out.is_meta:  # the virtual server: shapes, no data
        return
    x = weight.detach().to(device=out.device, dtype=torch.float32).reshape(-1)
    if layout.format == "nf4":
        scaled, absmax = blockwise(x, NF4_BLOCK)
        tables = Tables(table_bytes().to(x.device))
        codes = nearest(torch.nn.functional.pad(scaled, (0, scaled.numel() % 2)), tables.nf4)
        _section(out, layout, "codes").copy_((codes[0::2] << 4) | codes[1::2])
        offset = absmax.mean()
        nested, scale = blockwise(absmax - offset, NESTED_BLOCK)
        _section(out, layout, "absmax").copy_(nearest(nested, tables.dynamic))
        _section(out, layout, "absmax_scale", torch.float32).copy_(scale)
        _section(out, layout, "offset", torch.float32).copy_(offset.reshape(1))
        return
    rows = x.view(layout.rows, -1)
    absmax = rows.abs().amax(dim=1)
    if layout.format == "int8":
        # bitsandbytes' row-wise int8: round(w * 127 / absmax), the absmax kept as SCB
        values = torch.round(rows * (INT8_MAX / absmax.clamp(min=1e-38)).unsqueeze(1)).to(torch.int8)
        _section(out, layout, "values", torch.int8).copy_(values.reshape(-1))
        _section(out, layout, "scales", torch.float32).copy_(absmax)
    else:
        scale = absmax / FP8_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = (rows / safe.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        _section(out, layout, "values", torch.float8_e4m3fn).copy_(values.reshape(-1))
        _section(out, layout, "scales", torch.float32).copy_(scale)


def unpack(
    buf: torch.Tensor, layout: QuantLayout, dtype: torch.dtype, tables: Tables | None = None
) -> torch.Tensor:
    """The weight ``buf`` holds, in ``dtype`` on ``buf``'s device (computed in fp32, then cast);
    ``tables``: :func:`table_bytes` on that device (made here when None, off the workers).

    Unpacked in pieces of at most ``quant_layout.UNPACK_VALUES`` values, so that beside the result
    only one piece's fp32 values and indices are alive, whatever the tensor's size (one layer's
    fused experts can hold billions of values); each piece is a few passes over memory, the last
    one writing the result in ``dtype`` (the cost model counts both: ``quant_layout.py``)."""
    n = layout.numel
    tables = tables or Tables(table_bytes().to(buf.device))
    out = torch.empty(n, dtype=dtype, device=buf.device)
    step = _piece_values(layout)
    for a in range(0, n, step):
        b = min(n, a + step)
        if layout.format == "nf4":
            _unpack_nf4(buf, layout, a, b, out[a:b], tables)
        else:
            _unpack_rows(buf, layout, a, b, out[a:b])
    return out.view(layout.shape)


def _piece_values(layout: QuantLayout) -> int:
    """Values per piece: whole second-level nf4 blocks, or whole rows."""
    unit = NF4_BLOCK * NESTED_BLOCK if layout.format == "nf4" else layout.shape[-1]
    return max(1, rules.UNPACK_VALUES // unit) * unit


def _unpack_nf4(
    buf: torch.Tensor, layout: QuantLayout, a: int, b: int, out: torch.Tensor, tables: Tables
) -> None:
    """Values ``[a, b)`` of an nf4 buffer into ``out`` (``a`` on a second-level block boundary)."""
    nested = NF4_BLOCK * NESTED_BLOCK
    codes = _section(buf, layout, "absmax")[a // NF4_BLOCK : -(-b // NF4_BLOCK)]
    scale = _section(buf, layout, "absmax_scale", torch.float32)[a // nested : -(-b // nested)]
    offset = _section(buf, layout, "offset", torch.float32)
    absmax = torch.index_select(tables.dynamic, 0, codes.to(torch.int32))
    absmax = _per_block(absmax, scale, NESTED_BLOCK) + offset
    packed = _section(buf, layout, "codes")[a // 2 : -(-b // 2)]
    values = torch.index_select(tables.nf4_pairs, 0, packed.to(torch.int32)).view(-1)[: b - a]
    _scale_into(out, values, absmax, NF4_BLOCK)


def _unpack_rows(buf: torch.Tensor, layout: QuantLayout, a: int, b: int, out: torch.Tensor) -> None:
    """Values ``[a, b)`` (whole rows) of an int8 or fp8 buffer into ``out``."""
    row = layout.shape[-1]
    kind = torch.int8 if layout.format == "int8" else torch.float8_e4m3fn
    values = _section(buf, layout, "values", kind)[a:b].to(torch.float32).view(-1, row)
    scales = _section(buf, layout, "scales", torch.float32)[a // row : b // row].unsqueeze(1)
    if layout.format == "int8":  # as bitsandbytes' dequant: times the absmax, then times 1/127
        torch.mul(values * scales, 1.0 / INT8_MAX, out=out.view(-1, row))
    else:
        torch.mul(values, scales, out=out.view(-1, row))


def _scale_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """``out = values * scale of their block of ``block```` (flat; a short last block allowed)."""
    n = values.numel()
    full = n - n % block
    if full:
        torch.mul(
            values[:full].view(-1, block),
            scales[: full // block].unsqueeze(1),
            out=out[:full].view(-1, block),
        )
    if full < n:
        out[full:] = values[full:] * scales[full // block]


def _per_block(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` (flat) times the scale of their block of ``block``, in a new tensor."""
    out = torch.empty_like(values)
    _scale_into(out, values, scales, block)
    return out


def quantizable(module: nn.Module, attr: str, t: torch.Tensor) -> bool:
    """Whether a frozen tensor of a block layer is kept compressed: an ``nn.Linear``'s weight, or a
    parameter of 3 or more dimensions (fused experts); floating point. Norms, biases, routers'
    own weight tensors and buffers stay in the run dtype."""
    if not t.is_floating_point() or t.dim() < 2:
        return False
    return (isinstance(module, nn.Linear) and attr == "weight") or t.dim() >= 3
