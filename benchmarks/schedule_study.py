"""The tabular-schedule study on roundpipe's models: GPipe, 1F1B, Chimera and Hanayo seen through
three abstractions, and whether the study's conclusions survive the move from one to the next.

1. **Closed forms** (``schedule.formulas.closed_form``): uniform stages, free copies. In *unit*
   time (one ``D``-th of the model's forward takes 1, its backward 2) and with the model's *actual*
   forward : backward ratio (the layers' summed times spread evenly over the policy's stages).
   Outside a form's domain (Chimera below ``2D`` microbatches, Hanayo unless ``b = 2f``) there is
   no figure, and the point says why.
2. **Idealised tables**: the policy's table replayed with zero communication and no optimizer
   time (``sim.without_costs``), on unit stages and on the model's actual per-layer compute with
   the policy's balanced partition.
3. **The communication-aware simulator** (``sim.simulate``, default options: copy engines, host
   links, weight-gradient downloads, host and device memory, the CPU optimizer) across microbatch
   counts and host-link bandwidths.

Every microbatch is one sequence of ``SEQ_LEN`` tokens, so the microbatch count changes the number
of microbatches and not their size. The link sweep: every GPU gets its own host link at the given
rate, from an NVLink-class 300 GB/s (defined here: a GeForce card has no NVLink, and every hand-off
in this runtime goes through host memory, so this stands for "communication nearly free") through
the RTX 4090's measured PCIe 4.0 x16 pinned rate (``hardware.json``) down to PCIe 3.0 x16 and x4
(their nominal rates derated by ``hardware.json``'s ``host_link_efficiency``, defined here), plus
the 8x RTX 4090 preset server as it stands (four GPUs sharing one PCIe 4.0 x16 switch uplink).

Conclusions checked, each with a verdict computed from the data (never written in advance):
(a) GPipe and 1F1B take equal time while 1F1B holds less activation memory; (b) Chimera pays off
mainly at low microbatch counts with fast links; (c) Hanayo is sensitive to a slow link.

Run: ``.venv/bin/python benchmarks/schedule_study.py [--quick]`` (full: about a minute on two
cores; ``--quick``: one setting, fewer points, a few seconds, results files only). Writes
``benchmarks/results/schedule_study.{json,md}`` (or into ``$ROUNDPIPE_BENCH_RESULTS``); the full
run also writes its section of ``docs/schedule_study.md`` and ``docs/figures/schedule_study-*.png``.
No GPU; nothing here imports torch (the simulator does not, and ``_common`` only to build a model).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from _common import write_results

from roundpipe.errors import ConfigError, ScheduleError
from roundpipe.presets import Server, load_hardware
from roundpipe.schedule import POLICIES, build_table
from roundpipe.schedule.formulas import closed_form
from roundpipe.schedule.table import Partition
from roundpipe.sim.options import SimOptions
from roundpipe.sim.report import jsonable
from roundpipe.sim.result import SimResult
from roundpipe.sim.scenario import Scenario, prepare
from roundpipe.sim.simulator import simulate, without_costs
from roundpipe.sim.workload import Workload, uniform_workload

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "schedule_study.md"
FIGURES = ROOT / "docs" / "figures"
NAME = "schedule_study"

STUDIED = ("gpipe", "1f1b", "chimera", "hanayo")
SHORT = {"gpipe": "G", "1f1b": "1", "chimera": "C", "hanayo": "H"}
SEQ_LEN = 4096
MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
QUICK_MICROBATCHES = (1, 2, 4, 8, 16)
QUICK_LINKS = ("nvlink-300", "pcie4-x16", "pcie3-x4")

VERDICTS = ("reproduced", "not reproduced", "only under stated conditions")
REPRODUCED, NOT_REPRODUCED, CONDITIONAL = VERDICTS
TIE = 0.01  # two step times within 1% rank as equal
EQUAL_TIME = 0.02  # (a): "equal time" is within 2%
PAYS_OFF = 1.02  # (b): Chimera pays off when at least 2% faster than the better of GPipe and 1F1B
FAST_LINK_GBS = 20.0  # (b): a link is fast when each GPU's fair share of it is at least this
MORE_SENSITIVE = 1.02  # (c): Hanayo's slow/fast step ratio must beat GPipe's and 1F1B's by 2%
BASELINES = ("gpipe", "1f1b")  # the one-stage-per-device pipelines that (b) and (c) measure against

IDEAL = without_costs(SimOptions(record_timeline=False))
REAL = SimOptions(record_timeline=False)


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One model on ``devices`` RTX 4090s, full fine-tuning or LoRA."""

    model: str
    devices: int
    lora_rank: int | None = None

    @property
    def label(self) -> str:
        tuning = "full" if self.lora_rank is None else f"LoRA r={self.lora_rank}"
        return f"{self.model} {tuning}, {self.devices}x RTX 4090"

    @property
    def slug(self) -> str:
        tuning = "full" if self.lora_rank is None else f"lora{self.lora_rank}"
        return f"{self.model}-{tuning}-{self.devices}gpu"


