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


def test_a_microbatch_count_chosen_from_timing_is_recorded_and_the_run_says_it_may_differ(tmp_path):
    lines: list[str] = []
    Trainer(config_from_dict(_short(tmp_path, num_microbatches="auto")), log=lines.append).fit()
    record = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert "num_microbatches" in record["chosen_from_timing"]
    m = record["num_microbatches"]
    assert record["repeat_with"] == {"run.num_microbatches": m}
    warning = next(line for line in lines if "may differ" in line)
    assert f"run.num_microbatches: {m}" in warning


def test_every_recipe_names_what_changes_its_numbers_so_two_runs_repeat():
    """A microbatch count chosen from timing (num_microbatches: auto) changes the losses from one
    run to the next; the shipped recipes give theirs."""
    from test_train import ROOT

    from roundpipe.train.recipe import load_recipe

    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = load_recipe(path, [] if path.name == "demo.yaml" else ["model.path=/some/model"])
        assert cfg.run.num_microbatches != "auto", path.name


def _chats(path: Path, count: int) -> Path:
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            ask = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 4))
            chat = [{"role": "user", "content": f"reverse: {ask}"}]
            chat.append({"role": "assistant", "content": " ".join(reversed(ask.split()))})
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


def _shrunk_chat_sft(tmp: Path, name: str) -> list[str]:
    """recipes/chat-sft.yaml as it ships, on a tiny model, two devices and a few steps."""
    tiny = _recipe(tmp)["model"]["config"]
    return [
        "model.path=null",
        "model.tokenizer=byte",
        f"model.config={json.dumps(tiny)}",
        f"data.train={_chats(tmp / 'chats.jsonl', 200)}",
        "data.max_length=64",
        "run.devices=cpu:2",
        f"run.output_dir={tmp / name}",
        "run.max_steps=3",
        "logging.progress=false",
        "logging.plots=false",
        "logging.tensorboard=false",
    ]


@pytest.mark.slow
def test_two_runs_of_the_chat_sft_recipe_give_identical_losses(tmp_path):
    from test_train import ROOT

    from roundpipe.train.recipe import load_recipe

    losses = []
    for name in ("a", "b"):
        cfg = load_recipe(ROOT / "recipes" / "chat-sft.yaml", _shrunk_chat_sft(tmp_path, name))
        Trainer(cfg, log=_quiet).fit()
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["kind"], r["step"], r["loss"]) for r in rows])
    assert len([r for r in losses[0] if r[0] == "train"]) == 3
    assert losses[0] == losses[1]  # exactly equal floats


def test_a_held_out_batch_smaller_than_the_microbatch_count_runs_with_fewer_microbatches(tmp_path):
    recipe = _recipe(
        tmp_path,
        run={"batch_size": 16, "num_microbatches": 16, "max_steps": 1, "grad_accum": 1},
        data={"synthetic_samples": [64, 10]},
        eval={"every": 1},
        checkpoint={"every": None, "at_end": False},
    )
    result = Trainer(config_from_dict(recipe), log=_quiet).fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1]
    assert result.eval["loss"] > 0


def test_an_error_in_a_held_out_batch_says_it_was_the_evaluation(tmp_path, monkeypatch):
    from roundpipe.errors import InputError
    from roundpipe.runtime.pipeline import Pipeline

    def refuse(self, input_ids, **_):
        raise InputError(f"a batch of {len(input_ids)} samples is refused")

    monkeypatch.setattr(Pipeline, "evaluate", refuse)
    recipe = _short(tmp_path)
    with pytest.raises(
        InputError, match=r"^held-out evaluation at step 0, batch 1 of 1 \(4 samples\).*: a batch"
    ):
        Trainer(config_from_dict(recipe), log=_quiet).fit()


def test_the_train_command_refuses_a_used_run_directory_with_exit_code_2_and_offers_overwrite(
    tmp_path, capsys
):
    from roundpipe.commands.train import main
    from roundpipe.train.recipe import dump_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(dump_recipe(config_from_dict(_short(tmp_path))))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    with pytest.raises(SystemExit) as stop:
        main([str(recipe)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "holds a run (metrics.jsonl)" in err and "--overwrite" in err
    with pytest.raises(SystemExit) as stop:
        main([str(recipe), "--overwrite", "--resume", "auto"])
    assert stop.value.code == 2


@pytest.mark.slow
def test_a_resumed_run_keeps_the_count_auto_chose_and_says_when_it_differs_from_plan_json(tmp_path):
    recipe = _short(tmp_path, num_microbatches="auto", max_steps=3)
    whole = Trainer(config_from_dict(recipe), log=_quiet).fit()
    record = tmp_path / "run" / "plan.json"
    first = json.loads(record.read_text())
    lines: list[str] = []
    step_1 = tmp_path / "run" / "checkpoints" / "step-00000001"
    resumed = Trainer(config_from_dict(recipe), resume=str(step_1), log=lines.append).fit()
    assert resumed.train_losses == whole.train_losses[1:]  # the checkpoint's profile: the same count
    assert not any("differ" in line for line in lines)
    assert json.loads(record.read_text()) == first  # the first run's record stays
    record.write_text(json.dumps({**first, "num_microbatches": 999}))
    lines.clear()
    Trainer(config_from_dict(recipe), resume=str(step_1), log=lines.append).fit()
    assert any("the first run into 999" in line for line in lines)


def test_an_error_in_the_exact_match_says_it_was_the_evaluation(tmp_path, monkeypatch):
    import roundpipe.train.evaluation as evaluation

    def fail(*_):
        raise ValueError("no answer")

    monkeypatch.setattr(evaluation, "exact_match", fail)
    recipe = _short(tmp_path)
    recipe["eval"]["exact_match"] = True
    with pytest.raises(ValueError, match=r"^held-out exact match at step 0 \(eval.exact_match\): no answer"):
        Trainer(config_from_dict(recipe), log=_quiet).fit()
