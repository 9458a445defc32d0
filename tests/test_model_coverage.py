"""docs/models.md stays true: a representative set of families, re-run as the coverage benchmark
runs them, gets the outcome the recorded walk says (benchmarks/results/model_coverage.json).

The whole walk (every causal-LM family of the installed transformers, ~25 minutes on two cores) is
``python benchmarks/model_coverage.py``; this checks one family of each kind the walk meets: dense
skeletons, scaled embeddings and logits, a wrapped decoder, learned positions and alibi, MoE,
hybrids and state-space models, and a refusal.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

REPO = pathlib.Path(__file__).resolve().parent.parent
RECORDED = REPO / "benchmarks" / "results" / "model_coverage.json"
REPRESENTATIVE = ["llama", "granite", "opt", "gpt2", "falcon", "qwen2_moe", "jamba", "mamba", "zamba"]


def _recorded() -> dict[str, dict]:
    data = json.loads(RECORDED.read_text())
    rows = data["families"] if isinstance(data, dict) else data
    return {row["model_type"]: row for row in rows}


def test_the_recorded_walk_covers_every_causal_lm_family():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(_recorded()) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_a_representative_family_gets_its_recorded_outcome(model_type):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import model_coverage

    recorded = _recorded()[model_type]
    row = model_coverage.one_family(model_type)
    assert row["outcome"] == recorded["outcome"], (row["outcome"], row.get("detail"), recorded.get("detail"))
