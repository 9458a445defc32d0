"""What a Pipeline's workers read, as one small object the Pipeline builds once.

A worker (``worker.py``) and the weight residency of its device (``residency.py``) get a
``WorkerSetup`` instead of the Pipeline: the devices' backend, the parameter store, the model's
layers, the host's hand-off ledger and the run settings they follow. So a worker can be built and
tested from these parts alone, and nothing a worker does can reach the Pipeline's own state.
Per-step facts (the table, whether it keeps weights resident, the gradient seed) are on the step
(``step.StepRun``), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.backend import Backend, MemoryLedger
from roundpipe.config import RunConfig
from roundpipe.models.base import ModelAdapter
from roundpipe.runtime.mlp_chunks import check_chunkable
from roundpipe.runtime.store import ParameterStore


@dataclass(frozen=True)
class WorkerSetup:
    """The parts every worker of one Pipeline shares (read-only to them; thread-safe to read).

    Args:
        backend: the devices, their streams and the pinned host buffers (``host_empty``).
        store: every tensor on the CPU (weights a device uploads, gradients it downloads).
        adapter: the model cut into layers (``layers``, ``context_module``, ``build_context``).
        config: the run settings workers follow (``order``, ``prefetch``, ``seed``,
            ``copy_chunk_bytes``, ``head_chunk_tokens``).
        host_memory: the ledger of hand-offs (activations, gradients) held on the CPU.
        random_layers: layers whose forward may draw random numbers, run seeded so that the
            recompute replays them (``models.random_draws.layers_that_draw``).
        parametrized_layers: layers whose forward reads torch parametrizations, whose cache
            entries each call takes out when it ends (``models.parametrized``).
        rank: this process's data-parallel rank (ranks draw their own random numbers), None alone.
        weight_cache_bytes: how much a weight-bound table may keep resident on a device (None: no
            limit).
    """

    backend: Backend
    store: ParameterStore
    adapter: ModelAdapter
    config: RunConfig
    host_memory: MemoryLedger
    random_layers: frozenset[int]
    parametrized_layers: frozenset[int]
    rank: int | None
    weight_cache_bytes: int | None

    def __post_init__(self) -> None:
        check_chunkable(self.adapter, self.config.mlp_chunk_tokens, self.parametrized_layers)

    @property
    def num_layers(self) -> int:
        """Layers of the model; a backward stage that ends here starts from the loss."""
        return len(self.adapter.layers)
