"""OctoPipe's claim in roundpipe's simulator: searching partition, placement and schedule together
beats optimising one of them alone, on models whose layers are not alike.

Three heterogeneous models on 8x RTX 4090 (sequence 4096, 64 sequences per step, bf16, sync):

- ``gpt-oss-20b`` (preset, full fine-tuning): sliding-window (128) and full attention alternate
  layer by layer, every layer a 32-expert MoE, a 201k-token head;
- ``moe-dense-first`` (LoRA r=16): the ``qwen3-30b-a3b`` preset with its first three layers made
  dense (``mlp_only_layers = [0, 1, 2]``, ``intermediate_size`` 6144), the DeepSeek-style
  ``first_k_dense`` layout; defined here, since no preset has it (LoRA: under full fine-tuning no
  weight-bound policy fits the 30B model at all);
- ``qwen3-0.6b`` (preset, full fine-tuning): a 151,936-token head on a 1024-wide model, several
  decoder layers heavy.

Compared, each the best it finds by tokens/s among plans that fit:

- **joint**: ``sim.tune.tune`` (policy x microbatches x stage grain x partition x head shards,
  then boundary refinement), with a time budget;
- **(a) partition only**: policy fixed to 1F1B, the partition balanced on forward + backward time
  (the scenario's partitioner, head shards chosen with it), at its best microbatch count;
- **(b) schedule only**: every policy, microbatch count and stage count the tuner would try, on an
  *even* partition: decoder layers split evenly over the stages (the remainder to the first ones),
  the embedding in the first stage and the unsharded head, counted as its own weight, in the last.

Verdict per model from the ratios (joint over each baseline, tokens/s): reproduced when the joint
search beats both by at least 2%, not reproduced when it beats neither, else only under stated
conditions. The tuner's time budget makes the joint figure depend a little on the machine's speed.

Run: ``.venv/bin/python benchmarks/joint_tuning.py [--quick]`` (full: a few minutes; ``--quick``:
one model, a short budget, a reduced grid for (b), results files only). Writes
``benchmarks/results/joint_tuning.{json,md}`` (or into ``$ROUNDPIPE_BENCH_RESULTS``); the full run
also writes its section of ``docs/schedule_study.md`` and ``docs/figures/schedule_study-joint-tuning.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

from _common import write_results
from schedule_study import CONDITIONAL, DOC, DOC_TITLE, FIGURES, NOT_REPRODUCED, REPRODUCED, replace_block

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import layer_times, model_costs
from roundpipe.presets import load_hardware, load_model_config
from roundpipe.schedule import POLICIES
from roundpipe.sim.options import SimOptions
from roundpipe.sim.report import jsonable
from roundpipe.sim.result import SimResult
from roundpipe.sim.scenario import Scenario, safe_run
from roundpipe.sim.search import COUNT_GRAINS, microbatch_candidates
from roundpipe.sim.tune import tune

NAME = "joint_tuning"
HARDWARE = "8xrtx4090"
SEQ_LEN = 4096
GLOBAL_BATCH = 64
BEATS = 1.02  # the joint search "beats" a baseline when at least 2% more tokens/s
BUDGET_S = 30.0
QUICK_BUDGET_S = 1.0  # the smoke: on this machine the tuner's best plan is the same as with 3 s
QUICK_MICROBATCHES_PER_DEVICE = (2, 4)  # (b)'s grid in quick mode
OPTIONS = SimOptions(record_timeline=False)


@dataclass(frozen=True)
class Case:
    """One heterogeneous model: its config (a preset, or a preset with fields changed) and tuning."""

    key: str
    preset: str
    lora_rank: int | None
    heterogeneity: str
    changes: tuple[tuple[str, object], ...] = ()

    def config(self) -> dict:
        cfg = load_model_config(self.preset)
        cfg.update(dict(self.changes))
        cfg["_name_or_path"] = self.key
        return cfg

    @property
    def tuning(self) -> str:
        return "full" if self.lora_rank is None else f"LoRA r={self.lora_rank}"


CASES = (
    Case("gpt-oss-20b", "gpt-oss-20b", None, "sliding-window and full attention alternate"),
    Case(
        "moe-dense-first", "qwen3-30b-a3b", 16, "three dense layers before 45 MoE layers",
        (("mlp_only_layers", [0, 1, 2]), ("intermediate_size", 6144)),
    ),
    Case("qwen3-0.6b", "qwen3-0.6b", None, "a 151,936 x 1024 LM head"),
)  # fmt: skip
QUICK_CASES = ("qwen3-0.6b",)


# ----------------------------------------------------------------------------- heterogeneity


def layer_profile(case: Case, hw) -> dict:
    """Per-layer forward + backward seconds of one sequence: how unalike the layers are."""
    costs = model_costs(case.config(), SEQ_LEN, 1, lora_rank=case.lora_rank, head_shards=1)
    f, b = layer_times(costs, hw)
    total = {c.name: x + y for c, x, y in zip(costs, f, b)}
    decoder = [t for name, t in total.items() if name.startswith("layers.")]
    mean = statistics.fmean(decoder)
    return {
        "decoder_layers": len(decoder),
        "decoder_min_ms": min(decoder) * 1e3,
        "decoder_max_ms": max(decoder) * 1e3,
        "head_ms": total["head"] * 1e3,
        "head_in_layers": total["head"] / mean,
        "embed_ms": total["embed"] * 1e3,
        "first_over_last_decoder": decoder[0] / decoder[-1],
    }


# ----------------------------------------------------------------------------- plans


def _plan(policy: str, m: int, stages, head_shards, result: SimResult, **extra) -> dict:
    return {
        "policy": policy,
        "microbatches": m,
        "stages": stages,
        "head_shards": head_shards,
        "tokens_per_s": result.tokens_per_s,
        "iteration_s": result.iteration_s,
        "bubble": result.bubble_total,
        "peak_gpu_gib": result.peak_gpu / 2**30,
        "fits": result.fits,
        "reason": result.reason,
        **extra,
    }


def best_of(plans: list[dict]) -> dict | None:
    """The fastest plan that fits, else the fastest (flagged ``fits: False``)."""
    if not plans:
        return None
    return max(plans, key=lambda p: (p["fits"], p["tokens_per_s"]))


def joint(case: Case, budget_s: float) -> dict:
    res = tune(
        case.config(), HARDWARE, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, lora_rank=case.lora_rank,
        options=OPTIONS, time_budget_s=budget_s,
    )  # fmt: skip
    b = res.best
    return _plan(
        b.policy, b.num_microbatches, list(b.stages), b.head_shards, b.result,
        candidates=len(res.ranked), search_s=res.elapsed_s, refined_moves=b.refined, notes=list(res.notes),
    )  # fmt: skip


def partition_only(case: Case, n_dev: int) -> dict:
    """(a): 1F1B on the balanced partition, each microbatch count the tuner would try."""
    plans = []
    for m in microbatch_candidates("1f1b", n_dev, GLOBAL_BATCH):
        s = Scenario(case.config(), HARDWARE, "1f1b", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, microbatches=m,
                     lora_rank=case.lora_rank)  # fmt: skip
        plans.append(_plan("1f1b", m, [n_dev, n_dev], "auto", safe_run(s, OPTIONS)))
    out = best_of(plans)
    out["tried"] = len(plans)
    return out


def even_bounds(num_decoder: int, stages: int) -> tuple[int, ...]:
    """Bounds over ``embed, layers.0 .. layers.{L-1}, head``: decoder layers split evenly (the first
    ``L % S`` stages one more), the embedding in the first stage, the head in the last."""
    if stages > num_decoder:
        raise ConfigError(
            f"{stages} stages for {num_decoder} decoder layers leaves some empty; use at most {num_decoder}"
        )
    q, r = divmod(num_decoder, stages)
    bounds, at = [0], 1  # the embedding is layer 0
    for k in range(stages):
        at += q + (k < r)
        bounds.append(at)
    bounds[-1] += 1  # the head joins the last stage
    return tuple(bounds)


def stage_counts(policy: str, n_dev: int) -> list[tuple[int, int]]:
    """(forward, backward) stage counts the tuner tries for ``policy`` (a free grain: its count pairs
    and one stage per device each way)."""
    spec = POLICIES[policy]
    if spec.separate_partitions:
        return [(n_dev, n_dev), *((f * n_dev, b * n_dev) for f, b in COUNT_GRAINS)]
    return [(s, s) for s in spec.stage_options(n_dev)]


def schedule_only(case: Case, n_dev: int, quick: bool) -> dict:
    """(b): the best policy, microbatch count and stage count on the even partition."""
    num_decoder = int(case.config()["num_hidden_layers"])
    plans, skipped = [], []
    for policy in POLICIES:
        ms = microbatch_candidates(policy, n_dev, GLOBAL_BATCH)
        if quick:
            ms = [m for m in ms if m in {k * n_dev for k in QUICK_MICROBATCHES_PER_DEVICE}] or ms[:1]
        for sf, sb in stage_counts(policy, n_dev):
            if max(sf, sb) > num_decoder:
                skipped.append(f"{policy} {sf}/{sb} stages: more than the {num_decoder} decoder layers")
                continue
            bounds = (even_bounds(num_decoder, sf), even_bounds(num_decoder, sb))
            for m in ms:
                s = Scenario(
                    case.config(), HARDWARE, policy, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, microbatches=m,
                    lora_rank=case.lora_rank, partitions=bounds, head_shards=1,
                )  # fmt: skip
                plans.append(_plan(policy, m, [sf, sb], 1, safe_run(s, OPTIONS)))
    out = best_of(plans)
    out["tried"] = len(plans)
    out["skipped"] = skipped
    return out


# ----------------------------------------------------------------------------- verdicts


def ratio(joint_plan: dict, baseline: dict) -> float:
    """Joint tokens/s over the baseline's; infinite when only the joint plan fits."""
    if not baseline["fits"] and joint_plan["fits"]:
        return math.inf
    return joint_plan["tokens_per_s"] / baseline["tokens_per_s"] if baseline["tokens_per_s"] else math.inf


