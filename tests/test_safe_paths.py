"""Safe loading and safe paths (issue 13, item 5).

Loading: tensors only through safetensors, torch files only with ``weights_only=True``, YAML only
through the safe loader, no pickle, and ``trust_remote_code`` only from the recipe's
``model.trust_remote_code`` -- enforced by a scan of the package's source (which is itself shown to
catch planted bad code). Writing: a recipe cannot make a run write outside its run directory
(``roundpipe.train.paths``): ``run.name`` must be a plain name, the files ``data.synthetic``
writes must lie inside, and a symlink planted in the run directory that leads outside is refused,
at recipe load and when the run starts.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from roundpipe.errors import RecipeError
from roundpipe.train.config import ModelConfig
from roundpipe.train.export import export_merged
from roundpipe.train.paths import RUN_DIR_ENTRIES, inside_run_dir
from roundpipe.train.recipe import config_from_dict, load_recipe
from roundpipe.train.trainer import Trainer

torch.set_num_threads(1)

PACKAGE = Path(__file__).resolve().parent.parent / "roundpipe"

# ---------------------------------------------------------------------------------------------------
# The source scan


_YAML_UNSAFE = {
    f"yaml.{name}"
    for name in (
        "load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all",
        "Loader", "UnsafeLoader", "FullLoader", "CLoader", "CUnsafeLoader", "CFullLoader",
    )
}  # fmt: skip
_PICKLE_MODULES = ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal")
_TORCH_LOADS = {"torch.load", "torch.serialization.load"}


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``torch.load`` for the expression ``torch.load`` (or ``T.load`` after ``import torch as T``)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_recipe_flag(node: ast.AST, assigned: dict[str, list[ast.AST]], depth: int = 0) -> bool:
    """Whether a ``trust_remote_code=`` value comes from the recipe: ``X.trust_remote_code``,
    ``bool(...)`` of such a value, or a name only ever assigned such values in its function."""
    if isinstance(node, ast.Attribute):
        return node.attr == "trust_remote_code"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "bool":
        return len(node.args) == 1 and _is_recipe_flag(node.args[0], assigned, depth)
    if isinstance(node, ast.Name) and depth < 5:
        values = assigned.get(node.id, [])
        return bool(values) and all(_is_recipe_flag(v, assigned, depth + 1) for v in values)
    return False


def _assignments(scope: ast.AST) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and isinstance(
            node.target, ast.Name
        ):
            out.setdefault(node.target.id, []).append(node.value if node.value is not None else node)
    return out


def _with_scope(node: ast.AST, names: dict[str, list[ast.AST]]):
    """Every node below ``node`` with the assignments of its innermost function (or the module)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names = _assignments(node)
    yield node, names
    for child in ast.iter_child_nodes(node):
        yield from _with_scope(child, names)