SETTINGS = (
    Setting("qwen3-1.7b", 4),
    Setting("qwen3-1.7b", 4, 16),
    Setting("llama3.1-8b", 8),
    Setting("llama3.1-8b", 8, 16),
)
QUICK_SETTINGS = (Setting("qwen3-1.7b", 4),)


@dataclass(frozen=True)
class Link:
    """One point of the host-link sweep: a per-GPU rate (GB/s per direction, nominal and what
    pinned copies reach), or ``shared``: the preset server as ``hardware.json`` builds it."""

    name: str
    label: str
    nominal_gbs: float
    effective_gbs: float
    source: str
    shared: bool = False

    def server(self, base: Server) -> Server:
        if self.shared:
            return base
        gpu = replace(
            base.gpu, host_link_bw=self.nominal_gbs * 1e9, host_link_bw_measured=self.effective_gbs * 1e9
        )
        return replace(base, gpu=gpu, gpus_per_switch=1, switch_uplink_bw=self.nominal_gbs * 1e9)


def fair_share_gbs(server: Server) -> float:
    """Each GPU's rate when every GPU copies at once: its own link, or its share of the switch uplink."""
    sharing = min(server.gpus_per_switch, server.num_gpus)
    return min(server.gpu.host_link_bw_effective, server.uplink_bw_effective / sharing) / 1e9


def link_sweep(base: Server) -> tuple[Link, ...]:
    """The sweep, fastest first. Only the PCIe 4.0 x16 rates come from ``hardware.json``; the rest
    are defined here (see the module docstring)."""
    gpu = base.gpu
    eff = gpu.host_link_efficiency
    measured = gpu.host_link_bw_effective / 1e9
    return (
        Link("nvlink-300", "NVLink-class, 300 GB/s", 300.0, 300.0, "defined here; a GeForce card has no NVLink"),
        Link(
            "pcie4-x16", f"PCIe 4.0 x16, {measured:.0f} GB/s", gpu.host_link_bw / 1e9, measured,
            "hardware.json rtx4090, measured pinned host-to-device rate",
        ),
        Link(
            "pcie4-x16-shared", f"preset server: PCIe 4.0 x16, {base.gpus_per_switch} GPUs per switch uplink",
            gpu.host_link_bw / 1e9, measured, "hardware.json rtx4090 server topology as it stands", shared=True,
        ),
        Link("pcie3-x16", f"PCIe 3.0 x16, {16 * eff:.0f} GB/s", 16.0, 16 * eff, "defined here, nominal 16 GB/s x host_link_efficiency"),
        Link("pcie3-x4", f"PCIe 3.0 x4, {4 * eff:.0f} GB/s", 4.0, 4 * eff, "defined here, nominal 4 GB/s x host_link_efficiency"),
    )  # fmt: skip


# ----------------------------------------------------------------------------- measurement


def _result(r: SimResult) -> dict:
    return {
        "step": r.iteration_s,
        "tokens_per_s": r.tokens_per_s,
        "bubble": r.bubble_total,
        "peak_activations": max(r.peak_activations),
        "peak_gpu_gib": r.peak_gpu / 2**30,
        "peak_host_gib": r.peak_host_bytes / 2**30,
        "h2d_gb": r.h2d_bytes / 1e9,
        "d2h_gb": r.d2h_bytes / 1e9,
        "fits": r.fits,
        "reason": r.reason,
    }


def _closed(policy: str, devices: int, m: int, stages: int, f: float, b: float) -> dict:
    try:
        cf = closed_form(policy, devices, m, stages, f=f, b=b)
    except ConfigError as err:
        return {"step": None, "outside": str(err)}
    return {"step": cf.makespan, "bubble": cf.idle_over_total, "peak_activations": cf.peak_activations}


def model_totals(work: Workload) -> tuple[float, float]:
    """The whole model's forward seconds and backward-task seconds (recompute included) for one
    microbatch: what the closed forms spread evenly over the stages."""
    fwd = math.fsum(lw.fwd_s for lw in work.layers)
    bwd = math.fsum((lw.fwd_s if lw.recompute else 0.0) + lw.bwd_s for lw in work.layers)
    return fwd, bwd


def skip_reason(policy: str, devices: int, m: int) -> str | None:
    spec = POLICIES[policy]
    if not spec.accepts_microbatches(m, devices):
        return f"{policy} takes only multiples of {spec.microbatch_step(devices)} microbatches"
    return None


