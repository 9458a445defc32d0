"""A policy's facts live on its registry entry and task kinds on ``TaskKind``, both in ``schedule/``.

Code outside ``roundpipe/schedule/`` asks ``POLICIES[name]`` what a policy does instead of comparing
its name, and names task kinds through ``TaskKind`` instead of their letters: a rule about a policy
or a kind then has one home, and adding a policy touches the registry only. The scan below reads
the source with ``ast``; the other tests check that the closed forms, the run config and the
simulator's defaults read the registry's facts.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import pathlib

import pytest

from roundpipe.config import RunConfig, known_policies
from roundpipe.errors import ConfigError
from roundpipe.schedule import POLICIES, PROVISIONAL_POLICY, TaskKind, formulas
from roundpipe.schedule.deps import BACKWARD_KINDS, TASK_KINDS
from roundpipe.schedule.flow import FUSED

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "roundpipe"
SCHEDULE = PACKAGE / "schedule"
KIND_LETTERS = {*TASK_KINDS, FUSED}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _strings(node: ast.AST):
    """String constants in ``node`` (an operand: a literal, or a tuple / list / set of them, ...)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub


def violations(source: str, where: str = "<source>") -> list[str]:
    """Policy-name comparisons (``==``, ``!=``, ``in``, ``not in``, ``match`` cases, ``POLICIES[...]``
    with a literal) and task-kind letters anywhere outside docstrings."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                for c in _strings(operand):
                    if c.value in POLICIES:
                        found.append(f"{where}:{node.lineno}: compares with policy name {c.value!r}")
        elif isinstance(node, ast.MatchValue):
            for c in _strings(node.value):
                if c.value in POLICIES:
                    found.append(f"{where}:{node.lineno}: matches policy name {c.value!r}")
        elif isinstance(node, ast.Subscript):
            for c in _strings(node.slice):
                if c.value in POLICIES:
                    found.append(f"{where}:{node.lineno}: looks up policy name {c.value!r}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in KIND_LETTERS
            and id(node) not in docs
        ):
            found.append(f"{where}:{node.lineno}: task-kind literal {node.value!r} (use TaskKind / FUSED)")
    return found


def _outside_schedule() -> list[pathlib.Path]:
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if SCHEDULE not in p.parents]
    assert len(files) > 50, "the scan found too few files: is PACKAGE right?"
    return files


def test_no_policy_name_comparison_or_task_kind_letter_outside_schedule():
    found = []
    for path in _outside_schedule():
        found += violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "policy facts and task kinds belong to roundpipe/schedule/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'if policy == "roundpipe": pass',
        'x = policy != "1f1b"',
        'x = policy in ("gpipe", "zb")',
        'x = spec is POLICIES["hanayo"]',
        'match policy:\n    case "chimera": pass',
        'x = t.kind == "B"',
        'x = {"F": 1}',
        'x = ("I", "W")',
        'kind = "FB"',
    ],
)
def test_the_scan_catches_each_form(source):
    assert violations(source)


@pytest.mark.parametrize(
    "source",
    [
        'def f():\n    """F or B."""',
        "x = t.kind == TaskKind.B",
        'x = policy == "auto"',
        "x = POLICIES[policy].rotates",
        "raise ConfigError(\"use the 'roundpipe' policy\")",
    ],
)
def test_the_scan_lets_registry_questions_and_prose_through(source):
    assert not violations(source)


# ------------------------------------------------------------------------------- TaskKind


def test_task_kinds_are_their_letters_in_tables_text_and_json():
    assert [k.value for k in TaskKind] == list(TASK_KINDS) == ["F", "B", "I", "W"]
    for kind in TaskKind:
        assert kind == kind.value and hash(kind) == hash(kind.value)
        assert str(kind) == f"{kind}" == f"{kind:<1}" == kind.value
        assert json.dumps({"kind": kind, kind: 1}) == json.dumps({"kind": kind.value, kind.value: 1})
        assert {kind.value: 1}[kind] == 1
    assert {"B", "I", "W"} == BACKWARD_KINDS


# ------------------------------------------------------------------------------- registry


def test_exactly_one_policy_is_provisional_and_it_can_run_anything_auto_starts_with():
    provisional = [name for name, spec in POLICIES.items() if spec.provisional]
    assert provisional == [PROVISIONAL_POLICY]
    spec = POLICIES[PROVISIONAL_POLICY]
    assert spec.executable and spec.stages_per_device is None  # any stage count, on any devices


def test_the_simulators_default_policy_is_the_registrys():
    from roundpipe.sim.scenario import Scenario
    from roundpipe.sim.seq_limit import max_seq_len

    fields = {f.name: f.default for f in dataclasses.fields(Scenario)}
    assert fields["policy"] == PROVISIONAL_POLICY
    assert inspect.signature(max_seq_len).parameters["policy"].default == PROVISIONAL_POLICY


def test_run_config_runs_exactly_the_executable_policies():
    executable = sorted(name for name, spec in POLICIES.items() if spec.executable)
    assert known_policies() == executable
    assert set(POLICIES) - set(executable), "the check below needs a policy that cannot run"
    for name, spec in POLICIES.items():
        if spec.executable:
            assert RunConfig(policy=name).policy == name
        else:
            with pytest.raises(ConfigError, match="cannot run yet") as err:
                RunConfig(policy=name)
            assert spec.cannot_run in str(err.value)


def test_a_grain_option_is_an_option_of_its_policy_and_sets_the_stage_count():
    from roundpipe.schedule import policy_options
    from roundpipe.sim.choice import stage_count

    with_option = [name for name, spec in POLICIES.items() if spec.grain_option]
    assert with_option, "no policy declares a grain option"
    for name in with_option:
        spec = POLICIES[name]
        assert spec.grain_option in policy_options(name)
        assert stage_count(name, 2, {spec.grain_option: 3}, 100) == 2 * spec.stages_per_device * 3
        assert stage_count(name, 2, {}, 100) == spec.default_stages(2)


def test_the_closed_forms_are_the_registrys():
    assert tuple(n for n, s in POLICIES.items() if s.closed_form is not None) == formulas.POLICIES
    assert set(formulas.POLICIES) == set(POLICIES), "every registered policy has a closed form"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_closed_form_stage_counts_and_figures_come_from_the_registry_entry(policy):
    spec = POLICIES[policy]
    for devices in (1, 2, 3, 4):
        default = spec.default_stages(devices)
        assert formulas.default_stages(policy, devices) == (devices if default is None else default)
        if devices % 2 == 0:  # inside every closed form's domain (chimera: even devices)
            cf = formulas.closed_form(policy, devices, 4 * devices)
            assert cf.stages == formulas.default_stages(policy, devices)
        for stages in range(1, 4 * devices + 1):
            m = 4 * devices
            if not spec.accepts_stages(stages, devices):
                with pytest.raises(ConfigError, match="stages"):
                    formulas.closed_form(policy, devices, m, stages)
                continue
            try:
                want = spec.closed_form(devices, stages, m, 1.0, 2.0)
            except ConfigError:
                with pytest.raises(ConfigError):
                    formulas.closed_form(policy, devices, m, stages)
                continue
            got = formulas.closed_form(policy, devices, m, stages)
            assert (got.makespan, got.peak_activations) == (float(want[0]), want[1])


# ------------------------------------------------------------------ RoundPipe's step-time models


def test_the_three_roundpipe_step_models_agree_where_their_domains_meet():
    """``roundpipe_makespan`` is exact for the table on uniform stages; ``roundpipe_bubble`` (picks a
    microbatch count from per-stage times) and the grain ``objective`` (ranks stage grains by the
    slowest deal) are estimates. They agree with it where their assumptions hold: uniform stages,
    ``D | S`` and ``M >= D`` for the bubble; every deal as slow as the slowest, ``N | deals`` and
    ``M >= N`` for the objective (which is ``N`` times the step). Outside, they differ on purpose."""
    from roundpipe.partition.grain import objective
    from roundpipe.partition.partitioner import roundpipe_bubble
    from roundpipe.schedule.formulas import roundpipe_makespan
    from roundpipe.schedule.policies.closed_forms import deal_makespan

    checked = 0
    for devices in range(1, 7):
        for per_device in (1, 2, 3):
            stages = per_device * devices
            for m in range(devices, 3 * devices + 1):
                for f, b in ((1.0, 2.0), (0.5, 1.7), (2.0, 1.0)):
                    step = roundpipe_makespan(devices, stages, m, f, b)
                    work = m * stages * (f + b) / devices
                    bubble = roundpipe_bubble([f] * stages, [b] * stages, devices, m)
                    assert bubble == pytest.approx(1 - work / step, abs=1e-12)
                    checked += 1
            for deals in (devices * per_device, 2 * devices * per_device):
                for m in range(devices, 3 * devices + 1):
                    want = deal_makespan([0.5] * deals, devices, m)
                    assert objective(m, devices, deals, 0.5) / devices == pytest.approx(want)
                    checked += 1
    assert checked > 500
