"""Checkpoint files: exact round trips, keep-last-K, atomic writes under SIGKILL, refusing damage."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from roundpipe.errors import CheckpointError, ConfigError
from roundpipe.train.checkpoint import CheckpointManager
from roundpipe.train.tensor_files import flatten_state, unflatten_state

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def nested_state() -> dict:
    """State shaped like the trainer's: masters, optimizer, scheduler, scaler, RNG, data position."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, generator=gen)
    weight[0, :3] = torch.tensor([float("nan"), -0.0, 1e-45])  # NaN, negative zero, a denormal
    py_random = random.Random(7)
    return {
        "model": {
            "layers.0.weight": weight,
            "layers.0.weight_t": weight.t(),  # non-contiguous
            "layers.0.row": weight[1],  # aliases the weight's storage
            "lm_head.bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        },
        "optimizer": {
            "state": {
                3: {"step": torch.tensor(11.0), "exp_avg": torch.randn(6, generator=gen)},
                10: {"step": torch.tensor(11.0), "exp_avg": torch.randn(2, 2, generator=gen)},
            },
            "param_groups": [
                {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [3, 10]},
            ],
        },
        "scheduler": {"last_epoch": 11, "_last_lr": [2.9e-4], "lr_lambdas": [None]},
        "scaler": {"scale": 65536.0, "_growth_tracker": 3, "enabled": True},
        "rng": {
            "torch": torch.get_rng_state(),
            "python": py_random.getstate(),
            "numpy": np.random.RandomState(3).get_state(),
            "cuda": [],
        },
        "data": {"epoch": 1, "position": 1234, "order_seed": -5, "name": "train.jsonl", "résumé": "ü"},
        "odd": {"inf": float("inf"), "minus_inf": float("-inf"), "nan": float("nan"), True: "bool key"},
        "tokens": torch.randint(0, 50_000, (2, 7), generator=gen, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def assert_identical(expected, actual, path="state"):
    """Same types all the way down, equal values, tensors equal bit for bit (NaN payloads too)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        as_bytes = lambda t: t.contiguous().flatten().view(torch.uint8)  # noqa: E731
        assert torch.equal(as_bytes(actual), as_bytes(expected)), f"{path}: bits differ"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_identical(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_identical(e, a, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{path}: expected NaN, got {actual}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------------------------
# flatten / unflatten
# ---------------------------------------------------------------------------------------------


def test_flatten_keys_tensors_by_path_and_the_skeleton_is_strict_json():
    state = nested_state()
    tensors, skeleton = flatten_state(state)
    assert "optimizer/state/3/exp_avg" in tensors
    assert "rng/torch" in tensors and tensors["rng/torch"].dtype == torch.uint8
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    assert len(tensors) == 14  # every tensor and numpy array, aliases stored separately
    text = json.dumps(skeleton, allow_nan=False)
    assert_identical(state, unflatten_state(tensors, json.loads(text)))


def test_aliased_tensors_are_stored_separately_and_untouched_ones_are_not_copied():
    base = torch.arange(12.0)
    own = torch.ones(3)
    tensors, _ = flatten_state({"a": base, "b": base, "view": base[2:5], "own": own})
    assert tensors["a"].data_ptr() == base.data_ptr() and tensors["own"].data_ptr() == own.data_ptr()
    ptrs = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(ptrs) == 4
    assert torch.equal(tensors["view"], torch.tensor([2.0, 3.0, 4.0]))


def test_colliding_paths_get_distinct_names():
    tensors, skeleton = flatten_state({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert sorted(tensors) == ["a/b", "a/b~2"]
    rebuilt = unflatten_state(tensors, skeleton)
    assert rebuilt["a/b"].item() == 0.0 and rebuilt["a"]["b"].item() == 1.0


def test_values_a_checkpoint_cannot_hold_are_refused_with_their_path():
    with pytest.raises(CheckpointError, match="optimizer/fn.*function"):
        flatten_state({"optimizer": {"fn": lambda: 0}})
    with pytest.raises(CheckpointError, match="key.*float"):
        flatten_state({"x": {1.5: 0}})
    with pytest.raises(CheckpointError, match="sparse"):
        flatten_state({"s": torch.eye(2).to_sparse()})
    with pytest.raises(CheckpointError, match="'gone'"):
        unflatten_state({}, {"dict": [["w", {"tensor": "gone"}]]})


# ---------------------------------------------------------------------------------------------
# save / load / list / latest / resolve
# ---------------------------------------------------------------------------------------------


def test_save_then_load_round_trips_bit_exactly_with_extra_files(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    state = nested_state()
    path = manager.save(
        12, state, extra_files={"recipe.yaml": b"run:\n  name: x\n", "blob.bin": bytes(range(256))}
    )
    assert path == tmp_path / "ckpt" / "step-00000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "blob.bin",
        "manifest.json",
        "recipe.yaml",
        "state.json",
        "tensors.safetensors",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["format_version"] == 1
    assert manifest["files"]["blob.bin"]["bytes"] == 256
    assert set(manifest["files"]) == {"tensors.safetensors", "state.json", "recipe.yaml", "blob.bin"}

    step, loaded, extra = manager.load(path)
    assert step == 12
    assert_identical(state, loaded)
    assert extra == {"recipe.yaml": b"run:\n  name: x\n", "blob.bin": bytes(range(256))}


def test_big_tensor_sets_are_split_into_shards(tmp_path):
    manager = CheckpointManager(tmp_path, shard_bytes=1000)
    state = {"a": torch.zeros(100), "b": torch.ones(100), "c": torch.full((600,), 2.0), "d": torch.ones(3)}
    path = manager.save(1, state)
    shards = sorted(p.name for p in path.glob("tensors*.safetensors"))
    assert shards == [f"tensors-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert_identical(state, manager.load(path)[1])


def test_keep_last_deletes_the_oldest_and_latest_is_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None and manager.list() == []
    for step in (5, 10, 15, 20):
        manager.save(step, {"step": step, "w": torch.full((2,), float(step))})
    assert manager.list() == [tmp_path / "step-00000015", tmp_path / "step-00000020"]
    assert manager.latest() == tmp_path / "step-00000020"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015", "step-00000020"]
    assert manager.load(manager.latest())[1]["step"] == 20


def test_the_checkpoint_just_written_survives_even_if_older_than_the_rest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(20, {"x": 1})
    path = manager.save(12, {"x": 2})  # e.g. resumed from an older checkpoint
    assert manager.list() == [path, tmp_path / "step-00000020"]


def test_saving_a_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(7, {"w": torch.zeros(3)}, extra_files={"old.txt": b"old"})
    manager.save(7, {"w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007"]
    step, state, extra = manager.load(tmp_path / "step-00000007")
    assert step == 7 and torch.equal(state["w"], torch.ones(3)) and extra == {}


def test_a_replace_interrupted_between_its_renames_is_undone_on_the_next_start(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(7, {"w": torch.zeros(3)})
    os.rename(tmp_path / "step-00000007", tmp_path / ".replaced-step-00000007-abcd1234")
    assert CheckpointManager(tmp_path).latest() == tmp_path / "step-00000007"
    assert torch.equal(manager.load(tmp_path / "step-00000007")[1]["w"], torch.zeros(3))


def test_resolve_auto_and_paths(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.resolve("auto") is None
    first = manager.save(1, {"x": 1})
    second = manager.save(2, {"x": 2})
    assert manager.resolve("auto") == second
    assert manager.resolve(str(first)) == first
    assert manager.resolve("step-00000001") == first  # a name inside root
    with pytest.raises(CheckpointError, match="holds checkpoints.*step-00000002"):
        manager.resolve(str(tmp_path / "ckpt"))
    (tmp_path / "not-one").mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        manager.resolve(str(tmp_path / "not-one"))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        manager.resolve(str(tmp_path / "missing"))


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    manager = CheckpointManager(tmp_path)
    for name in ("../escape", ".hidden", "manifest.json", "state.json", "tensors-1.safetensors"):
        with pytest.raises(CheckpointError, match="not allowed"):
            manager.save(1, {}, extra_files={name: b""})
    with pytest.raises(CheckpointError, match="step"):
        manager.save(-1, {})
    assert list(tmp_path.iterdir()) == []  # nothing was started


# ---------------------------------------------------------------------------------------------
# Atomicity: SIGKILL in the middle of a write
# ---------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from roundpipe.train import checkpoint

    root, marker = Path(sys.argv[1]), Path(sys.argv[2])
    manager = checkpoint.CheckpointManager(root, shard_bytes=1 << 20)
    manager.save(1, {"w": torch.arange(10.0), "note": "first"})

    write_shard = checkpoint.write_shard
    def write_then_stall(path, tensors):
        write_shard(path, tensors)
        marker.write_text(str(path))
        time.sleep(60)  # the parent kills us here, one shard into the second save
    checkpoint.write_shard = write_then_stall
    manager.save(2, {"big": [torch.ones(1 << 18) for _ in range(12)], "note": "second"})  # 12 shards of 1 MiB
    """
)


def test_a_write_killed_halfway_leaves_the_previous_checkpoint_as_latest(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "in-write"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(marker)], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, f"the child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "the child never reached the second write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-step-00000002-")
    assert any(leftovers[0].glob("tensors-*.safetensors")) and not (leftovers[0] / "manifest.json").exists()

    manager = CheckpointManager(root)
    assert manager.latest() == root / "step-00000001"
    assert manager.list() == [root / "step-00000001"]
    step, state, _ = manager.load(manager.latest())
    assert step == 1 and state["note"] == "first"
    assert_identical(torch.arange(10.0), state["w"])

    manager.save(3, {"w": torch.zeros(1)})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]


# ---------------------------------------------------------------------------------------------
# Damage is refused, naming the file
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": torch.arange(1000.0)})
    newest = manager.save(2, {"w": torch.arange(2000.0), "note": "two"}, extra_files={"notes.txt": b"hello"})
    return manager, newest


def test_a_truncated_tensor_file_is_refused_with_its_sizes(two_checkpoints):
    manager, path = two_checkpoints
    tensors = path / "tensors.safetensors"
    size = tensors.stat().st_size
    os.truncate(tensors, size // 2)
    with pytest.raises(CheckpointError) as info:
        manager.load(path)
    message = str(info.value)
    assert f"{tensors} is {size // 2:,} bytes but the manifest says {size:,}" in message
    assert "damaged" in message and f"--resume {path.parent / 'step-00000001'}" in message


def test_a_byte_changed_in_the_middle_is_caught_by_the_checksum(two_checkpoints):
    manager, path = two_checkpoints
    tensors = path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0x01
    tensors.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"tensors\.safetensors has sha256 .* but the manifest says"):
        manager.load(path)


def test_an_edited_state_json_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    state_file = path / "state.json"
    text = state_file.read_text()
    assert '"two"' in text
    state_file.write_text(text.replace('"two"', '"owt"'))  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"state\.json has sha256"):
        manager.load(path)


