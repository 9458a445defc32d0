"""RunConfig: how a model is run (devices, microbatches, policy, precision). Validated on creation.

Each run setting is declared once, as one field of ``RunConfig`` made by ``_setting``: its type and
default, its help text, the values it takes (``choices``, or a ``check``), and, when a recipe sets
it as a key of its own under ``run:``, that key's help (``recipe``). The rest is read off these
declarations: ``RunConfig``'s docstring, docs/guide.md's table (``settings_table.py``), the
recipe's ``run:`` keys with their types, defaults and reference docs (``roundpipe.train.config.RunSection``), the keys ``run.options`` may not repeat,
the recipe loader's check of each key, and the trainer's copy of ``run:`` into a ``RunConfig``
(``recipe_settings``). Adding a setting is adding one field here. Rules that span settings are the
``_check_*`` methods, run after every field's own check.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Literal, get_type_hints

from roundpipe.errors import ConfigError
from roundpipe.partition.quant_layout import check_quantization
from roundpipe.schedule.policies import POLICIES
from roundpipe.sim.options import DEFAULT_CHUNK_BYTES

DTYPES = ("fp32", "bf16", "fp16")
ORDERS = ("strict", "ready")
OPTIMIZER_MODES = ("sync", "async")
NAN_POLICIES = ("skip", "stop")
DATA_PARALLEL_MODES = ("auto", "off")
OPTIMIZER_SHARDINGS = ("none", "nodes")
HOST_MEMORY_MODES = ("arena", "pinned", "pageable")  # = roundpipe.backend.host_allocators.HOST_MEMORY_MODES


def known_policies() -> list[str]:
    """The policies the runtime executes (the registry's ``executable``), sorted by name."""
    return sorted(p for p, spec in POLICIES.items() if spec.executable)


def _positive_finite(value: Any) -> bool:
    """A number above 0 and below infinity (False for NaN, a string, None, ...)."""
    return isinstance(value, numbers.Real) and math.isfinite(value) and float(value) > 0


# ---------------------------------------------------------------------------------------------------
# One setting's own check: check(name, value) returns the value to keep or raises ConfigError.

Check = Callable[[str, Any], Any]


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
        return value

    return check


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_int(name: str, value: Any) -> Any:
    if not _is_positive_int(value):
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _count_or_none(name: str, value: Any) -> Any:
    if value is not None and not _is_positive_int(value):
        raise ConfigError(f"{name} must be a positive int or None (the default), got {value!r}")
    return value


def _quantization(name: str, value: Any) -> Any:
    check_quantization(value)
    return value


def _count_or_auto(name: str, value: Any) -> Any:
    if value != "auto" and not _is_positive_int(value):
        raise ConfigError(f"{name} must be a positive int or 'auto', got {value!r}")
    return value


def _policy(name: str, value: Any) -> Any:
    if not isinstance(value, str):  # before the dict lookups below, which need a hashable
        raise ConfigError(
            f"policy must be a name, got {type(value).__name__} {value!r}; choose 'auto' "
            f"or one of {', '.join(known_policies())}"
        )
    if value in POLICIES and not POLICIES[value].executable:
        raise ConfigError(
            f"policy {value!r} cannot run yet: {POLICIES[value].cannot_run}; "
            f"choose one of {', '.join(known_policies())} (the simulator still models it)"
        )
    if value != "auto" and value not in known_policies():
        raise ConfigError(f"unknown policy {value!r}; choose 'auto' or one of {', '.join(known_policies())}")
    return value


def _capacity(name: str, value: Any) -> Any:
    if value is not None and not _positive_finite(value):
        raise ConfigError(f"{name} must be a positive byte count, got {value!r}")
    return value


def _cache_bytes(name: str, value: Any) -> Any:
    if value is not None and not (_positive_finite(value) or value == 0):
        raise ConfigError(f"{name} must be a byte count (0 or more) or None, got {value!r}")
    return value


def _timeout(name: str, value: Any) -> Any:
    if not _positive_finite(value):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return value


def _watchdog(name: str, value: Any) -> Any:
    """As ``_timeout``, but infinity is allowed: a watchdog that never fires."""
    # typeshed's numbers.Real declares no __gt__; float() would overflow on a huge int
    if not isinstance(value, numbers.Real) or not value > 0:  # type: ignore[operator]  # also refuses NaN
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return value


def _true_or_false(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _option_names(name: str, value: Any) -> Any:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"{name} must be a dict of option names to values (e.g. {{'virtual_stages': 2}}), got {value!r}"
        )
    return value


def _round_size(name: str, value: Any) -> Any:
    if value is not None and not _is_positive_int(value):
        raise ConfigError(f"{name} must be a positive int (microbatches per round) or None, got {value!r}")
    return value


def _layer_counts(name: str, value: Any) -> Any:
    if isinstance(value, list):  # a list (from YAML, say) means the same
        value = tuple(value)
    if value is not None and (
        not isinstance(value, tuple) or not value or any(not _is_positive_int(n) for n in value)
    ):
        raise ConfigError(f"{name} must list a positive number of layers per stage, got {value!r}")
    return value


def _partition(name: str, value: Any) -> Any:
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{name} must be layer counts per stage or 'auto', got {value!r}")
        return value
    return _layer_counts(name, value)


def _schedule(name: str, value: Any) -> Any:
    if value is not None:
        from roundpipe.schedule.table import ScheduleTable

        if not isinstance(value, ScheduleTable):
            raise ConfigError(
                f"{name} must be a roundpipe.schedule.ScheduleTable (ScheduleTable.from_text, "
                f"build_table), got {type(value).__name__}"
            )
    return value


def _setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    check: Check | None = None,
    recipe: str | None = None,
) -> Any:
    """Declare one run setting (a field of ``RunConfig``).

    Args:
        default: its value when not given (a dict default is copied for each config).
        help: what it does, for ``RunConfig``'s docstring.
        choices: the names it takes; an other value is refused naming them (and a recipe key's
            type is these names).
        check: ``check(name, value)`` returns the value to keep or raises ``ConfigError``.
        recipe: the help of the recipe key ``run.NAME`` that sets it, written for a recipe's
            reader; None: a recipe sets it only through ``run.options``.
    """
    if choices:
        check = _one_of(choices)
    metadata = {"help": help, "choices": choices, "check": check, "recipe": recipe}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def recipe_settings() -> tuple[Field, ...]:
    """The settings a recipe sets as keys of its own under ``run:`` (same name), in field order."""
    return tuple(f for f in fields(RunConfig) if f.metadata["recipe"] is not None)