def case_verdict(r_a: float, r_b: float) -> tuple[str, str]:
    beaten = {"(a) partition only": r_a >= BEATS, "(b) schedule only": r_b >= BEATS}
    if all(beaten.values()):
        return REPRODUCED, ""
    if not any(beaten.values()):
        return NOT_REPRODUCED, ""
    won = [k for k, v in beaten.items() if v]
    lost = [k for k, v in beaten.items() if not v]
    return CONDITIONAL, f"beats {', '.join(won)} but not {', '.join(lost)}"


def overall(cases: list[dict]) -> dict:
    verdicts = [c["verdict"] for c in cases]
    if all(v == REPRODUCED for v in verdicts):
        verdict, condition = REPRODUCED, ""
    elif all(v == NOT_REPRODUCED for v in verdicts):
        verdict, condition = NOT_REPRODUCED, ""
    else:
        verdict = CONDITIONAL
        condition = "; ".join(
            f"{c['model']}: {c['verdict']}" + (f" ({c['condition']})" if c["condition"] else "")
            for c in cases
        )
    return {
        "claim": "joint search of partition, placement and schedule beats optimising one phase",
        "verdict": verdict,
        "condition": condition,
    }


def _x(r: float) -> str:
    return "only joint fits" if math.isinf(r) else f"{r:.2f}x"