def test_an_edited_extra_file_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    (path / "notes.txt").write_bytes(b"hello, world")
    with pytest.raises(CheckpointError, match=r"notes\.txt is 12 bytes but the manifest says 5"):
        manager.load(path)


def test_a_missing_manifest_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json does not exist"):
        manager.load(path)
    assert manager.latest() == path.parent / "step-00000001"  # no longer counts as complete


def test_a_missing_listed_file_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    (path / "notes.txt").unlink()
    with pytest.raises(CheckpointError, match=r"notes\.txt is missing but the manifest lists it"):
        manager.load(path)


def test_a_tensor_file_left_out_of_the_manifest_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["tensors.safetensors"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"tensors\.safetensors is named by state\.json but not in the manifest"
    ):
        manager.load(path)


def test_a_checkpoint_from_a_newer_format_is_refused(two_checkpoints):
    manager, path = two_checkpoints
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format 99 by a newer roundpipe"):
        manager.load(path)


def test_an_undamaged_checkpoint_still_loads_after_its_neighbour_is_damaged(two_checkpoints):
    manager, path = two_checkpoints
    os.truncate(path / "tensors.safetensors", 10)
    step, state, _ = manager.load(path.parent / "step-00000001")
    assert step == 1 and torch.equal(state["w"], torch.arange(1000.0))


