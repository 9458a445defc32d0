"""roundpipe: fine-tune Hugging Face LLMs on GPUs far smaller than the model.

All model state stays in CPU memory; GPUs are stateless workers that stream in a stage of layers,
run it for every microbatch, send results back and forget. Nothing runs at import time.
"""

from __future__ import annotations

from roundpipe.config import RunConfig
from roundpipe.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DeviceMemoryError,
    DeviceOutOfMemory,
    DeviceSpecError,
    HostMemoryError,
    InputError,
    OptimizerError,
    PipelineStateError,
    PlanError,
    RecipeError,
    RoundpipeError,
    ScheduleError,
    StageError,
    StreamProtocolError,
    UnsupportedModel,
    WatchdogTimeout,
)

__version__ = "0.1.0"


def wrap(model, config: RunConfig | None = None, *, weights=None):
    """Wrap a HF causal LM (optionally peft-wrapped) for training: returns a ``Pipeline``.

    ``weights`` (e.g. ``roundpipe.train.loading.SafetensorsWeights(model_dir)``) fills the model's
    parameters that are on the meta device straight into the pipeline's parameter store, so a model
    built without weights is loaded with one copy in host RAM; see ``Pipeline``.
    """
    from roundpipe.runtime import Pipeline

    return Pipeline(model, config, weights=weights)


def __getattr__(name):  # lazy: importing roundpipe must not import torch-heavy modules
    if name in ("Pipeline", "StepOutput"):
        import roundpipe.runtime as rt

        return getattr(rt, name)
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DeviceMemoryError",
    "DeviceOutOfMemory",
    "DeviceSpecError",
    "HostMemoryError",
    "InputError",
    "OptimizerError",
    "Pipeline",
    "PipelineStateError",
    "PlanError",
    "RecipeError",
    "RoundpipeError",
    "RunConfig",
    "ScheduleError",
    "StageError",
    "StepOutput",
    "StreamProtocolError",
    "UnsupportedModel",
    "WatchdogTimeout",
    "wrap",
]
