"""Layers whose forward goes through torch's parametrizations, and keeping their cache per call.

peft's LoRA on a weight it cannot wrap as a module (``target_parameters``, and
``target_modules="all-linear"`` on a model with fused MoE experts) registers a torch parametrization
on the weight at the start of every forward, reads it inside ``parametrize.cached()`` and removes
it at the end; a model may also keep a parametrization for good. torch keeps the parametrization
cache in two module globals, one for the whole process: while one thread is inside ``cached()``,
every other thread's parametrized reads are cached too, and their entries (a device tensor the
size of the weight) outlive their own ``cached()``: left alive after the task that made it, and
read back, stale, by the layer's next call with other weights bound. The counter is not
thread-safe either (``+= 1`` on a module global), so it can stay above zero for good.

The pipeline's workers are threads, one per device. A lock around such layers would deadlock: a
layer's issue may wait for its stream (a data-dependent op is a host sync), whose work may wait on
another device whose thread would wait for the lock. So instead each call of such a layer runs in
:func:`confined_cache`, which takes the entries of the layer's own modules out of the cache when
the call ends, on the issuing thread: whatever other threads do with the counter, no entry of a
layer outlives its call (taking out is serialized, as the note at :func:`_take_out` says).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.nn.utils import parametrize

from roundpipe.models.base import ModelAdapter


def layers_that_parametrize(adapter: ModelAdapter) -> frozenset[int]:
    """Indices of the layers with a module that is parametrized or re-parametrizes a weight on each
    forward (a peft ``ParamWrapper``)."""
    return frozenset(
        layer.index for layer in adapter.layers if any(map(_parametrizes, layer.module.modules()))
    )


@contextmanager
def confined_cache(module: nn.Module) -> Iterator[None]:
    """Run a call of ``module`` (a layer or its device shell); when it ends, however it ends, torch's
    parametrization cache holds nothing of ``module``'s submodules."""
    ids = {id(m) for m in module.modules()}
    try:
        yield
    finally:
        with _TAKING_OUT:
            _take_out(ids)


# Taking entries out holds the cache dict in a local. If the last cached() ends meanwhile on
# another thread, torch puts a fresh dict in its place, and that thread's entries (read into the old
# dict just before) live on in this local after that thread's call has ended and taken its entries
# out of the fresh dict. One taker at a time, holding the dict only while it takes: a call that ends
# while another takes waits until the other lets go, and with it any entry of its own in that dict.
# Nothing here waits for a stream, so the lock cannot close a cycle with the workers.
_TAKING_OUT = threading.Lock()


def _take_out(ids: set[int]) -> None:
    cache = parametrize._cache  # read now: the last cached() to end replaces the dict
    for key in [k for k in list(cache) if k[0] in ids]:
        cache.pop(key, None)


def _parametrizes(module: nn.Module) -> bool:
    # peft's ParamWrapper (lora.layer): the wrapper of one targeted nn.Parameter; named, not
    # imported, so that models without peft need not import it.
    return parametrize.is_parametrized(module) or (
        type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name")
    )


__all__ = ["confined_cache", "layers_that_parametrize"]
