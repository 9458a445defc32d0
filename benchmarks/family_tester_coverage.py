"""The families of docs/models.md built as transformers' own model tests build them, dropout included.

``benchmarks/model_coverage.py`` builds every family from its default config shrunk by
``tiny_config``, with every dropout forced to 0. Here each family is built from the configuration
values of its ``*ModelTester`` in transformers' test suite (``benchmarks/data/family_testers.json``
records them, with the test file and commit each was copied from), *with the dropout the tester
sets*, and two things are checked:

- ``exact``: with every dropout set to 0, 3 AdamW steps of roundpipe (``cpu:2``, 2 microbatches,
  the roundpipe policy, one layer per stage) against plain PyTorch in fp32 and float64, by the
  project's exactness rule (``assert_exact`` in tests/support/reference.py, as model_coverage.py
  applies it);
- ``replay``: with the tester's dropout on, two roundpipe runs on ``cpu:2`` with the same seed are
  bit-identical over 3 steps, and equal a run on ``cpu:1`` (losses to rtol 1e-5, weights to rtol
  1e-4, atol 1e-6): the dropout masks depend on the seed, the step, the layer and the microbatch,
  never on the device a stage ran on or on the order the workers drew them; and the dropout
  changes roundpipe's losses exactly where it changes plain PyTorch's (a pipeline that dropped the
  dropout would replay perfectly and still train differently).

A family is **exact** when both hold; **refused** when roundpipe refused it at wrap time (one of
its own errors from ``roundpipe.wrap``: the first line of the message); **inexact** when a run
trained differently from plain PyTorch; **nondeterministic** when the seeded runs differ;
**failed** on any other exception, a crash or the time limit (an error of roundpipe's own raised
after wrap accepted the model counts here too); **not runnable here** when transformers itself
cannot build the tester's config or plain PyTorch cannot train it. Each family runs in a subprocess
of its own with a time limit.

    python benchmarks/family_tester_coverage.py [--only llama,gpt2] [--timeout 240]

Writes ``benchmarks/results/family_testers.json`` and the section "transformers' tester configs"
of ``docs/models.md`` (``--only`` writes ``family_testers_only.json`` and leaves the docs alone).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests", REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _coverage  # noqa: E402  (what the three coverage walks share)
import model_coverage as coverage  # noqa: E402  (the batch, the exactness rule, the dropout zeroing)

TESTERS = REPO / "benchmarks" / "data" / "family_testers.json"
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "models.md"
SECTION = "## transformers' tester configs"
STEPS = coverage.STEPS
EXACT = dict(coverage.ROUNDPIPE)
REPLAY = dict(EXACT, seed=1234)
OUTCOMES = ("exact", "refused", "inexact", "nondeterministic", "failed", "not runnable here")
BAD = ("inexact", "nondeterministic", "failed")
RESULT_MARK = "TESTER-RESULT "


class NotRunnable(Exception):
    """transformers cannot build the tester's config, or plain PyTorch cannot train it."""


class Refused(Exception):
    """roundpipe refused the model at wrap time."""


# --------------------------------------------------------------------------------------------------
# The tester's config.


def testers() -> dict:
    return json.loads(TESTERS.read_text())


def tester_kwargs(entry: dict, base: dict, config_class) -> dict:
    """The keyword arguments the tester's ``get_config`` passes to ``config_class``."""
    if entry["get_config"] == "explicit":
        return dict(entry["values"])
    # CausalLMModelTester.get_config: every tester attribute named by an __init__ argument of the
    # config class, or by the common name that the config's attribute_map gives that argument.
    attrs = {**base, **entry["values"]}
    attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
    common = {v: k for k, v in getattr(config_class, "attribute_map", {}).items()}
    kwargs = {}
    for name in [*inspect.signature(config_class.__init__).parameters, "pad_token_id"]:
        if name == "self":
            continue
        if name in attrs:
            kwargs[name] = attrs[name]
        elif name in common and common[name] in attrs:
            kwargs[name] = attrs[common[name]]
    return kwargs


