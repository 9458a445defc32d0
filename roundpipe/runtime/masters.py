"""The fp32 masters seen from outside: writing them into a model, saving and restoring them.

Caller's thread only, with the host queue drained first (an async update still running must land
before the masters are read or overwritten); ``Pipeline`` does that before calling in here.
"""

from __future__ import annotations

import torch
from torch import nn

from roundpipe.errors import PipelineStateError
from roundpipe.optim import master_of
from roundpipe.runtime.store import Entry, ParameterStore


def export_masters(store: ParameterStore, model: nn.Module) -> None:
    """Copy every trained master into the matching parameter of ``model``: the very tensor the
    store was built from, else the parameter whose name ends with the entry's name.

    Raises:
        PipelineStateError: ``model`` has none of the trained parameters.
    """
    own = {id(e.tensor): e for e in store.entries}
    by_name = {e.name: e for e in store.entries if e.trainable}
    written = 0
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            e = own.get(id(p)) or _match_name(name, by_name)
            if e is not None and e.trainable:
                p.data.copy_(master_of(e).data)
                written += 1
    if written == 0 and by_name:
        raise PipelineStateError(
            "export_to found none of the trained parameters in that model; pass the model given to wrap() "
            "or one with the same parameter names"
        )


def masters_state(store: ParameterStore) -> dict[str, torch.Tensor]:
    """Copies of the trained masters keyed by parameter name."""
    return {e.name: master_of(e).detach().clone() for e in store.entries if e.trainable}


def load_masters(store: ParameterStore, masters: dict[str, torch.Tensor]) -> None:
    """Overwrite the trained masters and refresh the compute copies the next upload reads.

    Raises:
        PipelineStateError: a trained parameter is missing from ``masters``.
    """
    with torch.no_grad():
        for e in store.entries:
            if e.trainable:
                if e.name not in masters:
                    raise PipelineStateError(
                        f"checkpoint lacks parameter {e.name!r}; was it saved from this model?"
                    )
                master_of(e).data.copy_(masters[e.name])
        store.refresh_compute([e.key for e in store.entries if e.trainable])


def stale_state(store: ParameterStore, steps_run: int) -> dict[str, torch.Tensor]:
    """Async mode: copies of the compute copy step ``steps_run`` will read, keyed by name."""
    return {
        e.name: e.buffers[steps_run % len(e.buffers)].detach().clone() for e in store.entries if e.trainable
    }


def load_stale(store: ParameterStore, stale: dict[str, torch.Tensor], steps_run: int) -> None:
    """Async mode, after ``load_masters``: put back the weights step ``steps_run`` reads."""
    with torch.no_grad():
        for e in store.entries:
            if e.trainable and e.name in stale:
                e.buffers[steps_run % len(e.buffers)].copy_(stale[e.name])


def _match_name(name: str, by_name: dict[str, Entry]) -> Entry | None:
    if name in by_name:
        return by_name[name]
    for n, e in by_name.items():
        if name.endswith("." + n):
            return e
    return None