def study_policy(
    setting: Setting, policy: str, base: Server, servers: dict, microbatches, fastest: str
) -> dict:
    """Every abstraction at every microbatch count for one policy of one setting; at the fewest
    microbatches also the fastest link without optimizer time (how much the step's tail weighs)."""
    d = setting.devices
    prep = prepare(
        Scenario(setting.model, base, policy, seq_len=SEQ_LEN, global_batch=2 * d, microbatches=2 * d,
                 lora_rank=setting.lora_rank)
    )  # fmt: skip
    part = prep.table.forward
    stages = part.num_stages
    f_total, b_total = model_totals(prep.workload)
    unit = Partition.per_layer(stages)
    unit_work = uniform_workload(stages, d / stages, 2 * d / stages)
    points = []
    for m in microbatches:
        point: dict = {"m": m, "skipped": skip_reason(policy, d, m)}
        if point["skipped"] is None:
            try:
                table = build_table(policy, part, part, d, m)
                unit_table = build_table(policy, unit, unit, d, m)
            except ScheduleError as err:
                point["skipped"] = str(err)
        if point["skipped"] is not None:
            points.append(point)
            continue
        point["closed_unit"] = _closed(policy, d, m, stages, d / stages, 2 * d / stages)
        point["closed_actual"] = _closed(policy, d, m, stages, f_total / stages, b_total / stages)
        point["table_unit"] = _result(simulate(unit_table, unit_work, base, IDEAL))
        point["table_actual"] = _result(simulate(table, prep.workload, base, IDEAL))
        point["sim"] = {
            name: _result(simulate(table, prep.workload, hw, REAL)) for name, hw in servers.items()
        }
        if m == microbatches[0]:
            free_optimizer = replace(REAL, optimizer_time=False)
            point["fastest_without_optimizer"] = simulate(
                table, prep.workload, servers[fastest], free_optimizer
            ).iteration_s
        points.append(point)
    return {
        "stages": stages,
        "bounds": list(part.bounds),
        "head_shards": prep.head_shards,
        "f_over_b": f_total / b_total,
        "points": points,
    }


# ----------------------------------------------------------------------------- rankings


def abstraction_keys(link_names) -> list[str]:
    return ["closed_unit", "closed_actual", "table_unit", "table_actual", *(f"sim:{n}" for n in link_names)]


def step_of(point: dict, key: str) -> float | None:
    if point.get("skipped") is not None:
        return None
    if key.startswith("sim:"):
        return point["sim"][key[4:]]["step"]
    return point[key]["step"]


def relation(tp: float, tq: float) -> str:
    if abs(tp - tq) <= TIE * min(tp, tq):
        return "="
    return "<" if tp < tq else ">"


def ranking(times: dict[str, float]) -> str:
    """Fastest first; ``=`` joins policies within ``TIE`` of the first of their group."""
    order = sorted(times, key=lambda p: (times[p], STUDIED.index(p)))
    text, lead = "", None
    for p in order:
        if lead is None:
            text = SHORT[p]
        elif times[p] <= times[lead] * (1 + TIE):
            text += "=" + SHORT[p]
            continue
        else:
            text += "<" + SHORT[p]
        lead = p
    return text


def rankings_and_differences(policies: dict, microbatches, link_names) -> tuple[dict, list]:
    """Per microbatch count, each abstraction's ranking; and every pair of policies whose order
    (faster / equal / slower) is not the same in all abstractions that have both."""
    keys = abstraction_keys(link_names)
    rankings: dict[str, dict[str, str]] = {}
    differences = []
    for i, m in enumerate(microbatches):
        times = {
            key: {p: t for p in STUDIED if (t := step_of(policies[p]["points"][i], key)) is not None}
            for key in keys
        }
        rankings[str(m)] = {key: ranking(t) for key, t in times.items() if t}
        for p, q in itertools.combinations(STUDIED, 2):
            rels = {key: relation(t[p], t[q]) for key, t in times.items() if p in t and q in t}
            if len(set(rels.values())) > 1:
                differences.append({"m": m, "pair": [p, q], "relations": rels})
    return rankings, differences


# ----------------------------------------------------------------------------- conclusions


def m_range(ms: list[int], all_ms: list[int]) -> str:
    if ms == all_ms:
        return "every M"
    if len(ms) == 1:
        return f"M = {ms[0]}"
    idx = [all_ms.index(m) for m in ms]
    if idx == list(range(idx[0], idx[-1] + 1)):
        if idx[0] == 0:
            return f"M <= {ms[-1]}"
        if idx[-1] == len(all_ms) - 1:
            return f"M >= {ms[0]}"
        return f"M {ms[0]}-{ms[-1]}"
    return "M in {" + ", ".join(map(str, ms)) + "}"


def describe_region(points: set[tuple[int, str]], all_ms: list[int], link_names: list[str]) -> str:
    """A short phrase for a set of ``(microbatches, link)`` points, e.g. "M <= 8 on nvlink-300"."""
    if not points:
        return "nowhere"
    if len(points) == len(all_ms) * len(link_names):
        return "at every point"
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in link_names:
        ms = tuple(sorted(m for m, n in points if n == name))
        if ms:
            groups.setdefault(ms, []).append(name)
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(link_names):
        return f"{m_range(list(next(iter(groups))), all_ms)} on every link"
    return "; ".join(f"{m_range(list(ms), all_ms)} on {', '.join(names)}" for ms, names in groups.items())