def build(entry: dict, base: dict, dropout: bool):
    """The family's causal LM from the tester's config, fp32, seed 0, in training mode; with
    ``dropout=False`` every dropout probability zeroed first."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = transformers.CONFIG_MAPPING[entry["model_type"]]
    try:
        config = config_class(**tester_kwargs(entry, base, config_class))
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        if not dropout:
            coverage._make_deterministic(config)
        torch.manual_seed(0)
        model = model_class(config).to(torch.float32)
    except Exception as exc:
        raise NotRunnable(f"build failed: {type(exc).__name__}: {coverage._one_line(exc)}") from exc
    model.train()
    return model


def _eager_experts(*models) -> bool:
    """Switch the models' experts to HF's eager loop; False where a model has no such switch."""
    try:
        for model in models:
            model.set_experts_implementation("eager")
    except Exception:
        return False
    return True


def dropout_settings(model) -> dict[str, float]:
    """The nonzero dropout probabilities among the config class's own arguments (what the replay
    check exercises; a name the tester passes that the class does not declare is only stored)."""
    declared = inspect.signature(type(model.config).__init__).parameters
    found = {}
    for key, value in vars(model.config).items():
        if key in declared and coverage._RANDOM_FIELDS.search(key) and isinstance(value, float) and value > 0:
            found[key] = value
    return found


# --------------------------------------------------------------------------------------------------
# The two checks (run inside the subprocess).


def train(model, batch: dict, **config):
    """3 AdamW steps of roundpipe on a copy of ``model``; raises Refused when ``roundpipe.wrap``
    raises one of roundpipe's errors."""
    from support.reference import EPS, LR, RunResult, trainable_weights

    import roundpipe

    model = copy.deepcopy(model)
    try:
        pipe = roundpipe.wrap(model, roundpipe.RunConfig(**config))
    except roundpipe.RoundpipeError as exc:
        raise Refused(f"{type(exc).__name__}: {coverage._one_line(exc)}") from exc
    with pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0)
        losses = []
        for _ in range(STEPS):
            out = pipe.forward_backward(
                batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"]
            )
            pipe.step()
            losses.append(out.loss)
        pipe.export_to(model)
    return RunResult(losses, trainable_weights(model))


def check_exact(model, batch: dict) -> tuple[dict, object, object]:
    """Dropout 0: roundpipe against plain fp32 and float64 PyTorch. Also returns the two fp32 runs
    (None where roundpipe did not train)."""
    from support.reference import reference_train

    try:
        got = train(model, batch, **EXACT)
    except Refused as exc:
        return {"kind": "refused", "detail": str(exc)}, None, None
    except Exception as exc:
        return {"kind": "failed", "detail": f"{type(exc).__name__}: {coverage._one_line(exc)}"}, None, None
    plain = reference_train(model, batch, STEPS)
    if not coverage._finite(plain):
        raise NotRunnable("plain PyTorch's losses or weights are not finite")
    if not coverage._finite(got):
        return (
            {
                "kind": "inexact",
                "detail": "roundpipe's losses or weights are not finite (plain PyTorch's are)",
            },
            got,
            plain,
        )
    try:
        exact = reference_train(coverage._float64(model), batch, STEPS)
        why = None if coverage._finite(exact) else "the float64 run is not finite"
    except Exception as exc:
        why = f"the float64 run failed ({coverage._one_line(exc, 80)})"
    if why is not None:
        return coverage.compare_fp32(got, plain, why), got, plain
    return coverage.compare(got, plain, exact), got, plain


def check_replay(model, batch: dict, without=None, plain_without=None) -> dict:
    """Dropout on: two seeded cpu:2 runs bit-identical, and equal to a cpu:1 run. With the runs of
    the same model without dropout (roundpipe's and plain PyTorch's), also: the dropout changes
    roundpipe's losses exactly where it changes plain PyTorch's (a pipeline that ran the layers
    without their dropout would replay perfectly and still train differently)."""
    import torch
    from support.reference import assert_same_run, reference_train

    try:
        first = train(model, batch, **REPLAY)
        second = train(model, batch, **REPLAY)
        single = train(model, batch, **dict(REPLAY, devices="cpu:1"))
    except Refused as exc:
        return {"kind": "refused", "detail": str(exc)}
    except Exception as exc:
        return {"kind": "failed", "detail": f"{type(exc).__name__}: {coverage._one_line(exc)}"}
    differs = _first_difference(first, second, torch.equal)
    if differs:
        return {"kind": "nondeterministic", "detail": f"two seeded cpu:2 runs differ: {differs}"}
    try:
        assert_same_run(single, first)
    except AssertionError as exc:
        return {"kind": "nondeterministic", "detail": f"cpu:1 differs from cpu:2: {coverage._one_line(exc)}"}
    if without is None or plain_without is None:
        return {"kind": "exact", "detail": "", "dropout_effect": None}
    plain = reference_train(model, batch, STEPS)
    theirs, ours = plain.losses != plain_without.losses, first.losses != without.losses
    if theirs != ours:
        how = "changes" if ours else "does not change"
        return {
            "kind": "inexact",
            "detail": f"the dropout {how} roundpipe's losses but {'does not change' if ours else 'changes'} "
            "plain PyTorch's",
        }
    return {"kind": "exact", "detail": "", "dropout_effect": ours}