def unsafe_loading(path: Path) -> list[str]:
    """``FILE:LINE: what`` for every unsafe way of loading in one Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases: dict[str, str] = {}
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                full = f"{node.module}.{a.name}"
                if (
                    full in _YAML_UNSAFE
                    or full in _TORCH_LOADS
                    or node.module.split(".")[0] in _PICKLE_MODULES
                ):
                    flag(node, f"from {node.module} import {a.name}")
    for node, names in _with_scope(tree, _assignments(tree)):
        name = _dotted(node, aliases) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if name in _YAML_UNSAFE:
            flag(node, f"{name}: read YAML with yaml.safe_load or yaml.SafeLoader")
        elif name and name.split(".")[0] in _PICKLE_MODULES and name.rsplit(".", 1)[-1] in (
            "load", "loads", "Unpickler",
        ):  # fmt: skip
            flag(node, f"{name}: pickle runs code; store tensors as safetensors and the rest as JSON")
        if isinstance(node, ast.Dict):  # **{"trust_remote_code": ...}
            for key, value in zip(node.keys, node.values):
                recipe_key = isinstance(key, ast.Constant) and key.value == "trust_remote_code"
                if recipe_key and not _is_recipe_flag(value, names):
                    flag(node, "trust_remote_code not taken from the recipe's model.trust_remote_code")
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func, aliases)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if func in _TORCH_LOADS:
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                flag(node, f"{func} without weights_only=True")
        if func == "numpy.load":
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                flag(node, "numpy.load with allow_pickle")
        if "trust_remote_code" in keywords and not _is_recipe_flag(keywords["trust_remote_code"], names):
            flag(node, "trust_remote_code not taken from the recipe's model.trust_remote_code")
    return found


def test_the_package_loads_only_safely():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the scan sees the package
    problems = [p for f in files for p in unsafe_loading(f)]
    assert problems == []


BAD_SNIPPETS = {
    "torch.load(path)": "torch.load without weights_only=True",
    "torch.load(path, weights_only=False)": "torch.load without weights_only=True",
    "import torch as T\nT.load(path)": "torch.load without weights_only=True",
    "from torch import load\nload(path)": "from torch import load",
    "yaml.load(text)": "yaml.load: read YAML",
    "yaml.load(text, Loader=yaml.Loader)": "yaml.Loader: read YAML",
    "yaml.unsafe_load(text)": "yaml.unsafe_load: read YAML",
    "yaml.full_load(text)": "yaml.full_load: read YAML",
    "from yaml import Loader": "from yaml import Loader",
    "pickle.load(f)": "pickle.load: pickle runs code",
    "import pickle as p\np.loads(b)": "pickle.loads: pickle runs code",
    "numpy.load(f, allow_pickle=True)": "numpy.load with allow_pickle",
    "AutoModel.from_pretrained(d, trust_remote_code=True)": "trust_remote_code not taken from the recipe",
    "def f(d, flag):\n    AutoConfig.from_pretrained(d, trust_remote_code=flag)": "trust_remote_code not taken",
    "def f(cfg):\n    r = cfg.trust_remote_code or True\n    g(trust_remote_code=r)": "trust_remote_code not taken",
    "AutoModel.from_pretrained(d, **{'trust_remote_code': True})": "trust_remote_code not taken",
}


@pytest.mark.parametrize("snippet", list(BAD_SNIPPETS))
def test_the_scan_catches_a_planted_unsafe_load(tmp_path, snippet):
    path = tmp_path / "planted.py"
    path.write_text("import torch, yaml, pickle, numpy\n" + snippet + "\n")
    problems = unsafe_loading(path)
    assert any(BAD_SNIPPETS[snippet] in p for p in problems), problems
    assert all(p.startswith(f"{path}:") for p in problems)


def test_the_scan_passes_the_safe_forms(tmp_path):
    path = tmp_path / "fine.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch, yaml, numpy
            torch.load(path, weights_only=True, map_location="cpu")
            yaml.safe_load(text)
            yaml.SafeLoader(text)
            numpy.load(f)

            def build(model_cfg):
                remote = bool(model_cfg.trust_remote_code)
                AutoConfig.from_pretrained(d, trust_remote_code=remote)
                AutoTokenizer.from_pretrained(d, trust_remote_code=model_cfg.trust_remote_code)
            """
        )
    )
    assert unsafe_loading(path) == []


def test_remote_code_is_off_unless_the_recipe_turns_it_on():
    assert ModelConfig().trust_remote_code is False
    cfg = config_from_dict({"model": {"config": {"model_type": "llama"}}, "data": {"train": "t.jsonl"}})
    assert cfg.model.trust_remote_code is False


# ---------------------------------------------------------------------------------------------------
# run.name


def _base(tmp: Path, **groups) -> dict:
    recipe = {"model": {"config": {"model_type": "llama"}}, "data": {"train": str(tmp / "train.jsonl")}}
    for group, values in groups.items():
        recipe[group] = {**recipe.get(group, {}), **values}
    return recipe


@pytest.mark.parametrize(
    "name", ["../escape", "a/b", "/etc", "", " ", ".", "..", "a\\b", "C:x", "x..y", "a\0b"]
)
def test_a_run_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    with pytest.raises(RecipeError) as info:
        config_from_dict(_base(tmp_path, run={"name": name}))
    message = str(info.value)
    assert f"run.name {name!r} is not a plain name" in message
    assert "write e.g. run.name: " in message and "run.output_dir" in message


def test_a_run_name_is_only_a_title_when_output_dir_is_set(tmp_path):
    cfg = config_from_dict(_base(tmp_path, run={"name": "team/exp 1", "output_dir": str(tmp_path / "run")}))
    assert cfg.output_dir == str(tmp_path / "run")


