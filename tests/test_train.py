"""The training product end to end: a recipe runs, stops and resumes exactly (also by SIGINT in a
subprocess, also on another device count), exports what loads with HF, and refuses what will not
fit in host RAM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import roundpipe
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.config import ScheduleConfig
from roundpipe.train.evaluation import exact_match
from roundpipe.train.lr_schedule import lr_at
from roundpipe.train.recipe import config_from_dict, dump_recipe
from roundpipe.train.trainer import Trainer

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent


def _recipe(tmp: Path, **groups) -> dict:
    """A tiny full-fine-tuning run on the synthetic reverse task (seconds on the cpu backend)."""
    recipe = {
        "model": {
            "config": {
                "model_type": "qwen3",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "max_position_embeddings": 64,
            },
            "tokenizer": "byte",
        },
        "data": {
            "train": str(tmp / "run" / "data" / "train.jsonl"),  # data.synthetic writes inside the run dir
            "eval": str(tmp / "run" / "data" / "eval.jsonl"),
            "synthetic": "reverse",
            "synthetic_samples": [400, 16],
            "prompt_template_no_input": "{instruction}>",
            "max_length": 24,
        },
        "run": {
            "name": "t",
            "output_dir": str(tmp / "run"),
            "devices": "cpu:2",
            "batch_size": 8,
            "num_microbatches": 2,
            "max_steps": 6,
            "grad_accum": 2,
        },  # fmt: skip
        "optim": {"lr": 3e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "eval": {"every": 3},
        "checkpoint": {"every": 3, "keep_last": 5},
        "logging": {"progress": False, "plots": False, "tensorboard": False},
    }
    for group, values in groups.items():
        recipe[group] = {**recipe.get(group, {}), **values}
    return recipe


def _masters(checkpoint: Path) -> dict[str, torch.Tensor]:
    _, state, _ = CheckpointManager(checkpoint.parent).load(checkpoint)
    return state["pipeline"]["masters"]


def _quiet(*_):
    pass


def test_a_run_stopped_and_resumed_is_bit_for_bit_the_uninterrupted_run(tmp_path):
    whole = Trainer(config_from_dict(_recipe(tmp_path / "a")), log=_quiet).fit()
    assert whole.steps == 6 and not whole.interrupted
    first = CheckpointManager(tmp_path / "a" / "run" / "checkpoints").list()[0]
    assert first.name == "step-00000003"
    # A second run directory resumes from the first run's step-3 checkpoint.
    resumed = Trainer(config_from_dict(_recipe(tmp_path / "b")), resume=str(first), log=_quiet).fit()
    assert resumed.train_losses == whole.train_losses[3:]  # exactly equal floats
    assert resumed.eval == whole.eval
    want, got = _masters(whole.checkpoint), _masters(resumed.checkpoint)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


# Runs compared bit for bit across device counts or processes must run the same plan, so they name
# it: roundpipe, one layer per stage (an "auto" choice is made per device count and per profile).
ONE_PLAN = {"policy": "roundpipe", "options": {"partition": None}}


@pytest.mark.slow
def test_a_run_resumes_exactly_on_a_different_device_count(tmp_path):
    whole = Trainer(config_from_dict(_recipe(tmp_path / "a", run=ONE_PLAN)), log=_quiet).fit()
    first = CheckpointManager(tmp_path / "a" / "run" / "checkpoints").list()[0]
    one_device = _recipe(tmp_path / "b", run={**ONE_PLAN, "devices": "cpu:1"})
    resumed = Trainer(config_from_dict(one_device), resume=str(first), log=_quiet).fit()
    assert resumed.train_losses == pytest.approx(whole.train_losses[3:], rel=1e-6)
    want, got = _masters(whole.checkpoint), _masters(resumed.checkpoint)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    # The cpu backend computes every layer the same way whichever device runs it.
    assert resumed.train_losses == whole.train_losses[3:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "dropout",
    [{"lora": {"enabled": True, "dropout": 0.1}}, {"model": {"attention_dropout": 0.1}}],
    ids=["lora", "full"],
)
def test_two_seeded_runs_with_dropout_on_give_identical_losses_and_weights(tmp_path, dropout):
    """Every random draw is seeded by (run.seed, step, layer, microbatch): a recipe trains the same
    bit for bit on cpu:2 with dropout on (and the dropout does change the run)."""

    def run(name: str, p: float):
        groups = {g: {k: (p if "dropout" in k else v) for k, v in d.items()} for g, d in dropout.items()}
        if "model" in groups:  # a field of the model's config
            base = _recipe(tmp_path / name)["model"]
            groups["model"] = {"config": {**base["config"], **groups["model"]}}
        recipe = _recipe(tmp_path / name, run={**ONE_PLAN, "max_steps": 3}, **groups)
        recipe["checkpoint"] = {"every": 3, "keep_last": 1}
        return Trainer(config_from_dict(recipe), log=_quiet).fit()

    a, b, off = run("a", 0.1), run("b", 0.1), run("c", 0.0)
    assert a.train_losses == b.train_losses  # exactly equal floats
    want, got = _masters(a.checkpoint), _masters(b.checkpoint)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert off.train_losses != a.train_losses, "the dropout is on"


def test_the_run_directory_holds_metrics_plots_timeline_and_an_export_hf_loads(tmp_path):
    import transformers

    recipe = _recipe(tmp_path, logging={"plots": True}, eval={"every": 3, "exact_match": True})
    result = Trainer(config_from_dict(recipe), log=_quiet).fit()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 3, 6]
    assert all(0.0 <= r["exact_match"] <= 1.0 for r in rows if r["kind"] == "eval")
    for name in ("loss.png", "timeline.png", "config.yaml"):
        assert (run / name).stat().st_size > 0, name
    trace = json.loads((run / "timeline.trace.json").read_text())
    assert trace["traceEvents"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(result.exports["merged"])
    masters = _masters(result.checkpoint)
    for name, p in merged.named_parameters():
        if name in masters:
            assert torch.equal(p.detach(), masters[name]), name


def test_lora_run_exports_an_adapter_peft_loads(tmp_path):
    import peft
    import transformers

    recipe = _recipe(tmp_path, lora={"enabled": True, "rank": 4, "alpha": 8}, optim={"lr": 1e-2})
    result = Trainer(config_from_dict(recipe), log=_quiet).fit()
    adapter = result.exports["adapter"]
    assert (adapter / "adapter_config.json").exists()
    masters = _masters(result.checkpoint)
    assert masters and all("lora" in n for n in masters)  # the checkpoint holds the adapters only
    base_cfg = transformers.AutoConfig.for_model(**_recipe(tmp_path)["model"]["config"], vocab_size=259)
    torch.manual_seed(0)  # the run's seed: the same random base the run started from
    base = transformers.AutoModelForCausalLM.from_config(base_cfg)
    loaded = peft.PeftModel.from_pretrained(base, str(adapter))
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B left zero init


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    peak = 1.0
    for kind in ("constant", "linear", "cosine"):
        s = ScheduleConfig(kind=kind, warmup_steps=4, min_lr_ratio=0.1)
        rates = [lr_at(i, 20, peak, s) for i in range(20)]
        assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
        assert rates[4] == pytest.approx(1.0)
        assert rates[-1] == pytest.approx(1.0 if kind == "constant" else 0.1)
        assert all(a >= b - 1e-12 for a, b in zip(rates[4:], rates[5:]))
    cos = ScheduleConfig(kind="cosine", warmup_steps=0)
    assert lr_at(5, 11, 1.0, cos) == pytest.approx(0.5)  # half-way down


def test_exact_match_is_the_share_of_answers_greedy_decoding_gets_right():
    from roundpipe.train.batches import eval_batches
    from roundpipe.train.data import Sample

    samples = [Sample((1, 2, 3, 4), (-100, -100, 3, 4), 2), Sample((1, 2, 5, 6), (-100, -100, 5, 6), 2)]

    class Oracle(torch.nn.Module):
        """Predicts token t+1 = t + 1: right for the first sample, wrong for the second."""

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            logits = torch.nn.functional.one_hot((input_ids + 1) % 8, 8).float()
            return type("Out", (), {"logits": logits})

    batches = list(eval_batches(samples, 2, 0))
    assert exact_match(Oracle(), batches, samples) == 0.5


def test_a_run_that_needs_more_host_ram_than_there_is_is_refused_with_the_levers(tmp_path, monkeypatch):
    import psutil

    class Tiny:
        available = 1 << 10

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny)
    with pytest.raises(roundpipe.HostMemoryError, match=r"lora.enabled.*run.host_ram_check: false"):
        Trainer(config_from_dict(_recipe(tmp_path)), log=_quiet).fit()


def test_train_help_documents_every_recipe_key(capsys):
    from roundpipe.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key in ("model.path", "lora.rank", "data.too_long", "run.grad_accum", "schedule.warmup_steps",
                "eval.exact_match", "checkpoint.keep_last", "logging.tensorboard"):  # fmt: skip
        assert key in out, key


def test_recipe_forecast_headers_are_in_step_with_the_simulator():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "recipe_forecasts.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_recipe_loads(tmp_path):
    from roundpipe.train.recipe import load_recipe

    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = load_recipe(path, [] if path.name == "demo.yaml" else ["model.path=/some/model"])
        assert cfg.run.batch_size >= 1, path.name


def _run_cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "roundpipe.cli", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_sigint_writes_a_checkpoint_and_resume_auto_continues_bit_for_bit(tmp_path):
    env = {**os.environ, "ROUNDPIPE_SANITIZE": "0", "PYTHONPATH": str(ROOT)}
    steps = 30
    runs = {}
    for name in ("whole", "cut"):
        recipe = _recipe(tmp_path / name, run={**ONE_PLAN, "max_steps": steps}, checkpoint={"every": None})
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_recipe(config_from_dict(recipe)))
        runs[name] = path
    whole = _run_cli([str(runs["whole"])], env)
    cut = _run_cli([str(runs["cut"])], env)
    metrics = tmp_path / "cut" / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count('"train"') >= 3:
            break
        time.sleep(0.05)
    cut.send_signal(signal.SIGINT)
    out, _ = cut.communicate(timeout=120)
    assert cut.returncode == 130, out
    assert "finishing this step" in out
    stopped_at = CheckpointManager(tmp_path / "cut" / "run" / "checkpoints").latest()
    assert stopped_at is not None and int(stopped_at.name.split("-")[1]) < steps, out
    resumed = _run_cli([str(runs["cut"]), "--resume", "auto"], env)
    out_r, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out_r
    out_w, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out_w

    def losses(name):
        rows = [json.loads(x) for x in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]

    assert losses("cut") == losses("whole")  # every step once, with the same loss
    want = _masters(CheckpointManager(tmp_path / "whole" / "run" / "checkpoints").latest())
    got = _masters(CheckpointManager(tmp_path / "cut" / "run" / "checkpoints").latest())
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.slow
def test_an_async_run_resumes_bit_for_bit_too(tmp_path):
    """The step after a resume computes on the weights from one update before the masters (the
    staleness-1 contract), so the checkpoint carries that compute copy as well."""
    run = {"optimizer_mode": "async"}
    whole = Trainer(config_from_dict(_recipe(tmp_path / "a", run=run)), log=_quiet).fit()
    first = CheckpointManager(tmp_path / "a" / "run" / "checkpoints").list()[0]
    resumed = Trainer(config_from_dict(_recipe(tmp_path / "b", run=run)), resume=str(first), log=_quiet).fit()
    assert resumed.train_losses == whole.train_losses[3:]
    want, got = _masters(whole.checkpoint), _masters(resumed.checkpoint)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_forecast_simulates_the_run_as_its_config_runs_it(monkeypatch):
    """The forecast before the first step simulates the head shards the model is wrapped with
    (``run.options.head_shards``), not a count of the simulator's own choosing."""
    from support.tiny_models import make_model

    import roundpipe.sim.scenario as scenario
    from roundpipe.backend import parse_device_spec
    from roundpipe.train.forecast import predict

    seen = []
    real = scenario.safe_run
    monkeypatch.setattr(scenario, "safe_run", lambda s, *a, **k: seen.append(s) or real(s, *a, **k))
    for shards in (1, 3):
        predict(
            make_model("llama"), parse_device_spec("cpu:2"), policy="roundpipe", seq_len=16, batch=4, microbatches=2,
            lora_rank=None, dtype="fp32", optimizer_mode="sync", head_shards=shards,
        )  # fmt: skip
    assert [s.head_shards for s in seen] == [1, 3]
