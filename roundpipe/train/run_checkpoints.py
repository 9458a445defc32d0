"""A training run's checkpoints: what one holds, and how the loop writes and reads it.

A checkpoint is the Pipeline's state dict (fp32 masters or adapters, optimizer moments and step
counts, loss scaler, step counter) plus the data position and the host RNG states, and the recipe
beside it; none of it depends on the device count, so a run resumes on another one. Every rank
saves and restores together: with optimizer sharding each rank's optimizer state goes into its own
file (``checkpoint_shards``), else rank 0's state is the whole of it. After a failed step,
``after_failure`` keeps the last completed step when the failure left it intact.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from roundpipe.errors import CheckpointError
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.checkpoint_shards import Shard
from roundpipe.train.config import TrainConfig
from roundpipe.train.ranks import Ranks
from roundpipe.train.recipe import dump_recipe


class RunCheckpoints:
    """The checkpoints of one run, under ``manager``, saved and restored by every one of ``ranks``.
    ``log`` takes rank 0's lines."""

    def __init__(self, manager: CheckpointManager, config: TrainConfig, ranks: Ranks, log):
        self.manager = manager
        self.config = config
        self.ranks = ranks
        self.log = log

    @staticmethod
    def position(batches) -> dict:
        """The data position and host RNG states: what a checkpoint needs besides the pipeline."""
        return {
            "data": batches.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def save(self, step: int, pipe, batches, position: dict | None = None) -> Path:
        """Write checkpoint ``step`` (every rank calls it). With optimizer sharding each rank's
        optimizer state goes into its own file; otherwise rank 0's state is the whole of it."""
        position = position or self.position(batches)
        pipeline = pipe.state_dict()
        shard = None
        if pipeline.pop("optimizer_shard", None) is not None:  # which rank wrote it: state.json says
            optimizer = dict(pipeline["optimizer"])
            shard = Shard(("pipeline", "optimizer", "state"), optimizer.pop("state"))
            pipeline["optimizer"] = optimizer
        state = {"step": step, "pipeline": pipeline, **position}
        ranks = self.ranks
        path = self.manager.save(
            step,
            state if ranks.is_main else None,
            extra_files={"config.yaml": dump_recipe(self.config).encode()},
            shard=shard,
            group=ranks if ranks.distributed else None,
        )
        self.log(f"checkpoint: {path}")
        return path

    def restore(self, path: Path, pipe, batches) -> int:
        """Load checkpoint ``path`` on every rank: rank 0 verifies every file against the manifest
        (once: the files are the same for all), then each rank reads it; a sharded optimizer state
        comes back as the union of every rank's part, of which each pipeline takes its own."""
        manager = self.manager
        self.ranks.on_main(lambda: manager.verify(path) and None)
        step, state, _ = manager.load(path, hash_files=False)
        if state.get("step") != step:
            raise CheckpointError(f"{path}: the state says step {state.get('step')} but the manifest {step}")
        pipe.load_state_dict(state["pipeline"])
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_tuples(state["rng"]["python"]))
        return step

    def after_failure(self, step: int, pipe, before: dict) -> Path | None:
        """Step ``step + 1`` failed: checkpoint the last completed step (``step``, its position
        ``before``) when the failure left it intact (``Pipeline.abandon_step``) and none holds it
        yet; return the checkpoint written, else None (each case says why in the log)."""
        if not self.config.checkpoint.on_error:
            return None
        manager = self.manager
        if self.ranks.distributed:  # the ranks may be in different collectives: none can save now
            last = manager.latest_step()
            self.log(
                "no checkpoint written: under data parallelism a failed step leaves the ranks in "
                "different places; "
                + (
                    f"--resume auto continues from the last periodic checkpoint (step {last})"
                    if last is not None
                    else "no periodic checkpoint exists yet"
                )
            )
            return None
        if not pipe.abandon_step():
            self.log(
                f"no checkpoint written: step {step + 1} failed half-way through its optimizer update "
                "(some layers hold the new weights, some the old); resume from the last checkpoint"
            )
            return None
        if manager.latest_step() == step:
            self.log(f"checkpoint of step {step} already written; resume with --resume auto")
            return None
        if step == 0:  # nothing trained yet (a refused plan, a first batch that failed): nothing to keep
            self.log("no checkpoint written: the first step failed, there is nothing to resume from")
            return None
        try:
            path = self.save(step, pipe, None, position=before)
            self.log(f"wrote a checkpoint of step {step}, the last completed one; resume with --resume auto")
        except Exception as save_err:  # the error that stopped the run stays the one raised
            self.log(f"could not write a checkpoint after the failure: {type(save_err).__name__}: {save_err}")
            return None
        return path


def _as_tuples(state):
    """``random.setstate`` wants tuples where a JSON round trip may have left lists."""
    if isinstance(state, list):
        return tuple(_as_tuples(x) for x in state)
    return state