def test_a_bad_run_name_from_a_file_or_an_override_names_its_source(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  config: {{model_type: llama}}\ndata:\n  train: {tmp_path}/t.jsonl\n")
    with pytest.raises(RecipeError, match=r"recipe\.yaml: run\.name '\.\./\.\./etc' is not a plain name"):
        load_recipe(recipe, ["run.name=../../etc"])
    assert load_recipe(recipe, ["run.name=exp-1"]).output_dir == "runs/exp-1"


# ---------------------------------------------------------------------------------------------------
# Files data.synthetic writes


def _synthetic(tmp: Path, train: str, eval: str | None = None) -> dict:
    run = tmp / "run"
    data = {"train": train, "eval": eval or str(run / "data" / "eval.jsonl"), "synthetic": "reverse"}
    return _base(tmp, data=data, run={"output_dir": str(run)})


@pytest.mark.parametrize(
    "where",
    ["elsewhere/train.jsonl", "run/../train.jsonl", "run/data/../../train.jsonl"],
)
def test_synthetic_data_outside_the_run_directory_is_refused(tmp_path, where):
    value = str(tmp_path / where)
    with pytest.raises(RecipeError) as info:
        config_from_dict(_synthetic(tmp_path, value))
    message = str(info.value)
    assert (
        f"data.train {value!r} resolves to {tmp_path / 'train.jsonl' if '..' in where else value}" in message
    )
    assert f"it must lie inside the run directory {tmp_path / 'run'}" in message
    assert f"write e.g. data.train: {tmp_path / 'run' / 'data' / 'train.jsonl'}" in message


def test_synthetic_held_out_data_outside_is_refused_too(tmp_path):
    value = str(tmp_path / "eval.jsonl")
    with pytest.raises(
        RecipeError, match=rf"data\.eval '{re.escape(value)}' resolves to .*write e\.g\. data\.eval: "
    ):
        config_from_dict(_synthetic(tmp_path, str(tmp_path / "run" / "data" / "train.jsonl"), value))


@pytest.mark.parametrize("name", ["config.yaml", "checkpoints/train.jsonl", "export/merged/x.jsonl"])
def test_synthetic_data_on_a_name_the_run_writes_is_refused(tmp_path, name):
    value = str(tmp_path / "run" / name)
    with pytest.raises(RecipeError) as info:
        config_from_dict(_synthetic(tmp_path, value))
    taken = name.removesuffix("/x.jsonl").removesuffix("/train.jsonl")
    assert f"data.train {value!r} is on {taken}, which the run writes itself" in str(info.value)


def test_data_a_run_only_reads_may_lie_anywhere(tmp_path):
    recipe = _base(
        tmp_path, data={"train": "/anywhere/train.jsonl"}, run={"output_dir": str(tmp_path / "run")}
    )
    assert config_from_dict(recipe).data.train == "/anywhere/train.jsonl"


# ---------------------------------------------------------------------------------------------------
# Symlinks planted in the run directory


def _planted(tmp: Path, name: str, target: Path) -> tuple[dict, Path]:
    run = tmp / "run"
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, run / name)
    return _base(tmp, run={"output_dir": str(run)}), run