def _runs(policy_data: dict) -> list[dict]:
    return [pt for pt in policy_data["points"] if pt.get("skipped") is None]


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def conclusion_a(setting: Setting, policies: dict, link_names: list[str]) -> dict:
    """GPipe and 1F1B take equal time while 1F1B holds less activation memory."""
    g, o = _runs(policies["gpipe"]), _runs(policies["1f1b"])
    ms = [pt["m"] for pt in g]
    ratios, equal, mem_less, mem_not_more = {}, set(), [], True
    for pg, po in zip(g, o):
        m = pg["m"]
        for name in link_names:
            r = po["sim"][name]["step"] / pg["sim"][name]["step"]
            ratios[f"{m}@{name}"] = r
            if abs(r - 1) <= EQUAL_TIME:
                equal.add((m, name))
            act_g, act_o = pg["sim"][name]["peak_activations"], po["sim"][name]["peak_activations"]
            mem_not_more &= act_o <= act_g
            if m > setting.devices:
                mem_less.append(act_o < act_g)
    ideal = {pg["m"]: po["table_actual"]["step"] / pg["table_actual"]["step"] for pg, po in zip(g, o)}
    ideal_equal = all(abs(r - 1) <= EQUAL_TIME for r in ideal.values())
    ideal_text = ", ".join(f"{r:.3f} at M = {m}" for m, r in ideal.items() if m in (ms[0], ms[-1]))
    memory_holds = mem_not_more and all(mem_less)
    n = len(ms) * len(link_names)
    if memory_holds and len(equal) == n:
        verdict, condition = REPRODUCED, ""
    elif not memory_holds or not equal:  # the sentence's stage-input counts say which half failed
        verdict, condition = NOT_REPRODUCED, ""
    else:
        verdict, condition = CONDITIONAL, "equal time " + describe_region(equal, ms, link_names)
    last = g[-1]["m"]
    sentence = (
        f"1F1B's simulated step is within {EQUAL_TIME:.0%} of GPipe's at {len(equal)} of {n} points "
        f"(1F1B / GPipe {min(ratios.values()):.3f} to {max(ratios.values()):.3f}; in the idealised tables "
        f"{ideal_text}), and at M = {last} 1F1B holds "
        f"{o[-1]['sim'][link_names[0]]['peak_activations']} stage inputs per device against GPipe's "
        f"{g[-1]['sim'][link_names[0]]['peak_activations']}"
    )
    return {
        "verdict": verdict,
        "condition": condition,
        "sentence": sentence,
        "ratio_1f1b_over_gpipe": ratios,
        "equal_points": len(equal),
        "points": n,
        "memory_less_above_D": memory_holds,
        "idealised_equal": ideal_equal,
        "idealised_ratio": {str(m): r for m, r in ideal.items()},
    }


def conclusion_b(setting: Setting, policies: dict, links: dict[str, float]) -> dict:
    """Chimera pays off mainly at low microbatch counts with fast links."""
    names = list(links)
    by_m = {pt["m"]: pt for pt in _runs(policies["chimera"])}
    g = {pt["m"]: pt for pt in _runs(policies["gpipe"])}
    o = {pt["m"]: pt for pt in _runs(policies["1f1b"])}
    ms = [m for m in by_m if m in g and m in o]
    speedup, pays = {}, set()
    quadrant: dict[str, list[float]] = {
        "low M, fast": [],
        "low M, slow": [],
        "high M, fast": [],
        "high M, slow": [],
    }
    for m in ms:
        for name in names:
            c = by_m[m]["sim"][name]
            s = min(g[m]["sim"][name]["step"], o[m]["sim"][name]["step"]) / c["step"]
            speedup[f"{m}@{name}"] = s
            if s >= PAYS_OFF and c["fits"]:
                pays.add((m, name))
            low = m <= 2 * setting.devices
            fast = links[name] >= FAST_LINK_GBS
            quadrant[f"{'low' if low else 'high'} M, {'fast' if fast else 'slow'}"].append(s)
    means = {k: geomean(v) for k, v in quadrant.items()}
    in_claimed = sum(1 for m, name in pays if m <= 2 * setting.devices and links[name] >= FAST_LINK_GBS)
    lf = means["low M, fast"]
    pattern = (
        in_claimed > 0
        and in_claimed >= len(pays) / 2
        and all(not math.isfinite(means[k]) or lf > means[k] + 0.01 for k in ("high M, fast", "low M, slow"))
    )
    if not pays:
        verdict, condition = NOT_REPRODUCED, ""
    elif pattern:
        verdict, condition = REPRODUCED, ""
    else:
        verdict, condition = CONDITIONAL, "pays off " + describe_region(pays, ms, names)
    best = max(speedup, key=speedup.get)
    sentence = (
        f"Chimera is at least {PAYS_OFF - 1:.0%} faster than the better of GPipe and 1F1B (and fits) at "
        f"{len(pays)} of {len(speedup)} points, {in_claimed} of them at M <= 2D on links of at least "
        f"{FAST_LINK_GBS:.0f} GB/s per GPU; mean speed-up by quadrant "
        + ", ".join(f"{k} {v:.2f}x" for k, v in means.items() if math.isfinite(v))
        + f"; best {speedup[best]:.2f}x at M = {best.replace('@', ' on ')}"
    )
    return {
        "verdict": verdict,
        "condition": condition,
        "sentence": sentence,
        "speedup_over_best_of_gpipe_1f1b": speedup,
        "quadrant_geomean": means,
        "pays_off_points": len(pays),
        "pays_off_in_claimed_region": in_claimed,
    }


