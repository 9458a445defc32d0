"""``roundpipe train`` under torchrun (issue 15 item 3): N ranks train as one process, rank 0 alone
writes the run directory, checkpoints hold every rank's optimizer shard under one manifest and
resume on any number of ranks, a SIGKILLed rank is recovered by ``--max-restarts`` with no step
lost, and a rank that raises ends every rank. The host-memory guard counts optimizer sharding.

The torchrun tests launch ``python -m torch.distributed.run`` on a free loopback port, two ranks
of ``cpu:1`` each, on the tiny recipe of tests/test_train.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_train import _recipe

from roundpipe.errors import CheckpointError, ConfigError, RecipeError
from roundpipe.testing.faults import Fault
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.checkpoint_shards import Shard, ShardUnion
from roundpipe.train.recipe import config_from_dict, dump_recipe
from roundpipe.train.trainer import Trainer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
OPTIMIZER_STATE = ("pipeline", "optimizer", "state")
# One plan for every run compared (an "auto" choice is made per profile): roundpipe, one layer per
# stage, on one cpu device per rank.
ONE_PLAN = {"devices": "cpu:1", "policy": "roundpipe", "options": {"partition": None}}
SHARDED = {**ONE_PLAN, "optimizer_sharding": "nodes"}


def _quiet(*_):
    pass


# ---------------------------------------------------------------------------------------------------
# Sharded checkpoint files, saved by ranks that are threads of this process (the exchange through
# an in-memory stand-in for torch.distributed's object collectives; the torchrun tests below run
# the same code on gloo).


class _Exchange:
    """What the threads of one save share: a barrier and a slot per rank."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world


class _ThreadRank:
    """One thread's rank: ``all_gather_object`` and ``broadcast_object`` over ``_Exchange``."""

    def __init__(self, exchange: _Exchange, rank: int):
        self.exchange, self.rank, self.world_size = exchange, rank, len(exchange.slots)

    def all_gather_object(self, obj):
        self.exchange.slots[self.rank] = obj
        self.exchange.barrier.wait()
        out = list(self.exchange.slots)
        self.exchange.barrier.wait()
        return out

    def broadcast_object(self, obj, src=0):
        return self.all_gather_object(obj)[src]


def _save_on_ranks(root: Path, step: int, main_state: dict, parts: list[dict]) -> list:
    """Every rank's ``save`` of ``step`` (rank r's shard: ``parts[r]``); each rank's path or exception."""
    exchange = _Exchange(len(parts))
    outcomes: list = [None] * len(parts)

    def run(rank: int):
        manager = CheckpointManager(root, keep_last=5, repair=rank == 0)
        try:
            outcomes[rank] = manager.save(
                step,
                main_state if rank == 0 else None,
                extra_files={"config.yaml": b"run: {}\n"},
                shard=Shard(OPTIMIZER_STATE, parts[rank]),
                group=_ThreadRank(exchange, rank),
            )
        except Exception as e:
            outcomes[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def _adam_state(name: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=gen), "note": name}


def _main_state() -> dict:
    return {
        "step": 7,
        "pipeline": {"masters": {"w": torch.arange(6.0)}, "optimizer": {"config": {"lr": 0.1}}},
    }


