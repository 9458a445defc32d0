"""No silent wrong training with peft: every configuration of the peft matrix
(benchmarks/peft_coverage.py, values taken from peft's own test suite) is trained exactly like
plain peft + torch.optim.AdamW, replayed exactly where it draws random numbers, or refused when
``roundpipe.wrap`` is called. An accepted configuration that trains differently (``inexact``) or
crashes after the wrap (``failed``) fails here, named.

The whole matrix (slow) runs every case in this process; the quick tests run one case of each
outcome the matrix expects and check that docs/models.md and the recorded run stay in step.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

torch.set_num_threads(1)

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import model_coverage  # noqa: E402
import peft_coverage  # noqa: E402

RECORDED = REPO / "benchmarks" / "results" / "peft_coverage.json"

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def _verdict(name: str) -> dict:
    row = peft_coverage.one_case(name)
    assert row["outcome"] in peft_coverage.PASSING, f"{name}: {row['outcome']}: {row.get('detail')}"
    return row


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in peft_coverage.CASES])
def test_every_peft_configuration_trains_exactly_or_is_refused_at_wrap_time(name):
    _verdict(name)


def test_plain_lora_trains_exactly_like_plain_peft():
    assert _verdict("lora")["outcome"] == "exact"


def test_lora_dropout_is_replayed_bit_for_bit():
    assert _verdict("lora_dropout")["outcome"] == "replayed"


def test_prompt_tuning_is_refused_at_wrap_time_with_a_reason():
    row = _verdict("prompt_tuning")
    assert row["outcome"] == "refused"
    assert "virtual tokens" in row["detail"]


def test_the_recorded_run_covers_every_case_with_its_source():
    recorded = json.loads(RECORDED.read_text())
    assert [row["case"] for row in recorded["cases"]] == [case.name for case in peft_coverage.CASES]
    assert all(row["source"].startswith("tests/") for row in recorded["cases"])
    assert recorded["versions"]["peft"]


def test_the_docs_section_survives_a_rewrite_of_the_family_table(tmp_path):
    page = tmp_path / "models.md"
    page.write_text("# Model coverage\n\nold table\n")
    row = {**peft_coverage.describe(peft_coverage.CASES[0]), "outcome": "exact", "detail": ""}
    peft_coverage.write_docs(page, [row], "python benchmarks/peft_coverage.py")
    assert "## peft methods" in page.read_text() and "old table" in page.read_text()

    model_coverage.write_docs(
        page, [{"model_type": "llama", "outcome": "exact"}], "python benchmarks/model_coverage.py"
    )
    text = page.read_text()
    assert "old table" not in text  # the family table was rewritten ...
    assert text.count("## peft methods") == 1  # ... and the peft section kept, once
    assert f"| {peft_coverage.CASES[0].name} |" in text

    peft_coverage.write_docs(page, [row], "python benchmarks/peft_coverage.py")
    assert page.read_text().count("## peft methods") == 1