def _first_difference(a, b, same) -> str:
    """Where two runs first differ: the step whose loss differs, else the first weight."""
    for step, (x, y) in enumerate(zip(a.losses, b.losses), 1):
        if x != y:
            return f"loss of step {step} ({x!r} vs {y!r})"
    for name in a.weights:
        if not same(a.weights[name], b.weights[name]):
            diff = (a.weights[name] - b.weights[name]).abs().max().item()
            return f"{name} (max difference {diff:.3g})"
    return ""


def outcome(exact: dict, replay: dict) -> tuple[str, str]:
    """One family outcome: the worst of the two checks."""
    for kind in ("failed", "inexact", "nondeterministic", "refused"):
        for name, run in (("exact", exact), ("replay", replay)):
            if run["kind"] == kind:
                return kind, f"{name}: {run['detail']}"
    notes = "; ".join(run["detail"] for run in (exact, replay) if run["detail"])
    return "exact", notes


def one_family(model_type: str) -> dict:
    """Everything measured for one family (the ``--one`` subprocess)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    from support.reference import reference_train

    data = testers()
    entry = next(e for e in data["families"] if e["model_type"] == model_type)
    row = {
        "model_type": model_type,
        "tester": f"{entry['file']}::{entry['tester']}",
        "commit": entry["commit"],
    }
    try:
        deterministic = build(entry, data["causal_lm_tester"]["values"], dropout=False)
        random_model = build(entry, data["causal_lm_tester"]["values"], dropout=True)
        row["class"] = type(deterministic).__name__
        row["params"] = sum(p.numel() for p in deterministic.parameters())
        row["layers"] = getattr(deterministic.config, "num_hidden_layers", None)
        row["dropout"] = dropout_settings(random_model)
        batch = coverage.make_batch(deterministic)
        try:
            reference_train(deterministic, batch, 1)
        except Exception as exc:
            # The fused expert kernel (grouped_mm) wants 16-byte strides, which testers' odd sizes
            # (intermediate_size=37) break; HF's eager expert loop computes the same sums.
            if not _eager_experts(deterministic, random_model):
                raise NotRunnable(
                    f"plain PyTorch training failed: {type(exc).__name__}: {coverage._one_line(exc)}"
                ) from exc
            row["experts"] = f"eager (the fused kernel failed: {coverage._one_line(exc, 80)})"
            try:
                reference_train(deterministic, batch, 1)
            except Exception as again:
                raise NotRunnable(
                    f"plain PyTorch training failed: {type(again).__name__}: {coverage._one_line(again)}"
                ) from again
        row["exact"], without, plain_without = check_exact(deterministic, batch)
        row["replay"] = check_replay(random_model, batch, without, plain_without)
    except NotRunnable as exc:
        return {**row, "outcome": "not runnable here", "detail": str(exc)}
    row["outcome"], row["detail"] = outcome(row["exact"], row["replay"])
    return row


# --------------------------------------------------------------------------------------------------
# The walk (the parent process).


def run_isolated(model_type: str, timeout: float) -> dict:
    """``--one model_type`` in a fresh interpreter of its own session (a timeout kills it all)."""
    return _coverage.run_one(
        Path(__file__).resolve(), "--one", model_type, RESULT_MARK, timeout, "model_type"
    )


def walk(names: list[str], timeout: float) -> list[dict]:
    rows = []
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        row = run_isolated(name, timeout)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        _coverage.progress(i, len(names), name, row, 18, limit=160)
    return rows


def counts(rows: list[dict]) -> dict[str, int]:
    return _coverage.counts(rows, OUTCOMES)


def write_json(path: Path, rows: list[dict], command: str, timeout: float) -> None:
    payload = {
        "command": command,
        "versions": _coverage.versions("transformers", "torch", "peft"),
        "settings": {
            "steps": STEPS,
            "batch": f"{coverage.BATCH} x {coverage.SEQ} tokens, first sequence left-padded by {coverage.LEFT_PAD}",
            "exact": EXACT,
            "replay": REPLAY,
            "timeout_s": timeout,
        },
        "counts": counts(rows),
        "families": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def section(rows: list[dict], command: str) -> str:
    """The docs section: one row per family, the counts, and how it is measured."""
    lines = [
        SECTION,
        "",
        f"{len(rows)} families of the table above built as transformers' own model tests build them "
        "(the `*ModelTester` configuration values, copied into `benchmarks/data/family_testers.json` with "
        "the test file and commit of each), **with the dropout the tester sets**. Generated by "
        "`benchmarks/family_tester_coverage.py`; do not edit by hand.",
        "",
        "| model_type | tester | layers | dropout on | outcome | detail |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        dropout = ", ".join(f"{k}={v:g}" for k, v in r.get("dropout", {}).items()) or "none"
        cells = [
            r["model_type"],
            r.get("tester", "?"),
            r.get("layers", "-"),
            dropout,
            r["outcome"],
            r.get("detail", ""),
        ]
        lines.append("| " + " | ".join(_coverage.cell(c) for c in cells) + " |")
    lines += ["", "| outcome | families |", "|---|---|"]
    lines += [f"| {kind} | {n} |" for kind, n in counts(rows).items()]
    lines += ["", HOW.strip(), "", "```", command, "```", ""]
    return "\n".join(lines)


def write_docs(path: Path, rows: list[dict], command: str) -> None:
    """Replace (or append) the section in ``path``; model_coverage.py keeps it when it rewrites the page."""
    text = path.read_text() if path.exists() else ""
    head = text.split(SECTION, 1)[0].rstrip("\n")
    path.write_text((head + "\n\n" if head else "") + section(rows, command))


HOW = f"""
Two checks per family, {STEPS} AdamW steps each (lr 1e-3, eps 1e-4, no weight decay) on the batch of
the table above ({coverage.BATCH} x {coverage.SEQ} tokens, left padding), all parameters trainable:
**exact**, with every dropout probability set to 0: roundpipe (`RunConfig(devices="cpu:2",
num_microbatches=2, policy="roundpipe", partition=None)`) against plain PyTorch in fp32 and float64
by the rule of the table above; **replay**, with the tester's dropout on: two roundpipe runs with
`seed={REPLAY["seed"]}` bit-identical, and equal to the same run on `cpu:1` (losses to rtol 1e-5, weights to
rtol 1e-4, atol 1e-6). Outcomes: **exact** (both hold); **refused** (roundpipe refused the model at
wrap time: first line of its message); **inexact** (trained differently from plain PyTorch);
**nondeterministic** (the seeded runs differ: where first); **failed** (any other exception, one of
roundpipe's own errors raised after wrap accepted the model, a crash or the time limit); **not
runnable here** (transformers cannot build the tester's config, or plain PyTorch cannot train it).
"dropout on" lists the config's nonzero dropout probabilities: where a tester passes names its
config class does not read (e.g. `hidden_dropout_prob` to a Llama config), the family's own
defaults are what runs. `tests/test_family_testers.py` (marker `slow`) fails on any inexact,
nondeterministic or failed family.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (default: every family of the tester file)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per family (default 240)")
    ap.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/family_testers.json)")
    ap.add_argument(
        "--docs", type=Path, help=f"markdown page (default {DOCS.relative_to(REPO)}; not with --only)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(RESULT_MARK + json.dumps(one_family(args.one), default=str), flush=True)
        return
    known = [e["model_type"] for e in testers()["families"]]
    names = known
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"no tester config recorded for: {', '.join(unknown)}")
    command = "python benchmarks/family_tester_coverage.py" + "".join(f" {a}" for a in sys.argv[1:])
    rows = walk(names, args.timeout)
    _coverage.finish(
        rows, command, only=bool(args.only), update=False, out=args.out, docs=args.docs,
        results=RESULTS, stem="family_testers", key="model_type", list_key="families", default_docs=DOCS,
        write_json=lambda path, rows, command: write_json(path, rows, command, args.timeout),
        write_docs=write_docs, outcomes=OUTCOMES,
    )  # fmt: skip


if __name__ == "__main__":
    main()