def test_every_rank_writes_its_shard_and_rank_0_seals_one_manifest_over_all(tmp_path):
    parts = [{f"layer{i}.w": _adam_state(f"layer{i}", i) for i in range(r * 3, r * 3 + 3)} for r in range(3)]
    paths = _save_on_ranks(tmp_path, 7, _main_state(), parts)
    assert paths == [tmp_path / "step-00000007"] * 3, paths
    manifest = json.loads((paths[0] / "manifest.json").read_text())
    names = set(manifest["files"])
    assert {f"rank-{r:05d}-of-00003.safetensors" for r in range(3)} <= names
    assert {"tensors.safetensors", "state.json", "config.yaml"} <= names
    assert manifest["format_version"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    step, state, extra = CheckpointManager(tmp_path).load(paths[0])
    union = state["pipeline"]["optimizer"]["state"]
    assert step == 7 and extra == {"config.yaml": b"run: {}\n"}
    assert isinstance(union, ShardUnion) and union.world_size == 3
    assert sorted(union) == sorted(k for part in parts for k in part)
    for part in parts:
        for key, want in part.items():
            got = union[key]
            assert got["note"] == want["note"] and torch.equal(got["exp_avg"], want["exp_avg"]), key
    assert torch.equal(state["pipeline"]["masters"]["w"], torch.arange(6.0))
    assert state["pipeline"]["optimizer"]["config"] == {"lr": 0.1}


def test_a_rank_that_fails_mid_save_fails_it_on_every_rank_and_the_previous_checkpoint_stays(tmp_path):
    good = [{"a.w": _adam_state("a", 0)}, {"b.w": _adam_state("b", 1)}]
    first = _save_on_ranks(tmp_path, 3, _main_state(), good)
    assert first == [tmp_path / "step-00000003"] * 2
    broken = [{"a.w": _adam_state("a", 2)}, {"b.w": object()}]  # rank 1 cannot store its part
    outcomes = _save_on_ranks(tmp_path, 6, _main_state(), broken)
    assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
    assert "failed on rank 1" in str(outcomes[0]) and "older checkpoints are untouched" in str(outcomes[0])
    manager = CheckpointManager(tmp_path)
    assert manager.list() == [tmp_path / "step-00000003"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    _, state, _ = manager.load(manager.latest())
    assert torch.equal(state["pipeline"]["optimizer"]["state"]["b.w"]["exp_avg"], good[1]["b.w"]["exp_avg"])


def test_a_damaged_rank_shard_is_refused_naming_the_file(tmp_path):
    parts = [{"a.w": _adam_state("a", 0)}, {"b.w": _adam_state("b", 1)}]
    (path, _) = _save_on_ranks(tmp_path, 2, _main_state(), parts)
    shard = path / "rank-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.safetensors has sha256"):
        CheckpointManager(tmp_path).load(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.safetensors is missing"):
        CheckpointManager(tmp_path).load(path)


# ---------------------------------------------------------------------------------------------------
# Host memory, faults and settings


def test_the_host_memory_guard_counts_the_adamw_state_of_one_rank_with_optimizer_sharding(monkeypatch):
    import psutil
    import transformers

    from roundpipe.errors import HostMemoryError
    from roundpipe.train.forecast import check_host_ram, host_ram_needed

    config = transformers.AutoConfig.for_model(**_recipe(Path("/x"))["model"]["config"], vocab_size=259)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    trainable = sum(p.numel() for p in model.parameters())
    alone = host_ram_needed(model, "fp32", "sync", 64)
    for ranks in (2, 4):
        shared = host_ram_needed(model, "fp32", "sync", 64, optimizer_shards=ranks)
        # Two fp32 moments per trainable parameter: 8 bytes, of which each rank holds 1/N.
        assert alone.store_bytes - shared.store_bytes == pytest.approx(8 * trainable * (1 - 1 / ranks), abs=8)
        assert shared.handoff_bytes == alone.handoff_bytes

    class Fits:  # one rank's need fits, two ranks' on this node do not
        available = alone.total * 3 // 2

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Fits)
    assert "available" in check_host_ram(alone, lora=False, dtype="fp32", ranks_here=1)
    with pytest.raises(HostMemoryError, match=r"2 ranks on this node.*run.optimizer_sharding: nodes"):
        check_host_ram(alone, lora=False, dtype="fp32", ranks_here=2)


def test_faults_can_fire_on_one_rank_and_in_one_torchrun_attempt(monkeypatch):
    fault = Fault("data", kind="kill", step=5, rank=1, restart=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not fault.matches("data", {"step": 5})
    monkeypatch.setenv("RANK", "1")
    assert fault.matches("data", {"step": 5})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted ranks run on
    assert not fault.matches("data", {"step": 5})
    with pytest.raises(ConfigError, match="rank is a non-negative int"):
        Fault("data", rank=-1)


def test_the_data_parallel_recipe_keys_reach_the_run_config_and_off_refuses_several_ranks(
    tmp_path, monkeypatch
):
    from roundpipe.train.ranks import Ranks

    recipe = _recipe(tmp_path, run={"optimizer_sharding": "nodes", "dp_timeout_s": 20})
    cfg = config_from_dict(recipe)
    assert (cfg.run.data_parallel, cfg.run.optimizer_sharding, cfg.run.dp_timeout_s) == (
        "auto",
        "nodes",
        20.0,
    )
    with pytest.raises(RecipeError, match="run.optimizer_sharding must be one of none, nodes"):
        config_from_dict(_recipe(tmp_path, run={"optimizer_sharding": "all"}))
    with pytest.raises(RecipeError, match="run.options.data_parallel is set by run.data_parallel"):
        config_from_dict(_recipe(tmp_path, run={"options": {"data_parallel": "off"}}))
    with pytest.raises(RecipeError, match="run.dp_timeout_s must be a positive"):
        config_from_dict(_recipe(tmp_path, run={"dp_timeout_s": 0}))
    assert not Ranks.from_environment("off", 30.0).distributed  # no launcher: one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="run.data_parallel is off but this process is one of WORLD_SIZE=2"):
        Ranks.from_environment("off", 30.0)
    ranks = Ranks.from_environment("auto", 30.0)
    assert (ranks.rank, ranks.world_size, ranks.is_main) == (1, 2, False)


def test_auto_devices_give_each_rank_on_a_server_its_own_share_of_the_gpus(tmp_path, monkeypatch):
    from roundpipe.errors import DeviceSpecError
    from roundpipe.train.ranks import Ranks
    from roundpipe.train.run_setup import rank_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    run = config_from_dict(_recipe(tmp_path, run={"devices": "auto"})).run
    shares = []
    for local_rank in range(2):
        ranks = Ranks(rank=local_rank, world_size=4, local_rank=local_rank, local_world_size=2)
        shares.append(rank_devices(run, ranks))
    assert shares == ["cuda:0,1,2,3", "cuda:4,5,6,7"]
    assert rank_devices(run, Ranks(rank=0, world_size=2)) == "auto"  # one rank per server: all of them
    with pytest.raises(DeviceSpecError, match="16 ranks on this server share 8 GPUs"):
        rank_devices(run, Ranks(rank=0, world_size=16, local_rank=0, local_world_size=16))


# ---------------------------------------------------------------------------------------------------
# torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_recipe(tmp: Path, **groups) -> Path:
    path = tmp / "recipe.yaml"
    tmp.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_recipe(config_from_dict(_recipe(tmp, **groups))))
    return path


def _torchrun(tmp: Path, recipe: Path, *args: str, faults: list | None = None, restarts: int = 0):
    """``torchrun --nproc-per-node 2 -m roundpipe.cli train RECIPE ARGS``; (exit code, per-attempt
    per-rank logs {(attempt, rank): (stdout, stderr)})."""
    logs = tmp / f"logs-{_free_port()}"
    env = {**os.environ, "ROUNDPIPE_SANITIZE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("ROUNDPIPE_FAULTS", None)
    if faults:
        env["ROUNDPIPE_FAULTS"] = json.dumps(faults)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", str(restarts),
               "--log-dir", str(logs), "--redirects", "3",
               "-m", "roundpipe.cli", "train", str(recipe), *args]  # fmt: skip
    # A guard against a hang, not a timing: every run here takes well under a minute.
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    found = {}
    for out in logs.glob("*/attempt_*/*/stdout.log"):
        attempt, rank = int(out.parent.parent.name.split("_")[1]), int(out.parent.name)
        found[attempt, rank] = (out.read_text(), (out.parent / "stderr.log").read_text())
    return done.returncode, found, done.stderr


def _rows(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in _rows(run_dir)]


def _masters(checkpoint: Path) -> dict[str, torch.Tensor]:
    _, state, _ = CheckpointManager(checkpoint.parent).load(checkpoint)
    return state["pipeline"]["masters"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The recipe in this process on cpu:1: 6 steps, a checkpoint every 3."""
    tmp = tmp_path_factory.mktemp("one")
    cfg = config_from_dict(_recipe(tmp, run=ONE_PLAN))
    Trainer(cfg, log=_quiet).fit()
    return tmp / "run"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The same recipe on two sharded ranks of cpu:1 each, uninterrupted."""
    tmp = tmp_path_factory.mktemp("two")
    code, logs, err = _torchrun(tmp, _write_recipe(tmp, run=SHARDED))
    assert code == 0, err[-3000:]
    return tmp / "run", logs


@pytest.mark.slow
def test_two_ranks_train_as_one_process_and_only_rank_0_writes(one_process, two_ranks):
    run, logs = two_ranks
    want, got = _losses(one_process), _losses(run)
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]  # each step logged once: by one rank
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5)
    ev_want, ev_got = _rows(one_process, "eval"), _rows(run, "eval")
    assert [r["loss"] for r in ev_got] == pytest.approx([r["loss"] for r in ev_want], rel=1e-5)
    final = CheckpointManager(run / "checkpoints").latest()
    for name, tensor in _masters(CheckpointManager(one_process / "checkpoints").latest()).items():
        torch.testing.assert_close(_masters(final)[name], tensor, rtol=1e-4, atol=1e-6)
    # Rank 0 printed and logged everything, rank 1 nothing.
    stdout0, _ = logs[0, 0]
    stdout1, stderr1 = logs[0, 1]
    assert "step     6/6" in stdout0 and "done: 6 steps" in stdout0
    assert stdout1 == "" and "roundpipe train" not in stderr1, (stdout1, stderr1)
    log = (run / "train.log").read_text()
    assert log.count("data parallel: 2 ranks") == 1 and log.count("checkpoint: ") == 2
    # One manifest over the masters and both ranks' optimizer shards.
    manifest = json.loads((final / "manifest.json").read_text())
    assert {
        "tensors.safetensors",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    } <= set(manifest["files"])
    _, state, _ = CheckpointManager(final.parent).load(final)
    assert sorted(state["pipeline"]["optimizer"]["state"]) == sorted(state["pipeline"]["masters"])


