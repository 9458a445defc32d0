"""CPU optimizer driver: layer-wise fused AdamW on fp32 masters, loss scaling."""

from roundpipe.optim.adamw import (
    LayerwiseAdamW,
    MasterStore,
    OptimizerConfig,
    SteppedEntry,
    clip_factor,
    grad_of,
    master_of,
)
from roundpipe.optim.scaler import DynamicLossScaler

__all__ = [
    "DynamicLossScaler",
    "LayerwiseAdamW",
    "MasterStore",
    "OptimizerConfig",
    "SteppedEntry",
    "clip_factor",
    "grad_of",
    "master_of",
]