def recipe_type(f: Field) -> Any:
    """The type of the recipe key ``run.NAME`` that sets ``f``: its choices, else its annotation."""
    if f.metadata["choices"]:
        return Literal[f.metadata["choices"]]
    return get_type_hints(RunConfig)[f.name]


def recipe_default(f: Field) -> Any:
    """The default of ``f`` (a fresh copy of a dict default)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


# ---------------------------------------------------------------------------------------------------
# The settings


@dataclass(frozen=True)
class RunConfig:
    """How ``roundpipe.wrap`` runs a model."""

    devices: str = _setting(
        "auto",
        '``"auto"`` (every GPU, else ``"cpu:2"``), ``"cpu:N"`` (N virtual devices), ``"cuda"``, '
        '``"cuda:0,1"``, ``"cuda:0x2"`` (two workers on GPU 0).',
        recipe="`auto` (every GPU, else cpu:2), `cpu:N`, `cuda`, `cuda:0,1`, `cuda:0x2` (two workers on GPU 0).",
    )
    num_microbatches: int | Literal["auto"] = _setting(
        "auto",
        "how many slices ``forward_backward`` cuts each batch into (by sample; uneven splits are "
        'fine). ``"auto"`` (default): one per device until the first batch is profiled, then the '
        "count predicted fastest (at most the batch), chosen with the policy and the partitions "
        "(see ``policy``).",
        check=_count_or_auto,
        recipe="Microbatches per forward/backward, or `auto`: chosen with the policy from the profile.",
    )
    policy: str = _setting(
        "auto",
        'dispatch policy (``"roundpipe"`` streams stages round-robin over stateless workers; '
        '``known_policies()`` lists the others). ``"auto"`` (default): run as roundpipe until the '
        "first batch is profiled (``Pipeline.profile``, done by the first ``forward_backward``), then "
        "the policy whose step the simulator predicts fastest on the measured layer times, chosen "
        'together with the "auto" partitions and microbatch count once per batch shape '
        "(``roundpipe.sim.choice``); ``pipe.plan`` says what was chosen and why. Any of the three "
        "given explicitly pins that part. The optimizer mode is never chosen: ``sync`` (exact) "
        "unless you ask for ``async``.",
        check=_policy,
        recipe="Dispatch policy (roundpipe, 1f1b, gpipe, ...), or `auto`: the first batch is profiled and "
        "the policy predicted fastest on the measured layer times runs (`RunConfig(policy='auto')`; "
        "the log says what was chosen and why).",
    )
    dtype: str = _setting(
        "fp32",
        "compute precision; master weights and optimizer state are always fp32 on the CPU.",
        choices=DTYPES,
        recipe="Compute precision; masters and optimizer state stay fp32.",
    )
    order: str = _setting(
        "strict",
        '``"strict"``: each worker runs its tasks in table order; ``"ready"``: the first task in '
        "table order whose inputs are ready (the table is a hint; irregular tables cannot "
        "deadlock).",
        choices=ORDERS,
    )
    optimizer_mode: str = _setting(
        "sync",
        '``"sync"``: exact, every step sees the latest weights (the next step\'s first layer waits '
        'for its update: a fill/drain bubble per step). ``"async"``: ``step()`` returns at once and '
        "the update runs on the CPU while the next step computes on the weights from one update "
        "earlier (staleness exactly 1, as in the RoundPipe paper).",
        choices=OPTIMIZER_MODES,
        recipe="sync: exact; async: the update overlaps the next step (staleness 1).",
    )
    overlap_calls: bool = _setting(
        False,
        "with the async optimizer, let consecutive ``forward_backward`` calls overlap, as the "
        "RoundPipe paper's steps do: a call returns once its loss is on the host and the call "
        "before it has completed, and the next call's tasks start behind its remaining backward "
        "on the same devices. An error or a non-finite value (``nan_policy``) of a call that has "
        "returned is raised by the next call that waits (the next ``forward_backward``, or any "
        "other call, which completes every call in flight first). Not with data parallelism.",
        check=_true_or_false,
        recipe="Let consecutive steps overlap (async optimizer only): a step's loss is returned while "
        "its backward still finishes behind the next step's start.",
    )
    device_capacity: int | None = _setting(
        None,
        "bytes each device may hold (default: the GPU's free memory when the pipeline opens, "
        "shared among the workers of one GPU; unlimited for virtual cpu devices). Set it on "
        "``cpu:N`` to rehearse a small GPU.",
        check=_capacity,
    )
    head_chunk_tokens: int = _setting(
        1024,
        "tokens per chunk of the fused LM head + loss (bounds the logits memory).",
        check=_positive_int,
    )
    mlp_chunk_tokens: int | None = _setting(
        None,
        "run each decoder block's MLP (or MoE block) over at most this many tokens at a time, each "
        "chunk recomputed in the backward: at long sequences a layer's MLP intermediates stop being "
        "its largest memory, for one more MLP forward per backward (default: in one piece).",
        check=_count_or_none,
        recipe="Tokens per chunk of each block's MLP (e.g. 4096 for sequences of 16K and more), or "
        "null: the MLP in one piece.",
    )
    quantization: str | None = _setting(
        None,
        "keep the frozen weights of the decoder blocks (each nn.Linear's weight, fused experts) "
        "compressed in host memory, over PCIe and on the device, unpacked in the run dtype where a "
        "layer runs (``runtime/quantized.py``): ``nf4`` (QLoRA's 4-bit NormalFloat with double "
        "quantization), ``int8`` (LLM.int8() rows) or ``fp8`` (e4m3, per-row scales). LoRA only.",
        check=_quantization,
        recipe="nf4, int8 or fp8: the frozen base weights kept compressed (QLoRA); null: in the run dtype.",
    )
    head_shards: int = _setting(
        1,
        "split the LM head + loss into this many vocabulary shards, each its own layer (online "
        "log-sum-exp across shards keeps the loss exact), so the partitioner can balance the head "
        "against the decoder blocks.",
        check=_positive_int,
    )
    prefetch: bool = _setting(True, "upload the next stage's weights while the current one computes.")
    copy_chunk_bytes: int = _setting(
        DEFAULT_CHUNK_BYTES,
        "weight uploads and weight-gradient downloads are cut into copies of at most this size, "
        "issued a few per task after the task's activation copies, so that activation copies pass "
        "them on the copy engine (which runs copies in issue order, whatever the streams' priorities).",
        check=_positive_int,
    )
    weight_cache_bytes: int | None = _setting(
        None,
        "for weight-bound policies (all but ``roundpipe``), how many bytes of weights a device may "
        "keep resident across its tasks of one step (default: half the device capacity; unlimited "
        "on cpu devices without a capacity).",
        check=_cache_bytes,
    )
    nan_policy: str = _setting(
        "stop",
        "what a NaN or Inf in a layer's output, the loss or a weight gradient does, found on the "
        'devices before the optimizer applies it. ``"stop"`` (default): ``forward_backward`` raises '
        "``NonFiniteError`` naming the step, layer, microbatch and device where it first appeared; "
        "a non-finite output is found before any update, a non-finite gradient before its own "
        "layer's update (eager updates may have stepped the layers above it; with deferred updates "
        'nothing is applied). ``"skip"``: the step\'s update is dropped and counted '
        "(``pipe.skipped_steps``); it defers every update to ``step()``, as clipping does, so that "
        "no layer is stepped before all are checked. fp16 runs skip a non-finite gradient either "
        "way and lower the loss scale.",
        choices=NAN_POLICIES,
        recipe="A NaN or Inf in a loss, a layer output or a gradient: `stop` ends the run naming the step, "
        "layer and microbatch (after a checkpoint of the last completed step); `skip` drops that "
        "update and goes on (counted as `skipped_steps` in the metrics). fp16 runs skip gradient "
        "overflows either way and lower the loss scale.",
    )
    data_parallel: str = _setting(
        "auto",
        '``"auto"`` (default): when the environment says this process is one rank of several '
        "(``WORLD_SIZE`` > 1, as ``torchrun`` sets with ``RANK``, ``MASTER_ADDR`` and "
        "``MASTER_PORT``), join the torch.distributed process group (gloo; initialised here if the "
        "caller has not) and train data-parallel: every rank passes the same global batch, computes "
        "on its own rows, and the fp32 CPU gradients are summed across ranks layer by layer as each "
        "becomes final, overlapped with the rest of the backward; the loss is normalised by the "
        "global token count, so N ranks train exactly as one process on the whole batch "
        '(``roundpipe/distributed/``, docs/multinode.md). ``"off"``: never.',
        choices=DATA_PARALLEL_MODES,
        recipe="Under torchrun (WORLD_SIZE > 1): `auto` joins the ranks into one data-parallel run, each "
        "rank computing its share of every global batch (`run.batch_size` stays the global batch) "
        "and rank 0 alone writing the run directory; `off` refuses to run as one of several ranks. "
        "See docs/multinode.md.",
    )
    optimizer_sharding: str = _setting(
        "none",
        'with data parallelism, ``"nodes"``: each rank owns the AdamW state of about 1/N of the '
        "layers (contiguous, balanced by bytes): gradients are reduced to their owner, which steps "
        "them and broadcasts the new weights; the optimizer state per rank falls by about N. "
        '``"none"`` (default): every rank steps every layer.',
        choices=OPTIMIZER_SHARDINGS,
        recipe="With data parallelism, `nodes`: each rank owns the AdamW state of about 1/N of the layers "
        "(host RAM per rank falls by about N for it; checkpoints hold one optimizer file per rank); "
        "`none`: every rank holds all of it.",
    )
    dp_timeout_s: float = _setting(
        300.0,
        "how long a collective waits for the other ranks before the step fails with "
        "``DataParallelError`` (a lost peer whose connection closes is noticed at once).",
        check=_timeout,
        recipe="How long a rank waits for the others in a collective (a step's gradients, a checkpoint) "
        "before the run fails with DataParallelError; a lost rank whose connection closes is "
        "noticed at once.",
    )
    dp_bucket_bytes: int = _setting(
        25 << 20,
        "the gradient reduction sends the step groups (layers) in buckets of about this many bytes "
        "(a layer larger than it goes alone): fewer, larger messages against an earlier start of "
        "the first (``torch.nn.parallel.DistributedDataParallel``'s ``bucket_cap_mb``).",
        check=_positive_int,
    )
    watchdog_s: float = _setting(
        300.0,
        "a step with no progress for this long fails with ``WatchdogTimeout``. Progress is what the "
        "devices have finished (events), not what the workers have issued.",
        check=_watchdog,
    )
    sanitize: bool | None = _setting(
        None,
        "on the cpu backend, check every closure against CUDA's stream rules (a tensor used on a "
        "stream it was not handed over to, an access not ordered by an event; see docs/design.md "
        "§5). None: the ``ROUNDPIPE_SANITIZE`` environment variable decides (the test suite sets "
        "it). On CUDA use PyTorch's ``TORCH_CUDA_SANITIZER=1`` instead.",
    )
    seed: int = _setting(
        0,
        "base seed of every random draw a layer makes in training (dropout masks, peft LoHa/LoKr "
        "rank and module dropout, router jitter), so recomputation replays them exactly.",
        recipe="Seed of initialisation, shuffling and dropout.",
    )
    policy_options: dict[str, Any] = _setting(
        {},
        'extra arguments of the policy (e.g. ``{"virtual_stages": 2}``).',
        check=_option_names,
    )
    round_size: int | None = _setting(
        None,
        "``roundpipe`` only: deal each batch in rounds of this many microbatches (the last may be "
        "shorter), each round's forward, head and backward stages before the next round's, the deal "
        "going on across rounds without a drain. The host then holds the saved stage inputs of "
        "about two rounds instead of the whole batch, for one weight upload per stage per round. "
        "At least the device count (unless it covers every microbatch); None: one round of all "
        "microbatches.",
        check=_round_size,
    )
    partition: tuple[int, ...] | str | None = _setting(
        "auto",
        "layers per forward stage, e.g. ``(3, 4, 4, 3)``; layers are embed, each block, the head. "
        "``None``: the policy's default (one layer per stage for roundpipe, even stages for the "
        'others). ``"auto"`` (default): profile the layers on the first batch and cut them on the '
        "measured times within the device capacity: a policy with separate forward and backward "
        "partitions (roundpipe) takes the free stage grain of the RoundPipe objective "
        "(``partition/grain.py``) for the microbatch count, the others their registry stage count, "
        "balanced.",
        check=_partition,
    )
    backward_partition: tuple[int, ...] | None = _setting(
        None,
        "layers per backward stage (default: ``partition``); roundpipe allows it to differ "
        "(backward stages are usually smaller).",
        check=_layer_counts,
    )
    schedule: Any = _setting(  # a roundpipe.schedule.ScheduleTable written by hand
        None,
        "a hand-written ``ScheduleTable`` to run instead of a policy's; its partitions and "
        "microbatch count are used. Checked before it runs: strict order rejects a table that would "
        "deadlock, naming the waiting cycle.",
        check=_schedule,
    )
    host_memory: str = _setting(
        "arena",
        'where the host copies that uploads read live. ``"arena"``: carved from a few exactly-sized '
        "page-locked allocations (``cudaHostRegister``), so host memory is what the tensors need "
        'plus alignment; ``"pinned"``: one ``pin_memory()`` per tensor (PyTorch\'s caching host '
        'allocator rounds each up to a power of two: up to ~2x the bytes); ``"pageable"``: nothing '
        "pinned (asynchronous copies are staged and block the host).",
        choices=HOST_MEMORY_MODES,
    )
    host_threads: int | None = _setting(
        None,
        "intra-op threads of the host thread, which runs the CPU's share of training: fused AdamW on "
        "the fp32 masters, the gradient accumulation, the refresh of the compute copies, the "
        "finiteness checks and the gradient norm. None: the cores this process may run on (shared "
        "among the ranks torchrun started on the node), less one per worker device, at least 1. "
        "Worker and cpu-backend stream threads keep one each (docs/design.md §4).",
        check=_count_or_none,
        recipe="Threads of the CPU optimizer (AdamW, gradient sums); null: the cores less one per worker.",
    )
    fp16_accumulation: bool = _setting(
        False,
        'with ``dtype="fp16"``, let fp16 matmuls accumulate in fp16 '
        "(``torch.backends.cuda.matmul.allow_fp16_accumulation``): twice the tensor-core rate on "
        "GeForce cards, as the RoundPipe paper's 4090 runs use; fewer correct bits in long sums. "
        "The cuda backend sets it for the process while the pipeline is open (and warns where the "
        "installed torch lacks it); the cpu backend has no such mode and warns.",
    )
    verify_model: bool = _setting(
        True,
        "at wrap time, prove the layers against the model's own forward on two 8-token sequences, "
        "and one training step of them against the model as you call it (loss, every trainable "
        "gradient, random draws replayed), and refuse (``UnsupportedModel``, naming the first layer, "
        "parameter or loss term that differs) a model they do not reproduce; a model over 1B "
        "parameters or on the meta device is proved through a tiny model of its config class. "
        "False: only through the tiny model (docs/models.md).",
        check=_true_or_false,
    )

    def __post_init__(self):
        for f in fields(self):  # each setting's own check, in field order
            check = f.metadata["check"]
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self._check_backward_partition()
        self._check_schedule()
        self._check_round_size()
        self._check_policy_options()
        self._check_fp16_accumulation()
        self._check_overlap_calls()

    def _check_backward_partition(self) -> None:
        if self.backward_partition is not None and not isinstance(self.partition, tuple):
            raise ConfigError(
                "backward_partition needs partition too (the forward stages, e.g. partition=(2, 3)); "
                f"partition={self.partition!r} chooses both"
            )

    def _check_schedule(self) -> None:
        if (
            self.schedule is not None
            and self.num_microbatches != "auto"
            and self.schedule.num_microbatches != self.num_microbatches
        ):
            raise ConfigError(
                f"the schedule is written for {self.schedule.num_microbatches} microbatches but "
                f"num_microbatches={self.num_microbatches}; make them equal"
            )

    def _check_round_size(self) -> None:
        """For a policy that deals in rounds, not given twice. Whether it covers the device count is
        checked when the pipeline knows its devices (the policy's table)."""
        r = self.round_size
        if r is None:
            return
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

    def _check_policy_options(self) -> None:
        if self.policy == "auto" and self.policy_options:
            from roundpipe.schedule import policy_options

            keys = set(self.policy_options)
            if not any(keys <= set(policy_options(p)) for p in known_policies()):
                raise ConfigError(
                    f"no policy takes the options {', '.join(sorted(keys))}; name the policy they are for"
                )

    def _check_overlap_calls(self) -> None:
        if self.overlap_calls and self.optimizer_mode != "async":
            raise ConfigError(
                "overlap_calls needs optimizer_mode='async' (a sync update must finish before the "
                "next call reads its weights); set both or neither"
            )

    def _check_fp16_accumulation(self) -> None:
        if self.fp16_accumulation and self.dtype != "fp16":
            raise ConfigError(
                f"fp16_accumulation needs dtype='fp16', not {self.dtype!r}; set both or neither"
            )

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]


def _docstring(cls: type) -> str:
    """The class docstring followed by an ``Args:`` entry per field, from each field's help."""
    lines = [cls.__doc__ or "", "", "    Args:"]
    for f in fields(cls):
        text = f"{f.name}: {f.metadata['help']}"
        lines.append(
            textwrap.fill(
                text, 100, break_on_hyphens=False, initial_indent=" " * 8, subsequent_indent=" " * 12
            )
        )
    return "\n".join(lines) + "\n    "


RunConfig.__doc__ = _docstring(RunConfig)