@pytest.mark.slow
def test_a_rank_sigkilled_mid_run_is_restarted_by_torchrun_and_no_step_is_lost(tmp_path, two_ranks):
    run_uninterrupted, _ = two_ranks
    kill = [{"where": "data", "step": 5, "kind": "kill", "rank": 1, "restart": 0}]
    recipe = _write_recipe(tmp_path, run=SHARDED)
    code, logs, err = _torchrun(tmp_path, recipe, "--resume", "auto", faults=kill, restarts=1)
    assert code == 0, err[-3000:]
    assert (1, 0) in logs, "torchrun restarted the ranks"
    assert "resumed from" in (tmp_path / "run" / "train.log").read_text()
    assert "step-00000003 at step 3" in (tmp_path / "run" / "train.log").read_text()
    # Every step once, with the uninterrupted run's losses and final weights, bit for bit.
    assert _losses(tmp_path / "run") == _losses(run_uninterrupted)
    want = _masters(CheckpointManager(run_uninterrupted / "checkpoints").latest())
    got = _masters(CheckpointManager(tmp_path / "run" / "checkpoints").latest())
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_rank_and_a_one_rank_checkpoint_on_two(
    tmp_path, one_process, two_ranks
):
    run_two, _ = two_ranks
    # The 2-rank sharded checkpoint of step 3, resumed by one process.
    sharded = CheckpointManager(run_two / "checkpoints").list()[0]
    assert sharded.name == "step-00000003" and (sharded / "rank-00001-of-00002.safetensors").is_file()
    alone = Trainer(config_from_dict(_recipe(tmp_path / "a", run=ONE_PLAN)), resume=str(sharded), log=_quiet)
    resumed = alone.fit()
    assert resumed.train_losses[0] == pytest.approx(dict(_losses(run_two))[4], rel=1e-5)
    # The 1-process checkpoint of step 3, resumed on two sharded ranks.
    single = CheckpointManager(one_process / "checkpoints").list()[0]
    assert single.name == "step-00000003" and not list(single.glob("rank-*"))
    recipe = _write_recipe(tmp_path / "b", run=SHARDED)
    code, _, err = _torchrun(tmp_path / "b", recipe, "--resume", str(single))
    assert code == 0, err[-3000:]
    losses = dict(_losses(tmp_path / "b" / "run"))
    assert sorted(losses) == [4, 5, 6]
    assert losses[4] == pytest.approx(dict(_losses(one_process))[4], rel=1e-5)
    assert [losses[s] for s in (5, 6)] == pytest.approx(
        [dict(_losses(one_process))[s] for s in (5, 6)], rel=1e-5
    )


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_with_a_clear_error(tmp_path):
    # dp_timeout_s is far longer than the run: the ranks end because the failure is seen, not waited out.
    recipe = _write_recipe(tmp_path, run={**SHARDED, "dp_timeout_s": 900})
    code, logs, _ = _torchrun(
        tmp_path, recipe, faults=[{"where": "data", "step": 3, "kind": "error", "rank": 1}]
    )
    assert code != 0
    (_, err0), (_, err1) = logs[0, 0], logs[0, 1]
    assert "roundpipe train [rank 1/2]: failed: InjectedFault: injected fault at data (step=3)" in err1
    assert "roundpipe train [rank 0/2]: failed: DataParallelError" in err0, err0
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 3 failed: DataParallelError" in log and "no checkpoint written" in log


