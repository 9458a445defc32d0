"""The training product: ``roundpipe train RECIPE.yaml`` and ``Trainer(TrainConfig(...)).fit()``.

``config`` holds the TrainConfig tree, ``recipe`` reads YAML into it, ``data_files``, ``data``,
``batches`` and ``tokenizer`` turn local files into batches, ``loading`` builds or loads the
model, ``checkpoint`` writes and verifies checkpoints, ``export`` writes peft adapters and merged
models, ``trainer`` runs the loop.
Nothing heavy is imported until used.
"""

from __future__ import annotations

from roundpipe.train.config import TrainConfig


def __getattr__(name):
    if name == "Trainer":
        from roundpipe.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'roundpipe.train' has no attribute {name!r}")


__all__ = ["TrainConfig", "Trainer"]