def conclusion_c(setting: Setting, policies: dict, fastest: str, slowest: str) -> dict:
    """Hanayo is sensitive to a slow link: its step grows more from the fastest to the slowest link
    than the step of the one-stage-per-device pipelines (GPipe, 1F1B) does."""
    sens: dict[str, dict[int, float]] = {}
    for p in STUDIED:
        sens[p] = {
            pt["m"]: pt["sim"][slowest]["step"] / pt["sim"][fastest]["step"] for pt in _runs(policies[p])
        }
    ms = list(sens["hanayo"])
    above_baselines, above_all = [], []
    for m in ms:
        h = sens["hanayo"][m]
        if h > max(sens[p][m] for p in BASELINES) * MORE_SENSITIVE:
            above_baselines.append(m)
        if all(h > sens[p][m] * MORE_SENSITIVE for p in STUDIED if p != "hanayo" and m in sens[p]):
            above_all.append(m)
    if len(above_baselines) == len(ms):
        verdict, condition = REPRODUCED, ""
    elif above_baselines:
        verdict, condition = (
            CONDITIONAL,
            f"more link-sensitive than GPipe and 1F1B at {m_range(above_baselines, ms)}",
        )
    else:
        verdict, condition = NOT_REPRODUCED, ""
    medians = {p: statistics.median(v.values()) for p, v in sens.items() if v}
    top = max(ms)
    d2h = {p: pt["sim"][fastest]["d2h_gb"] for p in STUDIED for pt in _runs(policies[p]) if pt["m"] == top}
    sentence = (
        f"From {fastest} to {slowest} the step grows by a median "
        + ", ".join(f"{p} {medians[p]:.2f}x" for p in STUDIED if p in medians)
        + f"; Hanayo's grows more than GPipe's and 1F1B's (by over {MORE_SENSITIVE - 1:.0%}) at "
        f"{len(above_baselines)} of {len(ms)} microbatch counts, more than every other policy's at {len(above_all)}; "
        f"bytes sent down per step at M = {top}: " + ", ".join(f"{p} {v:,.0f} GB" for p, v in d2h.items())
    )
    return {
        "verdict": verdict,
        "condition": condition,
        "sentence": sentence,
        "slow_over_fast": {p: {str(m): v for m, v in s.items()} for p, s in sens.items()},
        "median_slow_over_fast": medians,
        "hanayo_above_gpipe_1f1b_at": above_baselines,
        "hanayo_above_all_at": above_all,
        "d2h_gb_at_most_microbatches": d2h,
    }


CLAIMS = {
    "a": "GPipe and 1F1B take equal time while 1F1B holds less activation memory",
    "b": "Chimera pays off mainly at low microbatch counts with fast links",
    "c": "Hanayo is sensitive to a slow link",
}


def combine(key: str, per_setting: dict[str, dict]) -> dict:
    """One verdict over the settings: reproduced (or not) only when every setting agrees."""
    verdicts = [v["verdict"] for v in per_setting.values()]
    if all(v == REPRODUCED for v in verdicts):
        verdict, condition = REPRODUCED, ""
    elif all(v == NOT_REPRODUCED for v in verdicts):
        verdict, condition = NOT_REPRODUCED, ""
    else:
        verdict = CONDITIONAL
        condition = "; ".join(
            f"{label}: {v['verdict']}" + (f" ({v['condition']})" if v["condition"] else "")
            for label, v in per_setting.items()
        )
    return {"claim": CLAIMS[key], "verdict": verdict, "condition": condition, "per_setting": per_setting}


# ----------------------------------------------------------------------------- study


def closed_vs_table(settings: list[dict]) -> dict:
    """How often the unit table's replayed step equals the closed form (where the form exists)."""
    defined = equal = 0
    for s in settings:
        for data in s["policies"].values():
            for pt in _runs(data):
                cf = pt["closed_unit"]["step"]
                if cf is not None:
                    defined += 1
                    equal += abs(pt["table_unit"]["step"] - cf) <= 1e-9 * max(1.0, cf)
    return {"defined": defined, "equal": equal}