def sentence(c: dict) -> str:
    j, a, b = c["joint"], c["partition_only"], c["schedule_only"]
    return (
        f"{c['model']} ({c['tuning']}, {c['heterogeneity']}; head = {c['layers']['head_in_layers']:.1f} decoder "
        f"layers): joint {j['policy']} M={j['microbatches']} {j['tokens_per_s']:,.0f} tokens/s; "
        f"(a) 1f1b balanced M={a['microbatches']} {a['tokens_per_s']:,.0f}{'' if a['fits'] else ' (does not fit)'} "
        f"({_x(c['ratio_vs_partition_only'])}); (b) {b['policy']} even M={b['microbatches']} "
        f"{b['tokens_per_s']:,.0f}{'' if b['fits'] else ' (does not fit)'} ({_x(c['ratio_vs_schedule_only'])}): "
        f"{c['verdict']}"
    )


# ----------------------------------------------------------------------------- study and report


def study(case_keys=None, budget_s: float = BUDGET_S, quick: bool = False) -> dict:
    t0 = time.monotonic()
    hw = load_hardware(HARDWARE)
    cases = []
    for case in CASES:
        if case_keys is not None and case.key not in case_keys:
            continue
        j = joint(case, budget_s)
        a = partition_only(case, hw.num_gpus)
        b = schedule_only(case, hw.num_gpus, quick)
        r_a, r_b = ratio(j, a), ratio(j, b)
        verdict, condition = case_verdict(r_a, r_b)
        c = {
            "model": case.key,
            "preset": case.preset,
            "changes": dict(case.changes),
            "tuning": case.tuning,
            "heterogeneity": case.heterogeneity,
            "layers": layer_profile(case, hw),
            "joint": j,
            "partition_only": a,
            "schedule_only": b,
            "ratio_vs_partition_only": r_a,
            "ratio_vs_schedule_only": r_b,
            "verdict": verdict,
            "condition": condition,
        }
        c["sentence"] = sentence(c)
        cases.append(c)
        print(c["sentence"], flush=True)
    return {
        "benchmark": NAME,
        "hardware": HARDWARE,
        "seq_len": SEQ_LEN,
        "global_batch": GLOBAL_BATCH,
        "time_budget_s": budget_s,
        "beats_threshold": BEATS,
        "cases": cases,
        "verdict": overall(cases),
        "elapsed_s": time.monotonic() - t0,
        "quick": quick,
    }


