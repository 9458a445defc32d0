"""Module shells: a device's structural copies of the model's layers, bound to its weights per task.

A worker runs a layer by binding the device copies of its weights into a shell of the layer (every
parameter and buffer on the meta device otherwise) and unbinding them once the layer's work, and
its autograd graph, is done: a shell that kept them would keep every layer the device has ever run
alive on it. A weight kept compressed (``RunConfig.quantization``) is unpacked as it is bound, so
its full-precision copy lives exactly as long as the binding. ``device_tensors`` lists what a value holds on a device, for the memory ledger.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from roundpipe.models.base import ModelAdapter
from roundpipe.runtime.quantized import Tables, unpack
from roundpipe.runtime.store import ParameterStore, Piece


def make_shell(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` with every parameter and buffer on the meta device."""
    memo: dict[int, object] = {}
    for p in module.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def device_tensors(value, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The distinct-storage tensors inside ``value`` (dataclasses, dicts, lists, tuples, modules'
    parameters and buffers), skipping storages in ``seen`` (which it extends)."""
    out: list[torch.Tensor] = []
    _collect(value, set() if seen is None else seen, out)
    return out


def _collect(v, seen: set[int], out: list[torch.Tensor]) -> None:
    # A plain recursive function: a nested closure that calls itself is a reference cycle, which
    # would keep the tensors it collected alive until the cycle collector runs.
    if isinstance(v, torch.Tensor):
        ptr = v.untyped_storage().data_ptr()
        if v.device.type != "meta" and v.numel() and ptr not in seen:
            seen.add(ptr)
            out.append(v)
    elif isinstance(v, nn.Module):
        for t in (*v.parameters(), *v.buffers()):
            _collect(t, seen, out)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        for f in dataclasses.fields(v):
            _collect(getattr(v, f.name), seen, out)
    elif isinstance(v, dict):
        for x in v.values():
            _collect(x, seen, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _collect(x, seen, out)


class LayerShells:
    """One device's shells of the model's layers, made on first use and kept (meta tensors only).
    Used on the compute stream."""

    def __init__(self, adapter: ModelAdapter, store: ParameterStore):
        self.adapter = adapter
        self.store = store
        self._shells: dict[int, list[tuple[nn.Module, nn.Module, str, bool, Piece]]] = {}

    def bind(self, layer: int, weights: dict[Piece, torch.Tensor]) -> nn.Module:
        """This device's shell of ``layer`` with ``weights`` (piece -> device tensor) bound in;
        ``unbind`` must follow once the layer's work (and its autograd graph) is done."""
        if layer not in self._shells:
            shell = make_shell(self.adapter.layers[layer].module)
            self._shells[layer] = [
                (shell, shell.get_submodule(b.module_path), b.attr, b.is_buffer, b.piece)
                for b in self.store.bindings[layer]
            ]
        bound = self._shells[layer]
        entries = self.store.entries
        tables: Tables | None = None
        for _, mod, attr, is_buffer, piece in bound:
            t = weights[piece]
            quant = entries[piece[0]].quant
            if quant is not None:  # kept compressed: unpacked here, on the compute stream
                # the layer's own uploaded tables (the store binds them beside every packed weight)
                tables = tables or Tables(weights[(self.store.tables_key, None)])  # type: ignore[index]
                t = unpack(t, quant, self.store.dtype, tables)
            # the device tensor itself is bound, not a Parameter: torch types _parameters as Parameters
            (mod._buffers if is_buffer else mod._parameters)[attr] = t  # type: ignore[assignment]
        return bound[0][0] if bound else self.adapter.layers[layer].module

    def unbind(self, layers: range) -> None:
        """Take the device tensors out of the shells of ``layers``."""
        for layer in layers:
            for _, mod, attr, is_buffer, _piece in self._shells.get(layer, ()):
                # Code that re-registers what it reads (torch's parametrizations, as peft's
                # target_parameters LoRA uses them, give a plain tensor back as a buffer) may have
                # moved the tensor to the other dictionary: clear both.
                mod._parameters.pop(attr, None)
                mod._buffers.pop(attr, None)
                (mod._buffers if is_buffer else mod._parameters)[attr] = None