# ---------------------------------------------------------------------------------------------
# A manifest cannot make load read outside the checkpoint directory
# ---------------------------------------------------------------------------------------------


def _list_in_manifest(path: Path, name: str, data: bytes) -> None:
    """Edit the manifest to list ``name`` with the size and sha256 of ``data`` (what a forger does)."""
    import hashlib

    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../secret.txt", "../../secret.txt", "sub/../../secret.txt"])
def test_a_manifest_entry_that_climbs_out_with_dotdot_is_refused(two_checkpoints, name):
    manager, path = two_checkpoints
    secret = path.parent / "secret.txt"
    secret.write_bytes(b"not yours")
    _list_in_manifest(path, name, b"not yours")
    with pytest.raises(
        CheckpointError, match=rf"manifest\.json has a malformed entry for '{re.escape(name)}'"
    ):
        manager.load(path)


def test_a_manifest_entry_with_an_absolute_path_is_refused(two_checkpoints, tmp_path):
    manager, path = two_checkpoints
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")
    _list_in_manifest(path, str(secret), b"not yours")
    with pytest.raises(CheckpointError, match=rf"has a malformed entry for '{re.escape(str(secret))}'"):
        manager.load(path)


def test_a_listed_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(two_checkpoints, tmp_path):
    manager, path = two_checkpoints
    outside = tmp_path / "outside.txt"  # beside the checkpoint directories, not in one
    outside.write_bytes(b"hello")  # the very bytes the manifest lists: size and sha256 agree
    (path / "notes.txt").unlink()
    os.symlink(outside, path / "notes.txt")
    with pytest.raises(CheckpointError) as info:
        manager.load(path)
    message = str(info.value)
    assert f"{path / 'notes.txt'} resolves to {outside.resolve()} through the symlink" in message
    assert "load reads only files inside the checkpoint directory" in message and "--resume" in message


def test_a_manifest_that_is_a_symlink_out_of_the_checkpoint_is_refused(two_checkpoints, tmp_path):
    manager, path = two_checkpoints
    forged = tmp_path / "forged-manifest.json"
    forged.write_bytes((path / "manifest.json").read_bytes())
    (path / "manifest.json").unlink()
    os.symlink(forged, path / "manifest.json")
    with pytest.raises(CheckpointError, match=r"manifest\.json resolves to .* through the symlink"):
        manager.load(path)


def test_symlinks_that_stay_inside_the_checkpoint_and_a_symlinked_checkpoint_still_load(
    two_checkpoints, tmp_path
):
    manager, path = two_checkpoints
    (path / "notes.txt").rename(path / "notes-real.txt")
    os.symlink("notes-real.txt", path / "notes.txt")  # relative, inside the directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(path, elsewhere / path.name)  # the checkpoint directory itself: the caller's choice
    step, state, extra = manager.load(elsewhere / path.name)
    assert step == 2 and extra["notes.txt"] == b"hello" and state["note"] == "two"
