"""benchmarks/gpu_throughput.py's dry run at its tiniest: every system in both modes (roundpipe on
cpu:1 and cpu:2, plain HF, FSDP2 with CPU offload on gloo) runs, reports its figures under the
JSON keys scripts/gpu_check.sh reads, and computes the same first-step loss; the dry run writes its
own results files, never the GPU's. The 1.5B model's parameter formula is checked on the meta device. No
timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_throughput as bench  # noqa: E402

from roundpipe.errors import ConfigError  # noqa: E402

# A benchmark's smoke: `make test-slow` runs it (and `make bench-quick` runs the benchmark itself).
pytestmark = pytest.mark.slow

FIGURES = {"status", "devices", "precision", "tokens_per_s", "step_s_median", "step_s", "first_loss"}
FIGURES |= {"losses", "ratio_to", "peak_gpu_allocated_bytes", "peak_gpu_reserved_bytes"}
ROUNDPIPE_FIGURES = {"h2d_bytes_per_step", "h2d_gb_per_s", "h2d_fraction_of_pinned_peak", "policy"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the dry run sets for itself (and restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("gpu_throughput")
    results = out / "results"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROUNDPIPE_BENCH_RESULTS", str(results))  # where its files should land
        code = bench.main(["--dry-run", "--tiny", "--json", str(out / "t.json")])
    return code, json.loads((out / "t.json").read_text()), results


def test_every_system_reports_its_figures_and_the_losses_agree(dry_run):
    code, payload, _ = dry_run
    assert code == 0
    assert payload["complete"] and payload["dry_run"]
    assert payload["model"]["parameters"] == payload["model"]["parameters_formula"]
    assert payload["pinned_copy"]["best_gb_per_s"] > 0
    assert sorted(payload["modes"]) == sorted(bench.MODES)
    for mode, block in payload["modes"].items():
        systems = block["systems"]
        assert sorted(systems) == sorted(bench.SYSTEMS), mode
        for key, result in systems.items():
            assert result["status"] == "PASS", (mode, key, result.get("reason"))
            assert set(result) >= FIGURES, (mode, key, FIGURES - set(result))
            assert sorted(result["ratio_to"]) == sorted(bench.ROUNDPIPE_SPECS)
        for key, (_, cpu_spec) in bench.ROUNDPIPE_SPECS.items():
            assert systems[key]["devices"] == cpu_spec
            assert set(systems[key]) >= ROUNDPIPE_FIGURES
            assert systems[key]["h2d_bytes_per_step"] > 0
        check = block["loss_check"]
        assert check["ok"] and check["compared"] == len(bench.SYSTEMS), check
        assert check["reference"] == "roundpipe_x1"
        trainable = {r["trainable_parameters"] for r in systems.values()}
        assert len(trainable) == 1  # the same adapters (LoRA) or the whole model (full) everywhere
    lora, full = (payload["modes"][m]["systems"]["hf"]["trainable_parameters"] for m in ("lora", "full"))
    assert lora < full == payload["model"]["parameters"]


def test_a_dry_run_writes_its_own_results_files_not_the_gpus(dry_run):
    _, payload, results = dry_run
    assert sorted(p.name for p in results.glob("gpu_throughput*")) == [
        "gpu_throughput_dry_run.json",
        "gpu_throughput_dry_run.md",
    ]
    written = json.loads((results / "gpu_throughput_dry_run.json").read_text())
    assert written["modes"].keys() == payload["modes"].keys()
    assert "| lora | roundpipe_x2 | cpu:2 | PASS |" in (results / "gpu_throughput_dry_run.md").read_text()


def test_the_loss_check_rejects_a_first_loss_just_outside_its_tolerance():
    systems = {
        "roundpipe_x1": {"status": "PASS", "first_loss": 10.0},
        "hf": {"status": "PASS", "first_loss": 10.0 * (1 + 0.99 * bench.LOSS_RTOL)},
        "fsdp2": {"status": "SKIP", "reason": "no FSDP2"},
    }
    assert bench.check_losses(systems)["ok"]
    systems["hf"]["first_loss"] = 10.0 * (1 + 1.01 * bench.LOSS_RTOL)
    check = bench.check_losses(systems)
    assert not check["ok"] and len(check["mismatches"]) == 1 and check["mismatches"][0].startswith("hf:")


def test_the_gpu_model_is_about_one_and_a_half_billion_parameters():
    family, _ = bench.config_class()
    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(bench.model_config(bench.GPU_SETUP))
    built = sum(p.numel() for p in model.parameters())
    assert built == bench.parameter_count(bench.GPU_SETUP, family)
    assert 1.4e9 < built < 1.7e9


def test_setup_numbers_the_run_cannot_use_are_refused_with_what_to_change():
    with pytest.raises(ConfigError, match="batch 6 is not a multiple of rows 4"):
        bench.replace(bench.DRY_RUN_SETUP, batch=6, rows=4).check()
    with pytest.raises(ConfigError, match="warmup must be at least 1"):
        bench.replace(bench.DRY_RUN_SETUP, warmup=0).check()


TINY = bench.replace(bench.DRY_RUN_SETUP, layers=1, timed=1)


def test_a_missing_feature_is_a_skip_that_says_why_and_the_others_still_run(monkeypatch):
    def no_fsdp2():
        raise bench.Skip("torch 2.4.0 has no FSDP2 with CPUOffloadPolicy (test)")

    monkeypatch.setattr(bench, "fsdp2_api", no_fsdp2)
    monkeypatch.setattr(bench, "older_than_roundpipe_supports", lambda: ["transformers 4.46.0 < 5.0"])
    payload = bench.run(TINY, False, bench.Budget(None), modes=("full",), log=lambda *_: None)
    systems = payload["modes"]["full"]["systems"]
    assert systems["fsdp2"]["status"] == "SKIP" and "no FSDP2" in systems["fsdp2"]["reason"]
    for key in bench.ROUNDPIPE_SPECS:
        assert systems[key]["status"] == "SKIP" and "transformers 4.46.0 < 5.0" in systems[key]["reason"]
    assert systems["hf"]["status"] == "PASS" and systems["hf"]["ratio_to"] == {}
    assert bench.failures(payload) == []


def test_a_spent_budget_skips_the_systems_instead_of_overrunning():
    payload = bench.run(TINY, False, bench.Budget(0.0), modes=("lora",), systems=("hf",), log=lambda *_: None)
    result = payload["modes"]["lora"]["systems"]["hf"]
    assert result["status"] == "SKIP" and "budget left" in result["reason"]
    assert payload["complete"]
    assert bench.failures(payload) == ["lora: no system was measured (see each one's reason)"]