HEADER = ["model", "tuning", "joint plan", "joint tokens/s", "(a) 1f1b balanced", "(b) even partition",
          "joint / (a)", "joint / (b)", "verdict"]  # fmt: skip


def _plan_text(p: dict) -> str:
    stages = p["stages"]
    st = f"{stages[0]}/{stages[1]}" if stages[0] != stages[1] else str(stages[0])
    fit = "" if p["fits"] else ", does not fit"
    return (
        f"{p['policy']} M={p['microbatches']} S={st} shards={p['head_shards']}: {p['tokens_per_s']:,.0f}{fit}"
    )


def rows(result: dict) -> list[list[str]]:
    out = []
    for c in result["cases"]:
        j = c["joint"]
        out.append([
            c["model"], c["tuning"], _plan_text(j).split(":")[0], f"{j['tokens_per_s']:,.0f}",
            _plan_text(c["partition_only"]), _plan_text(c["schedule_only"]),
            _x(c["ratio_vs_partition_only"]), _x(c["ratio_vs_schedule_only"]), c["verdict"],
        ])  # fmt: skip
    return out


def notes(result: dict) -> str:
    v = result["verdict"]
    lines = [
        f"Simulated, no GPU: {result['hardware']}, sequence {SEQ_LEN}, {GLOBAL_BATCH} sequences per step, bf16, "
        f"sync optimizer; joint = `sim.tune.tune` with a {result['time_budget_s']:.0f} s budget. "
        f"A ratio of at least {BEATS:.2f} counts as beating the baseline.",
        "",
        *(
            [
                "_Quick run (a smoke test): one model, a short search budget that cuts the tuner's grid, and a reduced "
                "grid for (b); the verdict below rests on that. The full run is in docs/schedule_study.md._",
                "",
            ]
            if result.get("quick")
            else []
        ),
        f"**{v['claim']}: {v['verdict']}.**" + (f" Conditions: {v['condition']}." if v["condition"] else ""),
        "",
        *(f"- {c['sentence']}." for c in result["cases"]),
        "",
        f"_Run in {result['elapsed_s']:.0f} s._",
    ]
    return "\n".join(lines)


