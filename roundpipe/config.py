"""RunConfig: how a model is run (devices, microbatches, policy, precision). Validated on creation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roundpipe.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16")
ORDERS = ("strict", "ready")
OPTIMIZER_MODES = ("sync", "async")
NAN_POLICIES = ("skip", "stop")
DATA_PARALLEL_MODES = ("auto", "off")
OPTIMIZER_SHARDINGS = ("none", "nodes")
HOST_MEMORY_MODES = ("arena", "pinned", "pageable")  # = roundpipe.backend.host_memory.HOST_MEMORY_MODES


def known_policies() -> list[str]:
    """The policies the runtime executes (the registry's ``executable``), sorted by name."""
    from roundpipe.schedule.policies import POLICIES

    return sorted(p for p, spec in POLICIES.items() if spec.executable)


def _positive_finite(value: Any) -> bool:
    """A number above 0 and below infinity (False for NaN, a string, None, ...)."""
    return isinstance(value, numbers.Real) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class RunConfig:
    """How ``roundpipe.wrap`` runs a model.

    Args:
        devices: ``"auto"``, ``"cpu:N"``, ``"cuda"``, ``"cuda:0,1"``, ``"cuda:0x2"``.
        num_microbatches: how many slices ``forward_backward`` cuts each batch into (by sample;
            uneven splits are fine). ``"auto"`` (default): one per device until the first batch
            is profiled, then the count predicted fastest (at most the batch), chosen with the
            policy and the partitions (see ``policy``).
        policy: dispatch policy (``"roundpipe"`` streams stages round-robin over stateless
            workers; ``known_policies()`` lists the others). ``"auto"`` (default): run as
            roundpipe until the first batch is profiled (``Pipeline.profile``, done by the first
            ``forward_backward``), then the policy whose step the simulator predicts fastest on the
            measured layer times, chosen together with the "auto" partitions and microbatch count
            once per batch shape (``roundpipe.sim.choice``); ``pipe.plan`` says what was chosen and
            why. Any of the three given explicitly pins that part. The optimizer mode is never
            chosen: ``sync`` (exact) unless you ask for ``async``.
        dtype: compute precision; master weights and optimizer state are always fp32 on the CPU.
        order: ``"strict"``: each worker runs its tasks in table order; ``"ready"``: the first task
            in table order whose inputs are ready (the table is a hint; irregular tables cannot
            deadlock).
        optimizer_mode: ``"sync"``: exact, every step sees the latest weights (the next step's first
            layer waits for its update: a fill/drain bubble per step). ``"async"``: ``step()``
            returns at once and the update runs on the CPU while the next step computes on the
            weights from one update earlier (staleness exactly 1, as in the RoundPipe paper).
        device_capacity: bytes each device may hold (default: the GPU's memory; unlimited for
            virtual cpu devices). Set it on ``cpu:N`` to rehearse a small GPU.
        head_chunk_tokens: tokens per chunk of the fused LM head + loss (bounds the logits memory).
        head_shards: split the LM head + loss into this many vocabulary shards, each its own layer
            (online log-sum-exp across shards keeps the loss exact), so the partitioner can balance
            the head against the decoder blocks.
        prefetch: upload the next stage's weights while the current one computes.
        copy_chunk_bytes: weight uploads are cut into copies of at most this size, so that urgent
            copies (activations, on their own higher-priority stream) pass them.
        weight_cache_bytes: for weight-bound policies (all but ``roundpipe``), how many bytes of
            weights a device may keep resident across its tasks of one step (default: half the
            device capacity; unlimited on cpu devices without a capacity).
        nan_policy: what a NaN or Inf in a layer's output, the loss or a weight gradient does,
            found on the devices before the optimizer applies it. ``"stop"`` (default):
            ``forward_backward`` raises ``NonFiniteError`` naming the step, layer, microbatch and
            device where it first appeared; a non-finite output is found before any update, a
            non-finite gradient before its own layer's update (eager updates may have stepped the
            layers above it; with deferred updates nothing is applied). ``"skip"``: the step's
            update is dropped and counted (``pipe.skipped_steps``); it defers every update to
            ``step()``, as clipping does, so that no layer is stepped before all are checked. fp16
            runs skip a non-finite gradient either way and lower the loss scale.
        data_parallel: ``"auto"`` (default): when the environment says this process is one rank of
            several (``WORLD_SIZE`` > 1, as ``torchrun`` sets with ``RANK``, ``MASTER_ADDR`` and
            ``MASTER_PORT``), join the torch.distributed process group (gloo; initialised here if
            the caller has not) and train data-parallel: every rank passes the same global batch,
            computes on its own rows, and the fp32 CPU gradients are summed across ranks layer by
            layer as each becomes final, overlapped with the rest of the backward; the loss is
            normalised by the global token count, so N ranks train exactly as one process on the
            whole batch (``roundpipe/distributed/``, docs/multinode.md). ``"off"``: never.
        optimizer_sharding: with data parallelism, ``"nodes"``: each rank owns the AdamW state of
            about 1/N of the layers (contiguous, balanced by bytes): gradients are reduced to
            their owner, which steps them and broadcasts the new weights; the optimizer state per
            rank falls by about N. ``"none"`` (default): every rank steps every layer.
        dp_bucket_bytes: the gradient reduction sends the step groups (layers) in buckets of about
            this many bytes (a layer larger than it goes alone): fewer, larger messages against
            an earlier start of the first (``torch.nn.parallel.DistributedDataParallel``'s
            ``bucket_cap_mb``).
        dp_timeout_s: how long a collective waits for the other ranks before the step fails with
            ``DataParallelError`` (a lost peer whose connection closes is noticed at once).
        watchdog_s: a step with no progress for this long fails with ``WatchdogTimeout``. Progress
            is what the devices have finished (events), not what the workers have issued.
        sanitize: on the cpu backend, check every closure against CUDA's stream rules (a tensor
            used on a stream it was not handed over to, an access not ordered by an event; see
            docs/design.md §5). None: the ``ROUNDPIPE_SANITIZE`` environment variable decides (the
            test suite sets it). On CUDA use PyTorch's ``TORCH_CUDA_SANITIZER=1`` instead.
        seed: base seed of the dropout masks, so recomputation replays them exactly.
        policy_options: extra arguments of the policy (e.g. ``{"virtual_stages": 2}``).
        round_size: ``roundpipe`` only: deal each batch in rounds of this many microbatches (the
            last may be shorter), each round's forward, head and backward stages before the next
            round's, the deal going on across rounds without a drain. The host then holds the saved
            stage inputs of about two rounds instead of the whole batch, for one weight upload per
            stage per round. At least the device count (unless it covers every microbatch); None:
            one round of all microbatches.
        partition: layers per forward stage, e.g. ``(3, 4, 4, 3)``; layers are embed, each block,
            the head. ``None``: the policy's default (one layer per stage for roundpipe, even stages
            for the others). ``"auto"`` (default): profile the layers on the first batch and cut
            them on the measured times within the device capacity: a policy with separate forward
            and backward partitions (roundpipe) takes the free stage grain of the RoundPipe
            objective (``partition/grain.py``) for the microbatch count, the others their registry
            stage count, balanced.
        backward_partition: layers per backward stage (default: ``partition``); roundpipe allows
            it to differ (backward stages are usually smaller).
        schedule: a hand-written ``ScheduleTable`` to run instead of a policy's; its partitions and
            microbatch count are used. Checked before it runs: strict order rejects a table that
            would deadlock, naming the waiting cycle.
        host_memory: where the host copies that uploads read live. ``"arena"``: carved from a few
            exactly-sized page-locked allocations (``cudaHostRegister``), so host memory is what the
            tensors need plus alignment; ``"pinned"``: one ``pin_memory()`` per tensor (PyTorch's
            caching host allocator rounds each up to a power of two: up to ~2x the bytes);
            ``"pageable"``: nothing pinned (asynchronous copies are staged and block the host).
        fp16_accumulation: with ``dtype="fp16"``, let fp16 matmuls accumulate in fp16
            (``torch.backends.cuda.matmul.allow_fp16_accumulation``): twice the tensor-core rate on
            GeForce cards, as the RoundPipe paper's 4090 runs use; fewer correct bits in long sums.
            The cuda backend sets it for the process while the pipeline is open (and warns where
            the installed torch lacks it); the cpu backend has no such mode and warns.
    """

    devices: str = "auto"
    num_microbatches: int | str = "auto"
    policy: str = "auto"
    dtype: str = "fp32"
    order: str = "strict"
    optimizer_mode: str = "sync"
    device_capacity: int | None = None
    head_chunk_tokens: int = 1024
    head_shards: int = 1
    prefetch: bool = True
    copy_chunk_bytes: int = 64 << 20
    weight_cache_bytes: int | None = None
    nan_policy: str = "stop"
    data_parallel: str = "auto"
    optimizer_sharding: str = "none"
    dp_timeout_s: float = 300.0
    dp_bucket_bytes: int = 25 << 20
    watchdog_s: float = 300.0
    sanitize: bool | None = None
    seed: int = 0
    policy_options: dict[str, Any] = field(default_factory=dict)
    round_size: int | None = None
    partition: tuple[int, ...] | str | None = "auto"
    backward_partition: tuple[int, ...] | None = None
    schedule: Any = None  # a roundpipe.schedule.ScheduleTable written by hand
    host_memory: str = "arena"
    fp16_accumulation: bool = False
    verify_model: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if not isinstance(self.policy, str):  # before the dict lookups below, which need a hashable
            raise ConfigError(
                f"policy must be a name, got {type(self.policy).__name__} {self.policy!r}; choose 'auto' "
                f"or one of {', '.join(known_policies())}"
            )
        from roundpipe.schedule.policies import POLICIES

        if self.policy in POLICIES and not POLICIES[self.policy].executable:
            raise ConfigError(
                f"policy {self.policy!r} cannot run yet: {POLICIES[self.policy].cannot_run}; "
                f"choose one of {', '.join(known_policies())} (the simulator still models it)"
            )
        if self.policy != "auto" and self.policy not in known_policies():
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose 'auto' or one of {', '.join(known_policies())}"
            )
        if self.order not in ORDERS:
            raise ConfigError(f"unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError(
                f"unknown nan_policy {self.nan_policy!r}; choose one of {', '.join(NAN_POLICIES)}"
            )
        if self.optimizer_mode not in OPTIMIZER_MODES:
            raise ConfigError(
                f"unknown optimizer_mode {self.optimizer_mode!r}; choose one of {', '.join(OPTIMIZER_MODES)}"
            )
        if self.num_microbatches != "auto" and (
            not isinstance(self.num_microbatches, int) or self.num_microbatches < 1
        ):
            raise ConfigError(
                f"num_microbatches must be a positive int or 'auto', got {self.num_microbatches!r}"
            )
        if not isinstance(self.head_chunk_tokens, int) or self.head_chunk_tokens < 1:
            raise ConfigError(f"head_chunk_tokens must be a positive int, got {self.head_chunk_tokens!r}")
        if not isinstance(self.head_shards, int) or self.head_shards < 1:
            raise ConfigError(f"head_shards must be a positive int, got {self.head_shards!r}")
        if not isinstance(self.copy_chunk_bytes, int) or self.copy_chunk_bytes < 1:
            raise ConfigError(f"copy_chunk_bytes must be a positive int, got {self.copy_chunk_bytes!r}")
        if self.device_capacity is not None and not _positive_finite(self.device_capacity):
            raise ConfigError(f"device_capacity must be a positive byte count, got {self.device_capacity!r}")
        if self.weight_cache_bytes is not None and not (
            _positive_finite(self.weight_cache_bytes) or self.weight_cache_bytes == 0
        ):
            raise ConfigError(
                f"weight_cache_bytes must be a byte count (0 or more) or None, got {self.weight_cache_bytes!r}"
            )
        for name in ("partition", "backward_partition"):  # a list (from YAML, say) means the same
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.partition, str) and self.partition != "auto":
            raise ConfigError(f"partition must be layer counts per stage or 'auto', got {self.partition!r}")
        if self.backward_partition is not None and not isinstance(self.partition, tuple):
            raise ConfigError(
                "backward_partition needs partition too (the forward stages, e.g. partition=(2, 3)); "
                f"partition={self.partition!r} chooses both"
            )
        for name in ("partition", "backward_partition"):
            sizes = getattr(self, name)
            if isinstance(sizes, str) and sizes == "auto":
                continue
            if sizes is not None and (
                not isinstance(sizes, tuple)
                or not sizes
                or any(not isinstance(n, int) or n < 1 for n in sizes)
            ):
                raise ConfigError(f"{name} must list a positive number of layers per stage, got {sizes!r}")
        if self.schedule is not None:
            from roundpipe.schedule.table import ScheduleTable

            if not isinstance(self.schedule, ScheduleTable):
                raise ConfigError(
                    f"schedule must be a roundpipe.schedule.ScheduleTable (ScheduleTable.from_text, "
                    f"build_table), got {type(self.schedule).__name__}"
                )
        if not isinstance(self.policy_options, Mapping) or not all(
            isinstance(k, str) for k in self.policy_options
        ):
            raise ConfigError(
                f"policy_options must be a dict of option names to values (e.g. {{'virtual_stages': 2}}), "
                f"got {self.policy_options!r}"
            )
        if (
            self.schedule is not None
            and self.num_microbatches != "auto"
            and self.schedule.num_microbatches != self.num_microbatches
        ):
            raise ConfigError(
                f"the schedule is written for {self.schedule.num_microbatches} microbatches but "
                f"num_microbatches={self.num_microbatches}; make them equal"
            )
        self._check_round_size()
        if self.policy == "auto" and self.policy_options:
            from roundpipe.schedule import policy_options

            keys = set(self.policy_options)
            if not any(keys <= set(policy_options(p)) for p in known_policies()):
                raise ConfigError(
                    f"no policy takes the options {', '.join(sorted(keys))}; name the policy they are for"
                )
        if self.host_memory not in HOST_MEMORY_MODES:
            raise ConfigError(
                f"unknown host_memory {self.host_memory!r}; choose one of {', '.join(HOST_MEMORY_MODES)}"
            )
        if self.fp16_accumulation and self.dtype != "fp16":
            raise ConfigError(
                f"fp16_accumulation needs dtype='fp16', not {self.dtype!r}; set both or neither"
            )
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ConfigError(
                f"unknown data_parallel {self.data_parallel!r}; choose one of {', '.join(DATA_PARALLEL_MODES)}"
            )
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ConfigError(
                f"unknown optimizer_sharding {self.optimizer_sharding!r}; choose one of "
                f"{', '.join(OPTIMIZER_SHARDINGS)}"
            )
        if (
            isinstance(self.dp_bucket_bytes, bool)
            or not isinstance(self.dp_bucket_bytes, int)
            or (self.dp_bucket_bytes < 1)
        ):
            raise ConfigError(f"dp_bucket_bytes must be a positive int, got {self.dp_bucket_bytes!r}")
        if not _positive_finite(self.dp_timeout_s):
            raise ConfigError(f"dp_timeout_s must be a positive number of seconds, got {self.dp_timeout_s!r}")
        if not isinstance(self.watchdog_s, numbers.Real) or not self.watchdog_s > 0:  # also refuses NaN
            raise ConfigError(f"watchdog_s must be a positive number of seconds, got {self.watchdog_s!r}")
        if not isinstance(self.verify_model, bool):
            raise ConfigError(f"verify_model must be True or False, got {self.verify_model!r}")

    def _check_round_size(self) -> None:
        """A positive int, for a policy that deals in rounds, not given twice. Whether it covers
        the device count is checked when the pipeline knows its devices (the policy's table)."""
        r = self.round_size
        if r is None:
            return
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(
                f"round_size must be a positive int (microbatches per round) or None, got {r!r}"
            )
        from roundpipe.schedule import policy_options

        # With policy="auto" only the policies that deal in rounds are candidates.
        takers = [p for p in known_policies() if "round_size" in policy_options(p)]
        if self.policy != "auto" and self.policy not in takers:
            raise ConfigError(
                f"round_size deals microbatches in rounds, which policy {self.policy!r} does not do; "
                f"use policy={takers[0]!r} (or 'auto') or drop round_size"
            )
        if self.policy_options.get("round_size", r) != r:
            raise ConfigError(
                f"round_size={r} and policy_options['round_size']={self.policy_options['round_size']!r} "
                "disagree; set one of them"
            )

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]