def study(settings=SETTINGS, microbatches=MICROBATCHES, link_names: tuple[str, ...] | None = None) -> dict:
    t0 = time.monotonic()
    out: dict = {
        "benchmark": NAME,
        "seq_len": SEQ_LEN,
        "sequences_per_microbatch": 1,
        "policies": list(STUDIED),
        "microbatches": list(microbatches),
        "settings": [],
    }
    per_conclusion: dict[str, dict[str, dict]] = {"a": {}, "b": {}, "c": {}}
    for setting in settings:
        base = load_hardware(f"{setting.devices}xrtx4090")
        sweep = [lk for lk in link_sweep(base) if link_names is None or lk.name in link_names]
        servers = {lk.name: lk.server(base) for lk in sweep}
        shares = {name: fair_share_gbs(hw) for name, hw in servers.items()}
        names = sorted(shares, key=lambda n: -shares[n])  # fastest first
        out.setdefault(
            "links",
            [
                {"name": lk.name, "label": lk.label, "fair_share_gbs": shares[lk.name], "source": lk.source}
                for lk in sweep
            ],
        )
        policies = {p: study_policy(setting, p, base, servers, microbatches, names[0]) for p in STUDIED}
        rankings, differences = rankings_and_differences(policies, microbatches, names)
        conclusions = {
            "a": conclusion_a(setting, policies, names),
            "b": conclusion_b(setting, policies, {n: shares[n] for n in names}),
            "c": conclusion_c(setting, policies, names[0], names[-1]),
        }
        for k, v in conclusions.items():
            per_conclusion[k][setting.label] = v
        out["settings"].append(
            {
                "label": setting.label,
                "slug": setting.slug,
                "model": setting.model,
                "devices": setting.devices,
                "lora_rank": setting.lora_rank,
                "links_fastest_first": names,
                "policies": policies,
                "rankings": rankings,
                "differences": differences,
            }
        )
    out["conclusions"] = {k: combine(k, v) for k, v in per_conclusion.items()}
    out["closed_vs_table"] = closed_vs_table(out["settings"])
    out["elapsed_s"] = time.monotonic() - t0
    return out


# ----------------------------------------------------------------------------- reporting


def rounded(value, digits: int = 5):
    """``value`` with floats cut to ``digits`` significant digits: the results file stays readable
    (and a tenth smaller) without claiming a precision the model does not have."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    names = result["settings"][0]["links_fastest_first"]
    header = ["setting", "M", "policy", "closed form (unit)", "table (unit)", "table (actual) s"]
    header += [f"sim {n} s" for n in names] + ["stage inputs (sim)", f"fits ({names[-1]})"]
    rows = []
    for s in result["settings"]:
        for i, m in enumerate(result["microbatches"]):
            for p in STUDIED:
                pt = s["policies"][p]["points"][i]
                if pt.get("skipped"):
                    rows.append(
                        [s["label"], str(m), p, "skipped: " + pt["skipped"]] + [""] * (len(header) - 4)
                    )
                    continue
                sims = [pt["sim"][n] for n in names]
                rows.append(
                    [s["label"], str(m), p, _fmt(pt["closed_unit"]["step"], ".1f"), _fmt(pt["table_unit"]["step"], ".1f"),
                     _fmt(pt["table_actual"]["step"], ".3f"), *(_fmt(r["step"], ".3f") for r in sims),
                     str(sims[0]["peak_activations"]), "yes" if sims[-1]["fits"] else "no"]
                )  # fmt: skip
    return header, rows


def ranking_table(setting: dict, microbatches) -> list[str]:
    keys = abstraction_keys(setting["links_fastest_first"])
    head = "| M | " + " | ".join(k.replace("_", " ") for k in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    for m in microbatches:
        r = setting["rankings"][str(m)]
        lines.append(f"| {m} | " + " | ".join(f"`{r[k]}`" if k in r else "-" for k in keys) + " |")
    return lines


def differences_text(setting: dict, limit: int | None = None) -> list[str]:
    diffs = setting["differences"]
    lines = []
    for d in diffs[:limit]:
        p, q = d["pair"]
        rel = ", ".join(f"{k} {v}" for k, v in d["relations"].items())
        lines.append(f"- M = {d['m']}, {p} vs {q}: {rel}")
    if limit is not None and len(diffs) > limit:
        lines.append(f"- ... {len(diffs) - limit} more in `benchmarks/results/{NAME}.json`")
    return lines


def conclusion_lines(result: dict) -> list[str]:
    lines = []
    for key, c in result["conclusions"].items():
        lines.append(
            f"**({key}) {c['claim']}: {c['verdict']}.**"
            + (f" Conditions: {c['condition']}." if c["condition"] else "")
        )
        for label, v in c["per_setting"].items():
            lines.append(f"- {label}: {v['verdict']}. {v['sentence']}.")
        lines.append("")
    return lines


def notes_text(result: dict) -> str:
    out = [
        f"Simulated, no GPU: {SEQ_LEN}-token sequences, one per microbatch; bf16; sync optimizer. "
        "`closed form` and `table (unit)` are in units of one D-th of the model's forward; the rest in seconds. "
        "Links: "
        + "; ".join(f"{lk['name']} = {lk['label']} ({lk['source']})" for lk in result["links"])
        + ".",
        "",
        *(
            [
                f"_Quick run: {result['settings'][0]['label']} only, M in {result['microbatches']}, three links._",
                "",
            ]
            if result.get("quick")
            else []
        ),
        *conclusion_lines(result),
        "Rankings (fastest first, `=` within 1%; G gpipe, 1 1f1b, C chimera, H hanayo):",
        "",
    ]
    for s in result["settings"]:
        out += [f"### {s['label']}", "", *ranking_table(s, result["microbatches"]), ""]
        out += [
            f"Orders that differ between abstractions ({len(s['differences'])}):",
            "",
            *differences_text(s),
            "",
        ]
    out.append(f"_Run in {result['elapsed_s']:.0f} s._")
    return "\n".join(out)


# ----------------------------------------------------------------------------- docs and figures


def replace_block(path: Path, name: str, text: str, title: str) -> None:
    """Rewrite the ``<!-- name:begin -->`` .. ``<!-- name:end -->`` block of ``path`` (made if missing),
    so two benchmarks can each keep their own section of one page."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = path.read_text(encoding="utf-8") if path.exists() else f"# {title}\n\n"
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end) :]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc, encoding="utf-8")