def draw(result: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(2.6 * len(cases) + 2, 3.4))
    kinds = (
        ("joint", "joint search"),
        ("partition_only", "(a) 1f1b, balanced"),
        ("schedule_only", "(b) even partition"),
    )
    width = 0.26
    for i, (key, label) in enumerate(kinds):
        xs = [k + (i - 1) * width for k in range(len(cases))]
        rel = [c[key]["tokens_per_s"] / c["joint"]["tokens_per_s"] for c in cases]
        bars = ax.bar(xs, rel, width, label=label)
        for bar, c in zip(bars, cases):
            if not c[key]["fits"]:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
            text = f"{c[key]['policy']}\n{c[key]['tokens_per_s'] / 1e3:.1f}k"
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                text,
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(cases)), [f"{c['model']}\n({c['tuning']})" for c in cases], fontsize=8)
    ax.set_ylabel("tokens/s, joint search = 1")
    ax.set_ylim(0, 1.25)
    ax.set_title(
        f"Joint search against single-phase baselines, {result['hardware']} (labels: policy, tokens/s; hatched: does "
        "not fit)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    name = "schedule_study-joint-tuning.png"
    fig.savefig(FIGURES / name, dpi=90)
    plt.close(fig)
    return name


def doc_text(result: dict, figure: str) -> str:
    v = result["verdict"]
    lines = [
        "## Joint tuning against single-phase baselines (OctoPipe's claim)",
        "",
        "Written by `benchmarks/joint_tuning.py` (simulator, no GPU). OctoPipe's claim: searching partition, "
        "placement and schedule together beats optimising one of them. On three models whose layers are not "
        f"alike, on {result['hardware']} (sequence {SEQ_LEN}, {GLOBAL_BATCH} sequences per step, bf16, sync), the "
        f"tuner (`sim.tune.tune`, {result['time_budget_s']:.0f} s budget; placement is the policy's) against "
        "(a) 1F1B on the balanced partition at its best microbatch count and (b) the best policy, microbatch and "
        "stage count on an even partition (decoder layers split evenly, the embedding in the first stage, the "
        "unsharded head as its own weight in the last). `moe-dense-first` is the qwen3-30b-a3b preset with its "
        "first three layers dense (`mlp_only_layers = [0, 1, 2]`, `intermediate_size` 6144), defined in the "
        f"benchmark. The joint search beats a baseline when it gives at least {BEATS:.2f}x its tokens/s.",
        "",
        "| model | tuning | layers (fwd+bwd, one sequence) | " + " | ".join(HEADER[2:]) + " |",
        "|" + "---|" * (len(HEADER) + 1),
    ]
    for c, row in zip(result["cases"], rows(result)):
        ly = c["layers"]
        prof = (
            f"decoder {ly['decoder_min_ms']:.1f}-{ly['decoder_max_ms']:.1f} ms, head {ly['head_ms']:.1f} ms "
            f"(= {ly['head_in_layers']:.1f} layers)"
        )
        lines.append("| " + " | ".join([row[0], row[1], prof, *row[2:]]) + " |")
    lines += [
        "",
        f"**{v['claim'].capitalize()}: {v['verdict']}.**"
        + (f" Conditions: {v['condition']}." if v["condition"] else ""),
        "",
        *(f"- {c['sentence']}." for c in result["cases"]),
        "",
        f"![joint tuning](figures/{figure})",
        "",
        f"_Generated in {result['elapsed_s']:.0f} s; the joint figures depend a little on the machine's speed "
        "(the tuner's time budget)._",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, a short budget; results files only")
    args = ap.parse_args(argv)
    if args.quick:
        result = study(QUICK_CASES, QUICK_BUDGET_S, quick=True)
    else:
        result = study()
    write_results(NAME, jsonable(result), rows(result), HEADER, notes(result))
    if not args.quick:
        replace_block(DOC, NAME, doc_text(result, draw(result)), DOC_TITLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
