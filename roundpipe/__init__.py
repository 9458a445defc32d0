"""roundpipe: fine-tune Hugging Face LLMs on GPUs far smaller than the model.

All model state stays in CPU memory; GPUs are stateless workers that stream in a stage of layers,
run it for every microbatch, send results back and forget. Nothing runs at import time.
"""

from __future__ import annotations

from roundpipe.config import RunConfig
from roundpipe.errors import (
    ConfigError,
    DeviceOutOfMemory,
    DeviceSpecError,
    InputError,
    OptimizerError,
    PipelineStateError,
    PlanError,
    RoundpipeError,
    ScheduleError,
    StageError,
    StreamProtocolError,
    UnsupportedModel,
    WatchdogTimeout,
)

__version__ = "0.1.0"


def wrap(model, config: RunConfig | None = None):
    """Wrap a HF causal LM (optionally peft-wrapped) for training: returns a ``Pipeline``."""
    from roundpipe.runtime import Pipeline

    return Pipeline(model, config)


def __getattr__(name):  # lazy: importing roundpipe must not import torch-heavy modules
    if name in ("Pipeline", "StepOutput"):
        import roundpipe.runtime as rt

        return getattr(rt, name)
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "DeviceOutOfMemory",
    "DeviceSpecError",
    "InputError",
    "OptimizerError",
    "Pipeline",
    "PipelineStateError",
    "PlanError",
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