DOC_TITLE = "Schedule study: closed forms, tables and the simulator"


def draw(result: dict) -> list[str]:
    """Two PNGs per setting: tokens/s against microbatches per abstraction, and the conclusions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    colours = {"gpipe": "tab:blue", "1f1b": "tab:orange", "chimera": "tab:green", "hanayo": "tab:red"}
    written = []
    for s in result["settings"]:
        names = s["links_fastest_first"]
        panels = ["table_actual", *names]
        cols = min(3, len(panels))
        rows_n = -(-len(panels) // cols)
        fig, grid = plt.subplots(rows_n, cols, figsize=(3.6 * cols, 3.0 * rows_n), sharey=True, squeeze=False)
        axes = [ax for row in grid for ax in row]
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        for ax, key in zip(axes, panels):
            for p in STUDIED:
                pts = [pt for pt in s["policies"][p]["points"] if not pt.get("skipped")]
                r = [pt["table_actual"] if key == "table_actual" else pt["sim"][key] for pt in pts]
                ms = [pt["m"] for pt in pts]
                tps = [pt["m"] * SEQ_LEN / x["step"] for pt, x in zip(pts, r)]
                ax.plot(ms, tps, "-", color=colours[p], label=p)
                ax.scatter(
                    ms,
                    tps,
                    color=[colours[p] if x["fits"] else "white" for x in r],
                    edgecolor=colours[p],
                    s=18,
                    zorder=3,
                )
            ax.set_xscale("log", base=2)
            ax.set_title("table, no communication" if key == "table_actual" else key, fontsize=9)
            ax.set_xlabel("microbatches")
            ax.grid(alpha=0.3)
        for row in grid:
            row[0].set_ylabel("tokens/s")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{s['label']}: tokens/s (hollow: does not fit)", fontsize=10)
        fig.tight_layout()
        name = f"{NAME}-{s['slug']}-throughput.png"
        fig.savefig(FIGURES / name, dpi=90)
        plt.close(fig)
        written.append(name)

        c = {k: v["per_setting"][s["label"]] for k, v in result["conclusions"].items()}
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
        ms_all = result["microbatches"]
        for n in names:
            ms = [m for m in ms_all if f"{m}@{n}" in c["a"]["ratio_1f1b_over_gpipe"]]
            axes[0].plot(ms, [c["a"]["ratio_1f1b_over_gpipe"][f"{m}@{n}"] for m in ms], "o-", ms=3, label=n)
        axes[0].axhspan(1 - EQUAL_TIME, 1 + EQUAL_TIME, color="grey", alpha=0.2)
        axes[0].set(xscale="log", title="(a) 1F1B / GPipe step time", xlabel="microbatches")
        axes[0].set_xscale("log", base=2)
        axes[0].legend(fontsize=7)
        sp = c["b"]["speedup_over_best_of_gpipe_1f1b"]
        ms = sorted({int(k.split("@")[0]) for k in sp})
        grid = [[sp.get(f"{m}@{n}", math.nan) for m in ms] for n in names]
        im = axes[1].imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                axes[1].text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        axes[1].set_xticks(range(len(ms)), [str(m) for m in ms])
        axes[1].set_yticks(range(len(names)), names, fontsize=7)
        axes[1].set(title="(b) Chimera speed-up over best of GPipe/1F1B", xlabel="microbatches")
        fig.colorbar(im, ax=axes[1], fraction=0.04)
        for p in STUDIED:
            v = c["c"]["slow_over_fast"][p]
            axes[2].plot([int(m) for m in v], list(v.values()), "o-", ms=3, color=colours[p], label=p)
        axes[2].set_xscale("log", base=2)
        axes[2].set(title=f"(c) step on {names[-1]} / on {names[0]}", xlabel="microbatches")
        axes[2].legend(fontsize=7)
        for ax in (axes[0], axes[2]):
            ax.grid(alpha=0.3)
        fig.suptitle(s["label"], fontsize=10)
        fig.tight_layout()
        name = f"{NAME}-{s['slug']}-conclusions.png"
        fig.savefig(FIGURES / name, dpi=90)
        plt.close(fig)
        written.append(name)
    return written


def tail_text(result: dict) -> str:
    """GPipe against Hanayo at the fewest microbatches on the fastest link, with and without optimizer time."""
    s = result["settings"][0]
    g, h = (s["policies"][p]["points"][0] for p in ("gpipe", "hanayo"))
    if g.get("skipped") or h.get("skipped"):
        return ""
    link = s["links_fastest_first"][0]
    return (
        f"{s['label']}, M = {g['m']} on `{link}`: GPipe {g['sim'][link]['step']:.3f} s, Hanayo "
        f"{h['sim'][link]['step']:.3f} s; without optimizer time GPipe {g['fastest_without_optimizer']:.3f} s, "
        f"Hanayo {h['fastest_without_optimizer']:.3f} s."
    )


def doc_text(result: dict, figures: list[str]) -> str:
    lines = [
        "Written by `benchmarks/schedule_study.py` (simulator, no GPU). GPipe, 1F1B, Chimera and Hanayo "
        "compared by three abstractions: the closed forms of `roundpipe/schedule/formulas.py` (uniform stages, "
        "in unit time and with the model's own forward : backward ratio), the policies' idealised tables "
        "(replayed with no communication and no optimizer time, on unit stages and on the model's per-layer "
        "compute), and the communication-aware simulator (copy engines, host links, weight-gradient downloads, "
        "memory, the CPU optimizer; [simulator.md](simulator.md)). "
        f"Every microbatch is one {SEQ_LEN}-token sequence; bf16, sync optimizer; partitions balanced on "
        "forward + backward time (one stage per device, two for Hanayo).",
        "",
        "Host links (each GPU its own link unless shared): "
        + "; ".join(f"`{lk['name']}` {lk['label']} ({lk['source']})" for lk in result["links"])
        + f". A link counts as fast for (b) when each GPU's fair share is at least {FAST_LINK_GBS:.0f} GB/s "
        f"(the shared preset's is {next(lk['fair_share_gbs'] for lk in result['links'] if lk['name'] == 'pcie4-x16-shared'):.0f}).",
        "",
        "## Conclusions",
        "",
        f"Thresholds: equal time within {EQUAL_TIME:.0%}; Chimera pays off at {PAYS_OFF - 1:.0%} over the better of "
        f"GPipe and 1F1B and only where it fits; low M is M <= 2D; Hanayo counts as link-sensitive at a "
        f"microbatch count when its slowest-over-fastest step ratio exceeds GPipe's and 1F1B's by {MORE_SENSITIVE - 1:.0%}. "
        "A verdict holds for the whole study only when every setting agrees.",
        "",
        *conclusion_lines(result),
        "What drives the differences (mechanisms of this runtime, visible in the per-point figures of "
        f"`benchmarks/results/{NAME}.json`):",
        "",
        "- **The fused head.** The runtime runs the last stage's forward and backward as one task, without "
        "recompute, when they are adjacent in a device's row. 1F1B's last device alternates them for every "
        "microbatch; GPipe's runs all forwards first, so only at M = 1. That is why 1F1B is faster than GPipe in "
        "the idealised tables with actual compute (the unit stages recompute nothing, so there they tie), and "
        "why (a) holds only where the link, not the compute, sets the step.",
        "- **Weight-gradient traffic.** A device sums a stage's weight gradients while it keeps backpropagating "
        "that stage and sends them down when it moves to another. Chimera and Hanayo hold two stages per device "
        "and switch between them, so under full fine-tuning they send many times GPipe's bytes down per step "
        "(the (c) lines give them). That makes them the two most link-sensitive schedules with full "
        "fine-tuning, and makes a slow link cost Chimera its lead; under LoRA the gradients are small and the "
        "schedules' bubbles decide.",
        "- **The step's tail.** With the sync optimizer a step ends with the last stage's gradient download "
        "and optimizer step, and Hanayo's stages are half as large. " + tail_text(result),
        "",
        "## Where the abstractions rank differently",
        "",
        "Fastest first, `=` within 1% (G gpipe, 1 1f1b, C chimera, H hanayo); `-`: outside the closed form's "
        "domain. In the lists, `p vs q: <` means p is faster than q in that abstraction, `=` within 1%; only pairs "
        "whose order is not the same everywhere are listed (`closed_*` only where both forms are defined). The "
        f"unit table's step equals the closed form's at {result['closed_vs_table']['equal']} of the "
        f"{result['closed_vs_table']['defined']} points where the form is defined (`tests/test_sim.py` checks the "
        "same on its grid).",
        "",
    ]
    for s in result["settings"]:
        lines += [f"### {s['label']}", "", *ranking_table(s, result["microbatches"]), ""]
        lines += [
            f"{len(s['differences'])} pairs of policies change order across the abstractions"
            + (", for example:" if s["differences"] else "."),
            "",
            *differences_text(s, limit=6),
            "",
            f"![{s['label']} throughput](figures/{NAME}-{s['slug']}-throughput.png)",
            "",
            f"![{s['label']} conclusions](figures/{NAME}-{s['slug']}-conclusions.png)",
            "",
        ]
    lines.append(f"_Generated in {result['elapsed_s']:.0f} s; figures: {len(figures)} PNGs._")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one setting, fewer points; results files only")
    args = ap.parse_args(argv)
    if args.quick:
        result = study(QUICK_SETTINGS, QUICK_MICROBATCHES, QUICK_LINKS)
    else:
        result = study()
    result["quick"] = bool(args.quick)  # before the notes, which say so
    header, rows = table_rows(result)
    write_results(NAME, jsonable(rounded(result)), rows, header, notes_text(result))
    if not args.quick:
        figures = draw(result)
        replace_block(DOC, NAME, doc_text(result, figures), DOC_TITLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
