"""The parameter store: every tensor of the model, kept in CPU memory, keyed once.

For each distinct parameter (tied weights are one entry used by two layers):
- trainable: an fp32 *master* (the optimizer's), an fp32 gradient accumulator, and a *compute
  copy* in the run dtype that uploads read (the master itself when the run is fp32 and sync);
- frozen: no master, no gradient; one compute copy in the run dtype (a float tensor in another
  dtype is converted); a tensor already in the run dtype is stored once: the model's own tensor is
  re-pointed at its compute copy.
- compressed (``quantization``, ``RunConfig.quantization``): a frozen weight of a decoder block
  that ``runtime/quantized.py`` keeps packed (an ``nn.Linear``'s weight, fused experts) has one
  uint8 compute copy in the layout of ``partition/quant_layout.py`` (``Entry.quant``), filled from
  the model's tensor or, on meta, from ``weights`` one tensor at a time; the model's meta tensor
  stays on meta. One more frozen entry, the unpacking tables, is bound into every block layer that
  holds a compressed weight, so each device gets them with the layer's weights.
Buffers (e.g. Gemma's embedding scale) are frozen entries too.

Host memory (``host_memory``, see ``roundpipe.backend.host_memory``): every compute copy -- and
so the fp32 master when it is one -- is planned first, then allocated at once (``"arena"``: carved
from a few exactly-sized page-locked blocks; ``"pinned"``: one pinned tensor each; ``"pageable"``:
plain tensors, and a frozen tensor already in the run dtype is used as is), then filled. Masters
that uploads never read (bf16/fp16 runs, async mode) and gradient accumulators stay pageable.

A layer may use only some rows of a tensor (a vocabulary shard of the LM head: ``row_slices()``);
its binding then carries those rows, and what a device holds of it -- a *piece*, ``(entry key, rows
or None for the whole tensor)`` -- is only those rows, uploaded from the compute copy and returning a
gradient of those rows. Masters and gradients stay whole on the CPU.

Loading (``weights``): a tensor of the model on the meta device (built without weights, e.g. under
``accelerate.init_empty_weights()``) is filled from ``weights`` straight into its store copy -- the
fp32 master of a trainable entry, the compute copy of a frozen one -- so host RAM never holds a
second copy of it; the model's own tensor is then re-pointed at that copy (the master, else the
compute copy; ``torch.utils.swap_tensors``, so the object, its ties and peft's references stay)
and the model stays usable on the CPU. ``weights`` is any object with ``name in weights`` and
``weights.fill(name, out)`` (write the named tensor into ``out``, converting its dtype);
``roundpipe.train.loading.SafetensorsWeights`` reads a HF model directory. The names asked for are
the model's parameter names (every name of a tied tensor, first found wins); mapping them to the
file's names is the weights object's business. Tensors not on the meta device are copied as above.

The model's own parameters are not touched during training; ``export_to`` writes masters back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from torch import nn

from roundpipe.backend import Backend, tensor_bytes
from roundpipe.backend.base import storage_key
from roundpipe.backend.host_memory import HostMemory
from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.models.base import ModelAdapter
from roundpipe.optim import master_of
from roundpipe.partition.quant_layout import QuantLayout, quant_layout
from roundpipe.runtime.quantized import TABLES_NAME, pack, quantizable, table_bytes, unpack


class Weights(Protocol):
    """Where the tensors of a model built on the meta device come from (see the module docstring)."""

    def __contains__(self, name: str) -> bool: ...

    def fill(self, name: str, out: torch.Tensor) -> None:
        """Write the tensor ``name`` into ``out`` (same shape), converting to ``out.dtype``."""


@dataclass
class Entry:
    key: int
    name: str
    tensor: torch.Tensor  # the model's own Parameter / buffer (CPU)
    trainable: bool
    is_buffer: bool
    buffers: list[torch.Tensor]  # compute copies in the run dtype; uploads read buffers[read]
    master: nn.Parameter | None = None
    grad_buffer: torch.Tensor | None = None  # the fp32 accumulator; read it as ``grad``
    # A backward produced a gradient for it since the gradients were last zeroed: autograd's
    # ``.grad is not None``. ``grad`` reads zero otherwise, and AdamW must then skip the entry, not
    # step it with a zero gradient (set by the host thread as it adds a downloaded gradient).
    has_grad: bool = False
    # The buffer still holds a spent gradient (``discard_grad``): not zeroed after the update, a
    # pass over host memory saved; it is zeroed when read (``grad``) or overwritten by the next.
    grad_stale: bool = False
    users: list[int] = field(default_factory=list)  # layer indices that use it
    read: int = 0
    source: str | None = None  # the name it was loaded by from ``weights`` (None: copied from the model)
    quant: QuantLayout | None = None  # kept compressed (``RunConfig.quantization``): buffers hold the bytes

    @property
    def compute(self) -> torch.Tensor:
        """The copy uploads read this iteration (async mode alternates between two)."""
        return self.buffers[self.read]

    @property
    def grad(self) -> torch.Tensor | None:
        """The accumulated fp32 gradient (zero when no backward made one since the last update)."""
        if self.grad_stale:
            assert self.grad_buffer is not None
            self.grad_buffer.zero_()
            self.grad_stale = False
        return self.grad_buffer

    def add_grads(self, pieces: list[tuple[tuple[int, int] | None, torch.Tensor]]) -> None:
        """Host thread: add one download's gradient, ``(rows, gradient)`` pieces: the whole tensor
        (rows None) or disjoint row ranges ``[start, stop)`` (its chunks, or a vocabulary shard's).
        When they cover the whole tensor and no gradient is there since the update, they are copied
        in: no zeroed buffer is read (and none was zeroed after the update)."""
        buf = self.grad_buffer
        assert buf is not None
        whole = buf.shape[0] if buf.dim() else 1
        covered = sum(whole if rows is None else rows[1] - rows[0] for rows, _ in pieces)
        fresh = not self.has_grad and covered == whole
        grad = buf if fresh else self.grad  # ``grad`` zeroes a spent gradient first
        assert grad is not None
        for rows, g in pieces:
            part = grad if rows is None else grad[rows[0] : rows[1]]
            part.copy_(g) if fresh else part.add_(g)
        if fresh:
            self.grad_stale = False
        self.has_grad = True

    def discard_grad(self) -> None:
        """The gradient is spent (stepped, or dropped): it reads as zero from now on."""
        self.has_grad = False
        self.grad_stale = self.grad_buffer is not None

    @property
    def owner(self) -> int:
        """The layer whose backward makes this gradient final (the lowest user: backward runs last to first)."""
        return min(self.users)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.compute)


Piece = tuple[int, tuple[int, int] | None]  # (entry key, [start, stop) rows or None: whole)


@dataclass(frozen=True)
class Binding:
    """Where an entry sits inside a layer's module: ``module_path`` (dotted) and attribute name;
    ``rows``: the ``[start, stop)`` rows of the entry the layer uses (None: all of it)."""

    module_path: str
    attr: str
    is_buffer: bool
    key: int
    rows: tuple[int, int] | None = None

    @property
    def piece(self) -> Piece:
        """What a device holds for this binding (the key of the worker's weight and gradient dicts)."""
        return (self.key, self.rows)


class ParameterStore:
    """All tensors of the model, once each. ``double_buffer`` (async optimizer) gives every
    trainable entry two compute copies: iteration ``t`` reads copy ``t % 2`` while the optimizer
    publishes the next weights into the other (see ``Pipeline`` for the staleness contract).

    Raises:
        ConfigError: a tensor of the model is on the meta device and no ``weights`` were given, or
            a buffer of ``adapter.context_module`` (rotary tables, never stored) is on meta.
        CheckpointError: ``weights`` holds no tensor under any name of a meta tensor (or the
            weights object's own checks fail: a shape that disagrees, a truncated file).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        dtype: torch.dtype,
        backend: Backend,
        double_buffer: bool = False,
        *,
        host_memory: str = "arena",
        weights: Weights | None = None,
        quantization: str | None = None,
    ):
        self.dtype = dtype
        self.quantization = quantization
        self.double_buffer = double_buffer
        self.weights = weights
        for name, b in adapter.context_module.named_buffers():
            if b.is_meta:  # not stored (every worker builds its own copy), so it cannot be filled
                raise ConfigError(
                    f"buffer {name} of the model is on the meta device: build the model under "
                    f"accelerate.init_empty_weights(), which leaves buffers real, not torch.device('meta')"
                )
        self.host = HostMemory(backend, host_memory)
        self.host_device = backend.host_device  # meta on the virtual server
        self.entries: list[Entry] = []
        self.bindings: list[list[Binding]] = []  # per layer
        by_id: dict[int, Entry] = {}
        names = _qualified_names(adapter.model)
        plans: list[list[str]] = []  # per entry: the role of each compute copy (see _plan_entry)
        for layer in adapter.layers:
            binds = []
            # {parameter path in the layer's module: rows}, for layers that use only rows of some
            # tensors (HeadShardLayer); every other tensor is bound whole.
            row_slices = layer.row_slices()
            for mpath, module in layer.module.named_modules(remove_duplicate=False):
                for is_buffer, table in ((False, module._parameters), (True, module._buffers)):
                    for attr, t in table.items():
                        if t is None:
                            continue
                        e = by_id.get(id(t))
                        if e is None:
                            packed = (
                                quantization is not None
                                and layer.kind == "block"
                                and not is_buffer
                                and not t.requires_grad
                                and quantizable(module, attr, t)
                            )
                            e, plan = self._plan_entry(
                                len(self.entries),
                                names.get(id(t)) or [f"{layer.name}.{mpath}.{attr}"],
                                t,
                                is_buffer,
                                quantization if packed else None,
                            )
                            by_id[id(t)] = e
                            self.entries.append(e)
                            plans.append(plan)
                        if layer.index not in e.users:
                            e.users.append(layer.index)
                        rows = None if is_buffer else row_slices.get(f"{mpath}.{attr}" if mpath else attr)
                        binds.append(Binding(mpath, attr, is_buffer, e.key, rows))
            self.bindings.append(binds)
        self.tables_key: int | None = None
        if quantization is not None:
            plans.append(self._add_tables())
        if quantization is not None and not any(e.quant for e in self.entries):
            raise ConfigError(
                f"quantization={quantization!r} keeps frozen weights of the decoder blocks compressed, "
                f"and this model has none (every block weight trains: full fine-tuning); train LoRA "
                f"adapters (peft) on the frozen model, or leave quantization unset"
            )
        self._allocate_and_fill(plans)
        self.layer_bytes = [
            sum(self.piece_bytes(p) for p in self.layer_pieces(i)) for i in range(len(self.bindings))
        ]

    # What each entry's compute copies are, decided before any host memory is allocated:
    # "master" (fp32 sync: the fp32 master is the compute copy), "from_master" (a run-dtype copy of
    # the master), "convert" (a frozen tensor in another dtype), "own" (a frozen tensor already in the
    # run dtype: stored once, the model's tensor re-pointed at the copy); for meta tensors see
    # _plan_loaded_entry. ``names``: every name of the tensor in the model, the first is the entry's.
    # ``packed``: a frozen weight kept compressed in this format ("pack": the bytes of its layout,
    # filled from the model's tensor, or from the weights when it is on meta). The unpacking
    # tables' entry is "tables" (copied in, nothing re-pointed: _add_tables).
    def _plan_entry(
        self, key: int, names: list[str], t: torch.Tensor, is_buffer: bool, packed: str | None = None
    ) -> tuple[Entry, list[str]]:
        if packed is not None:
            source = self._source_name(names) if t.is_meta else None
            stored = self._stored_packed(source)
            if stored not in (None, packed):
                raise ConfigError(
                    f"the weights hold {names[0]} packed in {stored} (saved by bitsandbytes) and the run "
                    f"keeps weights in {packed}: set quantization={stored!r} (run.quantization)"
                )
            e = Entry(key, names[0], t, False, is_buffer, [], source=source)
            e.quant = quant_layout(packed, tuple(t.shape))
            return e, ["pack"]
        if t.is_meta:
            stored = self._stored_packed(self._source_name(names))
            if stored is not None:
                raise ConfigError(
                    f"the weights hold {names[0]} packed in {stored} (saved by bitsandbytes): "
                    + (
                        f"set quantization={stored!r} (run.quantization) to train on it as it is"
                        if self.quantization is None
                        else "roundpipe keeps only the decoder blocks' frozen linear weights compressed; "
                        "save the model with this one unquantized (BitsAndBytesConfig's llm_int8_skip_modules)"
                    )
                )
            return self._plan_loaded_entry(key, names, t, is_buffer)
        name = names[0]
        trainable = (not is_buffer) and t.requires_grad
        data = t.detach()
        if trainable:
            if self.dtype == torch.float32 and not self.double_buffer:
                plan = ["master"]
                master = None  # lives in host memory: made by _allocate_and_fill
            else:
                plan = ["from_master"] * (2 if self.double_buffer else 1)
                master = nn.Parameter(data.to(torch.float32, copy=True))  # pageable: never uploaded
            e = Entry(key, name, t, True, is_buffer, [], master)
        elif data.is_floating_point() and data.dtype != self.dtype:
            plan = ["convert"]
            e = Entry(key, name, t, False, is_buffer, [])
        elif self.host.keeps_model_tensors:
            plan = []
            e = Entry(key, name, t, False, is_buffer, [data])  # the model's own tensor, as is
        else:
            plan = ["own"]
            e = Entry(key, name, t, False, is_buffer, [])
        return e, plan

    # A meta tensor has no data to copy: "load_master" (fp32 sync: the weights are read into the
    # fp32 master, which is the compute copy), "from_master" after a pageable fp32 master read here,
    # or "load" (frozen: read into the compute copy, in the run dtype when floating).
    def _plan_loaded_entry(
        self, key: int, names: list[str], t: torch.Tensor, is_buffer: bool
    ) -> tuple[Entry, list[str]]:
        source = self._source_name(names)
        trainable = (not is_buffer) and t.requires_grad
        e = Entry(key, names[0], t, trainable, is_buffer, [], source=source)
        if not trainable:
            return e, ["load"]
        if self.dtype == torch.float32 and not self.double_buffer:
            return e, ["load_master"]
        master = torch.empty(
            t.shape, dtype=torch.float32, device=self.host_device
        )  # pageable: never uploaded
        with torch.no_grad():
            self._read(source, master)
        e.master = nn.Parameter(master)
        _repoint(t, master)
        return e, ["from_master"] * (2 if self.double_buffer else 1)

    def _source_name(self, names: list[str]) -> str:
        if self.weights is None:
            raise ConfigError(
                f"{names[0]} is on the meta device (the model was built without weights) and no weights "
                f"were given: pass weights=roundpipe.train.loading.SafetensorsWeights(model_dir) to "
                f"roundpipe.wrap, or load the model with its weights (from_pretrained)"
            )
        for name in names:
            if name in self.weights:
                return name
        raise CheckpointError(
            f"the weights hold no tensor for {names[0]} (asked for {', '.join(names)}): they do not "
            f"belong to this model; load the directory the model's config came from"
        )

    def _read(self, source: str | None, out: torch.Tensor) -> None:
        """Fill ``out`` with tensor ``source`` of the given weights (an entry plans a read only
        after ``_source_name`` found its tensor there)."""
        if self.weights is None or source is None:
            raise TypeError("a read from the weights was planned without weights or a tensor name")
        self.weights.fill(source, out)

    def _copy_dtype(self, e: Entry, role: str) -> torch.dtype:
        if role == "pack":
            return torch.uint8
        if role in ("master", "load_master"):
            return torch.float32
        if role in ("from_master", "convert") or (role == "load" and e.tensor.is_floating_point()):
            return self.dtype
        return e.tensor.dtype

    def _allocate_and_fill(self, plans: list[list[str]]) -> None:
        """One allocation of every planned compute copy, then the copies filled in."""
        specs = [
            ((e.quant.nbytes,) if e.quant else tuple(e.tensor.shape), self._copy_dtype(e, role))
            for e, plan in zip(self.entries, plans)
            for role in plan
        ]
        tensors = iter(self.host.allocate(specs))
        with torch.no_grad():
            for e, plan in zip(self.entries, plans):
                data = e.tensor.detach()
                for role in plan:
                    buf = next(tensors)
                    if role == "master":
                        buf.copy_(data)
                        e.master = nn.Parameter(buf)
                    elif role == "from_master":
                        buf.copy_(master_of(e).data)
                    elif role == "load_master":
                        self._read(e.source, buf)
                        e.master = nn.Parameter(buf)
                        _repoint(e.tensor, buf)
                    elif role == "load":
                        self._read(e.source, buf)
                        _repoint(e.tensor, buf)
                    elif role == "pack" and self._stored_packed(e.source) is not None:
                        self.weights.fill_packed(e.source, e.quant, buf)  # type: ignore[union-attr]
                    elif role == "pack":
                        assert e.quant is not None
                        pack(self._full_precision(e), e.quant, buf)
                    else:
                        buf.copy_(data)
                        if role == "own":
                            e.tensor.data = buf  # stored once: the model's tensor now lives here
                    e.buffers.append(buf)
                if e.trainable:
                    e.grad_buffer = torch.zeros_like(master_of(e).data)  # pageable

    def _add_tables(self) -> list[str]:
        """The entry of the unpacking tables (``runtime/quantized.py``), bound as a buffer of the
        root of every block layer that holds a compressed weight; returns its plan."""
        key = self.tables_key = len(self.entries)
        e = Entry(key, TABLES_NAME, table_bytes(), False, True, [])
        for i, binds in enumerate(self.bindings):
            if any(self.entries[b.key].quant for b in binds):
                binds.append(Binding("", TABLES_NAME.replace(".", "_"), True, key))
                e.users.append(i)
        self.entries.append(e)
        return ["tables"]  # copied in; nothing of the model's to re-point

    def _stored_packed(self, source: str | None) -> str | None:
        """The format the weights store tensor ``source`` packed in (a checkpoint saved by
        bitsandbytes: ``SafetensorsWeights.packed_format``), or None."""
        ask = getattr(self.weights, "packed_format", None)
        return None if source is None or ask is None else ask(source)

    def _full_precision(self, e: Entry) -> torch.Tensor:
        """The weight an entry kept compressed holds: the model's tensor, or (on meta) the tensor read
        from the weights into a temporary of the model's dtype, dropped once packed."""
        if not e.tensor.is_meta:
            return e.tensor.detach()
        out = torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device=self.host_device)
        self._read(e.source, out)
        return out

    def unpacked_weights(self) -> dict[int, Callable[[], torch.Tensor]]:
        """For each weight kept compressed, keyed by ``id`` of the model's own tensor: how to make
        (on the CPU, in fp32) the weight the run computes with -- what an export merges into."""
        return {
            id(e.tensor): partial(unpack, e.compute, e.quant, torch.float32) for e in self.entries if e.quant
        }

    def host_memory_stats(self) -> dict:
        """Host bytes requested and reserved by the compute copies (``static_*``) and the hand-off
        pool (``pool_*``); see ``HostMemory.stats``."""
        return self.host.stats()

    def close(self) -> None:
        """Release the host memory's page-locking (after every copy from it has finished). The
        tensors stay usable as pageable memory, so ``export_to`` and checkpoints still work."""
        self.host.close()

    def layer_keys(self, layer: int) -> list[int]:
        """Distinct entry keys used by a layer (in first-use order)."""
        return list(dict.fromkeys(b.key for b in self.bindings[layer]))

    def trainable_keys(self, layers) -> list[int]:
        keys: dict[int, None] = {}
        for i in layers:
            for k in self.layer_keys(i):
                if self.entries[k].trainable:
                    keys[k] = None
        return list(keys)

    @property
    def frozen_prefix(self) -> int:
        """How many leading layers train nothing (the embedding under LoRA): no gradient is handed
        down into them (``schedule.flow.stage_work``'s ``frozen``)."""
        for i in range(len(self.bindings)):
            if self.trainable_keys((i,)):
                return i
        return len(self.bindings)

    def layer_pieces(self, layer: int) -> list[Piece]:
        """Distinct pieces a layer's upload holds (in first-use order)."""
        return list(dict.fromkeys(b.piece for b in self.bindings[layer]))

    def trainable_pieces(self, layers) -> list[Piece]:
        """Distinct pieces of trainable entries the ``layers`` hold: what their backward takes
        gradients of."""
        pieces: dict[Piece, None] = {}
        for i in layers:
            for p in self.layer_pieces(i):
                if self.entries[p[0]].trainable:
                    pieces[p] = None
        return list(pieces)

    def piece_source(self, piece: Piece, read: int | None = None) -> torch.Tensor:
        """What uploading ``piece`` reads: the compute copy (``read``: which one, default the
        current read buffer), or its rows (a view)."""
        key, rows = piece
        e = self.entries[key]
        compute = e.compute if read is None else e.buffers[read % len(e.buffers)]
        return compute if rows is None else compute[rows[0] : rows[1]]

    def piece_bytes(self, piece: Piece) -> int:
        return tensor_bytes(self.piece_source(piece))

    def refresh_compute(self, keys, into: int | None = None) -> None:
        """After an optimizer step: copy the masters into compute copy ``into`` (default: all)."""
        for k in keys:
            e = self.entries[k]
            targets = e.buffers if into is None else [e.buffers[into % len(e.buffers)]]
            for buf in targets:
                if storage_key(buf) != storage_key(e.master):
                    buf.copy_(e.master.data)

    def set_read_buffer(self, index: int) -> None:
        """Which compute copy this iteration's uploads read (``index % 2`` in async mode)."""
        for e in self.entries:
            if e.trainable:
                e.read = index % len(e.buffers)

    def zero_grads(self) -> None:
        """Zero every gradient and forget which entries got one (autograd's ``zero_grad()``)."""
        for e in self.entries:
            e.discard_grad()


def _qualified_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each tensor of ``model`` (tied tensors have several), parameters first."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for n, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(n)
    return names


def _repoint(t: torch.Tensor, data: torch.Tensor) -> None:
    """Make the model's meta tensor ``t`` hold ``data`` (shared, not copied), keeping the Python
    object: ``.data =`` cannot turn a meta tensor into a CPU one; ``swap_tensors`` can, and every
    module that holds ``t`` (a tied weight) sees the new data."""
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data.detach()
    torch.utils.swap_tensors(t, new)
