"""Families built as transformers' own model tests build them, dropout included, train exactly or are
refused at wrap time: never accepted and trained differently (benchmarks/family_tester_coverage.py).

Each family's config comes from its ``*ModelTester`` (benchmarks/data/family_testers.json). With
dropout 0, roundpipe must meet the exactness rule against plain PyTorch; with the tester's dropout
on, two seeded runs must be bit-identical and equal a run on one device, and the dropout must change
roundpipe's losses exactly where it changes plain PyTorch's. The whole matrix is marked ``slow``;
two families with dropout in the embeddings, the residuals and the attention run in the quick suite.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from support.reference import RunResult

torch.set_num_threads(1)

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import family_tester_coverage as matrix  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

FAMILIES = [entry["model_type"] for entry in matrix.testers()["families"]]
# Dropout on the embeddings (issue 23's GPT-2 finding) as well as in the blocks: GPT-2's embd_pdrop,
# resid_pdrop and attn_pdrop, XGLM's dropout, attention_dropout and activation_dropout, all 0.1.
QUICK = ["gpt2", "xglm"]


def _assert_trains_exactly_or_is_refused(model_type: str) -> None:
    row = matrix.one_family(model_type)
    assert row["outcome"] not in matrix.BAD, f"{model_type}: {row['outcome']}: {row['detail']}"
    assert row["outcome"] in ("exact", "refused"), f"{model_type}: {row['outcome']}: {row['detail']}"


@pytest.mark.parametrize("model_type", QUICK)
def test_a_tester_config_with_dropout_trains_exactly_or_is_refused(model_type):
    _assert_trains_exactly_or_is_refused(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f not in QUICK])
def test_every_tester_config_trains_exactly_or_is_refused(model_type):
    _assert_trains_exactly_or_is_refused(model_type)


def test_the_causal_lm_tester_rule_passes_what_the_config_class_reads():
    """CausalLMModelTester.get_config: attributes named by the config's arguments or their
    attribute_map aliases (GPT-2's n_embd is hidden_size), plus pad_token_id; nothing else."""
    import transformers

    data = matrix.testers()
    entry = next(e for e in data["families"] if e["model_type"] == "gpt2")
    kwargs = matrix.tester_kwargs(entry, data["causal_lm_tester"]["values"], transformers.GPT2Config)
    assert (kwargs["n_embd"], kwargs["n_layer"], kwargs["n_head"], kwargs["vocab_size"]) == (32, 2, 2, 99)
    assert "hidden_dropout_prob" not in kwargs and "num_experts" not in kwargs
    assert kwargs["pad_token_id"] == 0


def _run(losses, weight) -> RunResult:
    return RunResult(list(losses), {"w": torch.tensor([weight])})


def test_the_replay_check_names_seeded_runs_that_differ(monkeypatch):
    runs = iter([_run([1.0, 0.9, 0.8], 1.0), _run([1.0, 0.95, 0.8], 1.0), _run([1.0, 0.9, 0.8], 1.0)])
    monkeypatch.setattr(matrix, "train", lambda model, batch, **config: next(runs))
    result = matrix.check_replay(None, {})
    assert result["kind"] == "nondeterministic"
    assert "loss of step 2" in result["detail"]


def test_the_replay_check_fails_a_run_that_dropped_the_dropout(monkeypatch):
    """Identical seeded runs that equal the run without dropout, where plain PyTorch's dropout
    changes the losses: the pipeline ran the layers without their dropout."""
    same = _run([1.0, 0.9, 0.8], 1.0)
    monkeypatch.setattr(matrix, "train", lambda model, batch, **config: same)
    import support.reference as reference

    monkeypatch.setattr(reference, "reference_train", lambda model, batch, steps: _run([1.1, 0.9, 0.8], 1.0))
    result = matrix.check_replay(None, {}, without=same, plain_without=_run([1.0, 0.9, 0.8], 1.0))
    assert result["kind"] == "inexact"
    assert "does not change roundpipe's losses" in result["detail"]


def test_the_recorded_matrix_covers_every_tester_family_and_the_docs_show_it():
    recorded = json.loads((matrix.RESULTS / "family_testers.json").read_text())
    assert [row["model_type"] for row in recorded["families"]] == FAMILIES
    docs = matrix.DOCS.read_text()
    assert matrix.SECTION in docs
    shown = docs.split(matrix.SECTION, 1)[1]
    for row in recorded["families"]:
        assert f"| {row['model_type']} | " in shown, row["model_type"]


def test_the_docs_section_is_replaced_in_place_and_the_coverage_walk_keeps_it(tmp_path):
    import model_coverage

    page = tmp_path / "models.md"
    page.write_text("# Model coverage\n\ntable\n")
    rows = [
        {"model_type": "gpt2", "tester": "t", "layers": 2, "dropout": {"embd_pdrop": 0.1}, "outcome": "exact"}
    ]
    matrix.write_docs(page, rows, "cmd one")
    matrix.write_docs(page, rows, "cmd two")
    text = page.read_text()
    assert text.count(matrix.SECTION) == 1 and "cmd two" in text and "cmd one" not in text
    assert "| gpt2 | t | 2 | embd_pdrop=0.1 | exact |" in text
    model_coverage.write_docs(page, [], "walk")
    assert text.split(matrix.SECTION, 1)[1] == page.read_text().split(matrix.SECTION, 1)[1]
