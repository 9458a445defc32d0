"""The parameter store: every tensor of the model, kept in CPU memory, keyed once.

For each distinct parameter (tied weights are one entry used by two layers):
- trainable: an fp32 *master* (the optimizer's), an fp32 gradient accumulator, and a *compute
  copy* in the run dtype that uploads read (the master itself when the run is fp32 and sync);
- frozen: no master, no gradient; one compute copy in the run dtype (a float tensor in another
  dtype is converted); a tensor already in the run dtype is stored once: the model's own tensor is
  re-pointed at its compute copy.
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

The model's own parameters are not touched during training; ``export_to`` writes masters back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from roundpipe.backend import Backend, tensor_bytes
from roundpipe.backend.host_memory import HostMemory
from roundpipe.models.base import ModelAdapter


@dataclass
class Entry:
    key: int
    name: str
    tensor: torch.Tensor  # the model's own Parameter / buffer (CPU)
    trainable: bool
    is_buffer: bool
    buffers: list[torch.Tensor]  # compute copies in the run dtype; uploads read buffers[read]
    master: nn.Parameter | None = None
    grad: torch.Tensor | None = None
    users: list[int] = field(default_factory=list)  # layer indices that use it
    read: int = 0

    @property
    def compute(self) -> torch.Tensor:
        """The copy uploads read this iteration (async mode alternates between two)."""
        return self.buffers[self.read]

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
    publishes the next weights into the other (see ``Pipeline`` for the staleness contract)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        dtype: torch.dtype,
        backend: Backend,
        double_buffer: bool = False,
        *,
        host_memory: str = "arena",
    ):
        self.dtype = dtype
        self.double_buffer = double_buffer
        self.host = HostMemory(backend, host_memory)
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
                            e, plan = self._plan_entry(
                                len(self.entries),
                                names.get(id(t), f"{layer.name}.{mpath}.{attr}"),
                                t,
                                is_buffer,
                            )
                            by_id[id(t)] = e
                            self.entries.append(e)
                            plans.append(plan)
                        if layer.index not in e.users:
                            e.users.append(layer.index)
                        rows = None if is_buffer else row_slices.get(f"{mpath}.{attr}" if mpath else attr)
                        binds.append(Binding(mpath, attr, is_buffer, e.key, rows))
            self.bindings.append(binds)
        self._allocate_and_fill(plans)
        self.layer_bytes = [
            sum(self.piece_bytes(p) for p in self.layer_pieces(i)) for i in range(len(self.bindings))
        ]

    # What each entry's compute copies are, decided before any host memory is allocated:
    # "master" (fp32 sync: the fp32 master is the compute copy), "from_master" (a run-dtype copy of
    # the master), "convert" (a frozen tensor in another dtype), "own" (a frozen tensor already in the
    # run dtype: stored once, the model's tensor re-pointed at the copy).
    def _plan_entry(self, key: int, name: str, t: torch.Tensor, is_buffer: bool) -> tuple[Entry, list[str]]:
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

    def _allocate_and_fill(self, plans: list[list[str]]) -> None:
        """One allocation of every planned compute copy, then the copies filled in."""
        role_dtype = {"master": torch.float32, "from_master": self.dtype, "convert": self.dtype}
        specs = [
            (tuple(e.tensor.shape), role_dtype.get(role, e.tensor.dtype))
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
                        buf.copy_(e.master.data)
                    else:
                        buf.copy_(data)
                        if role == "own":
                            e.tensor.data = buf  # stored once: the model's tensor now lives here
                    e.buffers.append(buf)
                if e.trainable:
                    e.grad = torch.zeros_like(e.master.data)  # pageable

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

    def piece_source(self, piece: Piece) -> torch.Tensor:
        """What uploading ``piece`` reads now: the compute copy, or its rows (a view)."""
        key, rows = piece
        compute = self.entries[key].compute
        return compute if rows is None else compute[rows[0] : rows[1]]

    def piece_bytes(self, piece: Piece) -> int:
        return tensor_bytes(self.piece_source(piece))

    def refresh_compute(self, keys, into: int | None = None) -> None:
        """After an optimizer step: copy the masters into compute copy ``into`` (default: all)."""
        for k in keys:
            e = self.entries[k]
            targets = e.buffers if into is None else [e.buffers[into % len(e.buffers)]]
            for buf in targets:
                if buf.data_ptr() != e.master.data_ptr():
                    buf.copy_(e.master.data)

    def set_read_buffer(self, index: int) -> None:
        """Which compute copy this iteration's uploads read (``index % 2`` in async mode)."""
        for e in self.entries:
            if e.trainable:
                e.read = index % len(e.buffers)

    def zero_grads(self) -> None:
        for e in self.entries:
            if e.grad is not None:
                e.grad.zero_()


def _qualified_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), n)
    return names