@pytest.mark.parametrize("name", ["checkpoints", "metrics.jsonl", "export", "export/merged", "train.log"])
def test_a_symlink_in_the_run_directory_that_leads_outside_is_refused(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    recipe, run = _planted(tmp_path, name, outside / "target")  # dangling: it would be created
    with pytest.raises(RecipeError) as info:
        config_from_dict(recipe)
    message = str(info.value)
    assert f"run.output_dir {str(run)!r}: {run / name} resolves to {outside / 'target'}" in message
    assert f"through the symlink {run / name} -> {outside / 'target'}" in message
    assert "remove the symlink" in message
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("name", ["tensorboard/events.out", "export/merged/config.json", "export/adapter/x"])
def test_a_symlink_out_in_a_directory_another_library_fills_is_refused(tmp_path, name):
    recipe, run = _planted(tmp_path, name, tmp_path / "outside.json")
    with pytest.raises(RecipeError, match=f"through the symlink {re.escape(str(run / name))} -> "):
        config_from_dict(recipe)


def test_a_symlink_that_stays_inside_the_run_directory_is_followed(tmp_path):
    (tmp_path / "run" / "checkpoints-on-big-disk").mkdir(parents=True)
    recipe, run = _planted(tmp_path, "checkpoints", tmp_path / "run" / "checkpoints-on-big-disk")
    assert config_from_dict(recipe).output_dir == str(run)


def test_a_run_directory_that_is_itself_a_symlink_is_the_users_choice(tmp_path):
    (tmp_path / "scratch").mkdir()
    os.symlink(tmp_path / "scratch", tmp_path / "run")
    assert config_from_dict(_base(tmp_path, run={"output_dir": str(tmp_path / "run")}))


def test_a_symlinked_data_directory_cannot_carry_synthetic_data_out(tmp_path):
    (tmp_path / "outside").mkdir()
    _, run = _planted(tmp_path, "data", tmp_path / "outside")
    with pytest.raises(
        RecipeError, match=rf"data\.train .* through the symlink {re.escape(str(run / 'data'))} -> "
    ):
        config_from_dict(_synthetic(tmp_path, str(run / "data" / "train.jsonl")))


def test_a_symlink_loop_is_refused_not_followed_forever(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(run / "loop", run / "loop")
    with pytest.raises(RecipeError, match=r"run\.output_dir .*loop cannot be resolved"):
        inside_run_dir(run, run / "loop", "run.output_dir", value=run)


def test_a_symlink_planted_after_the_recipe_loaded_stops_the_run_before_it_writes(tmp_path):
    cfg = config_from_dict(_base(tmp_path, run={"output_dir": str(tmp_path / "run")}))
    trainer = Trainer(cfg, log=lambda *_: None)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / "checkpoints")
    with pytest.raises(RecipeError, match=r"checkpoints resolves to .*through the symlink"):
        trainer.fit()
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the first write


def test_an_export_refuses_a_directory_with_a_symlink_out(tmp_path):
    directory = tmp_path / "merged"
    directory.mkdir()
    os.symlink(tmp_path / "outside.json", directory / "config.json")
    with pytest.raises(RecipeError) as info:
        export_merged(nn.Linear(2, 2), directory)
    message = str(info.value)
    assert f"checkpoint.export {str(directory)!r}: {directory / 'config.json'} resolves to" in message
    assert f"it must lie inside the directory {directory}" in message
    assert not (tmp_path / "outside.json").exists()


# ---------------------------------------------------------------------------------------------------
# A normal recipe still runs and writes where expected


def test_a_normal_run_writes_only_its_own_names_inside_runs_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/NAME is relative to the working directory
    recipe = {
        "model": {
            "config": {
                "model_type": "qwen3", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 32,
            },
            "tokenizer": "byte",
        },
        "data": {
            "train": "runs/safe/data/train.jsonl", "eval": "runs/safe/data/eval.jsonl", "synthetic": "reverse",
            "synthetic_samples": [32, 4], "prompt_template_no_input": "{instruction}>", "max_length": 24,
        },
        "run": {"name": "safe", "devices": "cpu:2", "batch_size": 4, "num_microbatches": 2, "max_steps": 2},
        "checkpoint": {"every": 1, "keep_last": 1, "export": "merged"},
        "logging": {"progress": False, "plots": True, "tensorboard": False},
    }  # fmt: skip
    result = Trainer(config_from_dict(recipe), log=lambda *_: None).fit()
    run = tmp_path / "runs" / "safe"
    assert result.steps == 2 and result.run_dir.resolve() == run.resolve()
    assert {p.name for p in run.iterdir()} <= {n for n in RUN_DIR_ENTRIES if "/" not in n} | {"data"}
    assert {p.name for p in (run / "export").iterdir()} == {"merged"}
    for name in (
        "config.yaml",
        "train.log",
        "metrics.jsonl",
        "loss.png",
        "timeline.png",
        "timeline.trace.json",
    ):
        assert (run / name).is_file(), name
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]
    assert (run / "export" / "merged" / "config.json").is_file()
    assert (run / "data" / "train.jsonl").is_file() and (run / "data" / "eval.jsonl").is_file()
    written = [p for p in tmp_path.rglob("*") if not p.is_dir()]
    assert written and all(run in p.parents for p in written)  # nothing outside runs/safe