@pytest.mark.slow
def test_a_rank_failing_mid_save_leaves_the_last_checkpoint_and_resume_continues_it(tmp_path, two_ranks):
    run_uninterrupted, _ = two_ranks
    recipe = _write_recipe(tmp_path, run=SHARDED, checkpoint={"every": 2, "keep_last": 5})
    fail = [{"where": "checkpoint", "step": 4, "kind": "error", "rank": 1}]
    code, logs, _ = _torchrun(tmp_path, recipe, faults=fail)
    assert code != 0
    for rank in (0, 1):
        assert "writing checkpoint" in logs[0, rank][1] or "InjectedFault" in logs[0, rank][1], logs[0, rank][
            1
        ]
    assert "failed on rank 1" in logs[0, 0][1]
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-00000002"]  # no half checkpoint, no .tmp-*
    code, _, err = _torchrun(tmp_path, recipe, "--resume", "auto")
    assert code == 0, err[-3000:]
    assert _losses(tmp_path / "run") == _losses(run_uninterrupted)


@pytest.mark.slow
def test_an_unsharded_two_rank_run_checkpoints_one_optimizer_copy(tmp_path, one_process):
    recipe = _write_recipe(tmp_path, run=ONE_PLAN)
    code, _, err = _torchrun(tmp_path, recipe)
    assert code == 0, err[-3000:]
    assert [loss for _, loss in _losses(tmp_path / "run")] == pytest.approx(
        [loss for _, loss in _losses(one_process)], rel=1e-5
    )
    final = CheckpointManager(tmp_path / "run" / "checkpoints").latest()
    assert not list(final.glob("rank-*"))
    assert json.loads((final / "manifest.json").read_text())["format_version"] == 1
    _, state, _ = CheckpointManager(final.parent).load(final)
    optimizer = state["pipeline"]["optimizer"]["state"]
    assert isinstance(optimizer, dict) and sorted(optimizer) == sorted(state["pipeline"]["masters"])
