"""The run directory belongs to one run: a second run into it is refused unless it resumes or asks
to overwrite; ``--resume auto`` never falls back past a damaged checkpoint; the recipes repeat bit
for bit; a short held-out batch runs with fewer microbatches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import _quiet, _recipe

from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.recipe import config_from_dict
from roundpipe.train.trainer import Trainer

torch.set_num_threads(1)


def _short(tmp: Path, **run) -> dict:
    return _recipe(
        tmp,
        run={"max_steps": 2, **run},
        data={"synthetic_samples": [40, 4]},
        checkpoint={"every": 1, "keep_last": 5},
    )


def test_a_second_run_into_a_run_directory_is_refused_without_resume_or_overwrite(tmp_path):
    Trainer(config_from_dict(_short(tmp_path)), log=_quiet).fit()
    run_dir = tmp_path / "run"
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"holds a run.*--resume auto.*--overwrite"):
        Trainer(config_from_dict(_short(tmp_path)), log=_quiet).fit()
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing touched


@pytest.mark.slow
def test_overwrite_clears_the_old_runs_outputs_and_says_what_it_removed(tmp_path):
    Trainer(config_from_dict(_short(tmp_path, max_steps=3)), log=_quiet).fit()
    run_dir = tmp_path / "run"
    assert CheckpointManager(run_dir / "checkpoints").latest_step() == 3
    lines: list[str] = []
    result = Trainer(config_from_dict(_short(tmp_path)), overwrite=True, log=lines.append).fit()
    assert result.steps == 2
    removed = next(line for line in lines if line.startswith("overwrite:"))
    assert "checkpoints" in removed and "metrics.jsonl" in removed and "export" in removed
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    # resume auto now finds this run's step 2, not the old run's step 3
    assert CheckpointManager(run_dir / "checkpoints").latest_step() == 2
    assert (run_dir / "data" / "train.jsonl").is_file()  # the recipe's data files are not outputs


def test_overwrite_and_resume_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="overwrite"):
        Trainer(config_from_dict(_short(tmp_path)), resume="auto", overwrite=True)


def test_resume_auto_refuses_a_newest_checkpoint_without_its_manifest_and_names_the_older_one(tmp_path):
    Trainer(config_from_dict(_short(tmp_path)), log=_quiet).fit()
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-00000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-00000002.*--resume \S*step-00000001"):
        Trainer(config_from_dict(_short(tmp_path)), resume="auto", log=_quiet).fit()
    assert (checkpoints / "step-00000001" / "manifest.json").is_file()


def _save(manager: CheckpointManager, step: int) -> Path:
    return manager.save(step, {"w": torch.full((4,), float(step))})


def test_keep_last_counts_only_good_checkpoints_and_never_deletes_one_for_a_damaged_one(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    _save(manager, 1)
    damaged = _save(manager, 3)
    with open(damaged / "tensors.safetensors", "r+b") as f:
        f.truncate(8)
    _save(manager, 2)  # resumed from step 1 by hand, as the error for step 3 says
    assert [p.name for p in manager.list()] == ["step-00000001", "step-00000002", "step-00000003"]
    manager.verify(tmp_path / "step-00000001")  # still whole: one of the two good ones kept
