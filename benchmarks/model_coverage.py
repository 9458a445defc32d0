"""Which causal-LM families of the installed transformers roundpipe trains exactly.

Every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny from its default
config (``roundpipe.models.tiny.tiny_config``, fp32, seed 0) and trained 3 AdamW steps twice, all
parameters (``full``) and all-linear LoRA (``lora``), with roundpipe (``cpu:2``, 2 microbatches,
the roundpipe policy, one layer per stage) and with plain PyTorch in fp32 and in float64. The
family is ``exact`` when both runs meet the project's exactness rule (tests/support/reference.py:
``assert_exact``): every loss equals plain fp32 to rtol 1e-5, and every weight is no further from
the float64 run than twice as far as plain fp32 is, or within 1e-4 of it elementwise (where the float64 run is not finite, the
suite's other rule: weights equal plain fp32 to rtol 1e-4, atol 1e-6). Each family runs in a
subprocess of its own with a time limit, so a crash, an out-of-memory kill or a hang in one cannot
stop the walk.

    python benchmarks/model_coverage.py [--only llama,gpt2 [--update]] [--timeout 120] [--out PATH] [--docs PATH]

Writes ``benchmarks/results/model_coverage.json`` and ``docs/models.md``; ``--only`` writes
``benchmarks/results/model_coverage_only.json`` and leaves the docs alone unless ``--docs`` is given;
``--only ... --update`` replaces those families' rows in the full walk's JSON and docs.

MoE families whose forward adds a router load-balancing loss (HF's ``load_balancing_loss_func``) get
a third run, in full with ``output_router_logits=True`` (``row["router"]``, a section of the docs).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "models.md"
# tests/support/reference.py holds the plain-PyTorch baselines and the pipeline loop the test suite uses.
for _path in (REPO, REPO / "tests", REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import _coverage  # noqa: E402  (what the three coverage walks share)

STEPS = 3
BATCH, SEQ, LEFT_PAD = 2, 16, 3
MAX_PARAMS = 5_000_000
ROUNDPIPE = dict(devices="cpu:2", num_microbatches=2, policy="roundpipe", partition=None, dtype="fp32")
# MoE families whose forward adds a router load-balancing loss: a third run with it on. The loss
# needs every forward before the first backward, so the policy is left to the automatic choice (gpipe).
ROUTER = dict(devices="cpu:2", num_microbatches=2, dtype="fp32")
ROUTER_COEF = 0.5  # HF's defaults (0.001-0.01) are too small for a wrong auxiliary gradient to show
# init_lora_weights=False (random B, as tests/test_generic_families.py): with peft's default B = 0
# every lora_B starts at zero and Adam's first steps move it by about lr whatever its gradient's
# round-off, so plain fp32 sometimes lands unusually close to float64 and the 2x rule fails by
# chance (measured with B = 0: llama and qwen3 failed on one of three seeds, mistral on all three;
# mistral with random B passed all three).
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
OUTCOMES = ("exact", "partial", "refused", "inexact", "failed", "not runnable here")
RESULT_MARK = "COVERAGE-RESULT "
# Every source of training randomness, zeroed so that the runs compared are deterministic: the
# pipeline replays dropout masks from its own seeds, so they could never match plain PyTorch's.
_RANDOM_FIELDS = re.compile(r"(dropout|_pdrop|dropout_prob|dropout_p|dropout_rate|layerdrop|jitter_noise)$")


class NotRunnable(Exception):
    """The tiny model cannot be built or trained at all here, roundpipe aside."""


# --------------------------------------------------------------------------------------------------
# One family (run inside the subprocess).


def families() -> list[tuple[str, str]]:
    """(model_type, class name) of every causal-LM family of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def build_tiny(model_type: str, router_loss: bool = False):
    """The family's tiny model: fp32, seed 0, deterministic (``router_loss``: with
    ``output_router_logits=True`` and coefficient ``ROUTER_COEF``). Raises NotRunnable with the reason."""
    import torch
    import transformers

    from roundpipe.models.tiny import tiny_config

    try:
        config = transformers.CONFIG_MAPPING[model_type]()
    except Exception as exc:
        raise NotRunnable(f"build failed: the default config does not validate: {_one_line(exc)}") from exc
    try:
        model_class, tiny = _causal_lm_config(tiny_config(config))
        _make_deterministic(tiny)
        if router_loss:
            tiny.output_router_logits, tiny.router_aux_loss_coef = True, ROUTER_COEF
        with torch.device("meta"):
            count = sum(p.numel() for p in model_class._from_config(tiny).parameters())
        if count > MAX_PARAMS:
            raise NotRunnable(f"build failed: the tiny model still has {count / 1e6:.1f}M parameters")
        torch.manual_seed(0)
        model = model_class._from_config(tiny).to(torch.float32)
    except NotRunnable:
        raise
    except Exception as exc:
        raise NotRunnable(_build_failure(exc, config)) from exc
    languages = getattr(tiny, "languages", None)
    if hasattr(model, "set_default_language") and languages:  # xmod: adapters are per language
        model.set_default_language(languages[0])
    return model


def _causal_lm_config(config):
    """The family's causal-LM class and the config it is built from: ``config`` itself, or the
    nested config of the class's config class (llama4's text_config, musicgen's decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        config = next((v for v in vars(config).values() if isinstance(v, wanted)), config)
    if hasattr(config, "is_decoder"):
        # BERT-like families default to an encoder; their *ForCausalLM wants is_decoder=True
        # (reformer asserts it, the others warn and would attend both ways).
        config.is_decoder = True
    return model_class, config


def _make_deterministic(config) -> None:
    """Zero every dropout / router-jitter probability in the config tree."""
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _make_deterministic(value)
        elif _RANDOM_FIELDS.search(key) and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)


def _build_failure(exc: Exception, config) -> str:
    """Why the tiny model could not be built: a missing package, or the family's own default config
    failing at full size too (a transformers bug, not tiny_config's), or the error itself."""
    text = _one_line(exc)
    package = re.search(r"requires the (\S+) library", str(exc))
    if package:
        return f"needs the `{package.group(1)}` package"
    import torch

    try:
        model_class, full_size = _causal_lm_config(copy.deepcopy(config))
        with torch.device("meta"):
            model_class._from_config(full_size)
    except Exception as full:
        if type(full) is type(exc):
            return f"build failed: {text} (the full-size default config fails alike)"
    return f"build failed: {text}"


def make_batch(model) -> dict:
    """2 x 16 tokens, ids in 1..vocab-1; the first sequence left-padded by 3 (mask 0, label -100
    there), and two more -100 labels in the second."""
    import torch

    vocab = min(_vocab(model), 512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (BATCH, SEQ), generator=g)
    pad = getattr(model.config, "pad_token_id", None)
    ids[0, :LEFT_PAD] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    mask = torch.ones_like(ids)
    mask[0, :LEFT_PAD] = 0
    labels = ids.clone()
    labels[0, :LEFT_PAD] = -100
    labels[1, [4, 9]] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _vocab(model) -> int:
    """The smallest of the input and output vocabularies (musicgen has one head per codebook)."""
    sizes = []
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        first = (
            module[0]
            if isinstance(module, (list, tuple)) or type(module).__name__ == "ModuleList"
            else module
        )
        weight = getattr(first, "weight", None)
        if weight is not None:
            sizes.append(weight.shape[0])
    return min(sizes, default=512)


def layout(model) -> str:
    """``skeleton`` for the llama-like ``model.{embed_tokens, layers, norm}`` + ``lm_head``;
    otherwise where the blocks, the token embedding and the final norm are (``transformer.h/wte/ln_f``)."""
    from torch import nn

    base = getattr(model, "model", None)
    if (
        base is not None
        and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm"))
        and isinstance(base.layers, nn.ModuleList)
        and hasattr(model, "lm_head")
    ):
        return "skeleton"
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "no block list"
    blocks, _ = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    prefix = blocks.rsplit(".", 1)[0] + "." if "." in blocks else ""
    embed = model.get_input_embeddings()
    embed_name = next((n for n, m in model.named_modules() if m is embed), "?")
    norms = [
        n for n, m in model.named_modules() if "norm" in type(m).__name__.lower() and not n.startswith(blocks)
    ]
    norm = norms[-1] if norms else "-"
    return f"{blocks}/{_relative(embed_name, prefix)}/{_relative(norm, prefix)}"


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def run_mode(model, batch: dict, mode: str, config: dict = ROUNDPIPE) -> dict:
    """Train ``mode`` (``full`` or ``lora``) with roundpipe (``config``) and plain PyTorch; one result
    dict with ``kind`` exact / inexact / refused / failed / unavailable and a ``detail``."""
    import torch
    from support.reference import pipeline_train, reference_train

    import roundpipe

    if mode == "lora":
        try:
            import peft

            torch.manual_seed(0)
            model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**LORA))
        except Exception as exc:
            return {"kind": "unavailable", "detail": f"peft refused the model: {_one_line(exc)}"}
    try:
        got = pipeline_train(model, batch, STEPS, **config)
    except roundpipe.RoundpipeError as exc:
        return {"kind": "refused", "detail": f"{type(exc).__name__}: {_one_line(exc)}"}
    except Exception as exc:
        return {"kind": "failed", "detail": f"{type(exc).__name__}: {_one_line(exc)}"}
    try:
        plain = reference_train(model, batch, STEPS)
    except Exception as exc:
        return {"kind": "unavailable", "detail": f"plain PyTorch failed: {_one_line(exc)}"}
    if not _finite(plain):
        return {"kind": "unavailable", "detail": "plain PyTorch's losses or weights are not finite"}
    if not _finite(got):
        return {
            "kind": "inexact",
            "detail": "roundpipe's losses or weights are not finite (plain PyTorch's are)",
        }
    try:
        exact = reference_train(_float64(model), batch, STEPS)
        why = None if _finite(exact) else "the float64 run is not finite"
    except Exception as exc:
        why = f"the float64 run failed ({_one_line(exc, 80)})"
    if why is not None:
        return compare_fp32(got, plain, why)
    return compare(got, plain, exact)


def _finite(run) -> bool:
    import math

    return all(math.isfinite(x) for x in run.losses) and all(w.isfinite().all() for w in run.weights.values())


def _float64(model):
    """A float64 copy of ``model``. Fused expert kernels (grouped_mm) have no float64 version, so
    the copy runs its experts in HF's eager loop: the same sums, one expert at a time."""
    double = copy.deepcopy(model).double()
    base = double.get_base_model() if hasattr(double, "get_base_model") else double
    with contextlib.suppress(Exception):  # a family without experts, or with only the eager loop
        base.set_experts_implementation("eager")
    return double


def compare(got, plain, exact) -> dict:
    """The exactness rule of tests/support/reference.py (``assert_exact``), reporting the worst case instead
    of stopping at the first."""
    loss_rel = max((abs(g - p) / max(abs(p), 1e-30) for g, p in zip(got.losses, plain.losses)), default=0.0)
    if got.weights.keys() != exact.weights.keys():
        return {"kind": "inexact", "detail": "the trained parameters differ from plain PyTorch's"}
    from support.reference import EXACT_ATOL

    worst, worst_name = 0.0, ""
    for name, want in exact.weights.items():
        if (got.weights[name].double() - plain.weights[name].double()).abs().max().item() <= EXACT_ATOL:
            continue  # within the rule's elementwise allowance of plain fp32
        ours = (got.weights[name].double() - want).norm().item()
        theirs = (plain.weights[name].double() - want).norm().item()
        allowed = 2 * theirs + 1e-12 * want.norm().item()
        ratio = ours / allowed if allowed > 0 else (0.0 if ours == 0 else float("inf"))
        if ratio > worst:
            worst, worst_name = ratio, name
    stats = {"loss_rel": loss_rel, "weight_ratio": worst, "worst_weight": worst_name}
    if loss_rel <= 1e-5 and worst <= 1.0:
        return {"kind": "exact", "detail": "", **stats}
    if loss_rel > 1e-5:
        detail = f"loss off plain fp32 by {loss_rel:.2g} (rtol 1e-5)"
    else:
        detail = f"{worst_name} {worst:.3g}x the allowed distance from float64"
    return {"kind": "inexact", "detail": detail, **stats}


def compare_fp32(got, plain, why: str) -> dict:
    """Where the float64 run cannot serve (several families' float64 attention turns the fully
    masked rows of left padding into NaN), the test suite's other rule: losses equal plain fp32 to
    rtol 1e-5 and weights to rtol 1e-4, atol 1e-6 (``assert_same_run``)."""
    from support.reference import WEIGHT_ATOL

    note = f"checked against plain fp32 only: {why}"
    loss_rel = max((abs(g - p) / max(abs(p), 1e-30) for g, p in zip(got.losses, plain.losses)), default=0.0)
    if got.weights.keys() != plain.weights.keys():
        return {"kind": "inexact", "detail": f"the trained parameters differ from plain PyTorch's; {note}"}
    excess, worst_name = 0.0, ""
    for name, want in plain.weights.items():
        over = ((got.weights[name] - want).abs() - (WEIGHT_ATOL + 1e-4 * want.abs())).max().item()
        if over > excess:
            excess, worst_name = over, name
    stats = {"loss_rel": loss_rel, "weight_excess": excess, "worst_weight": worst_name}
    if loss_rel <= 1e-5 and excess <= 0:
        return {"kind": "exact", "detail": note, **stats}
    if loss_rel > 1e-5:
        detail = f"loss off plain fp32 by {loss_rel:.2g} (rtol 1e-5); {note}"
    else:
        detail = f"{worst_name} off plain fp32 by {excess:.2g} beyond rtol 1e-4 + atol 1e-6; {note}"
    return {"kind": "inexact", "detail": detail, **stats}


def outcome(full: dict, lora: dict) -> tuple[str, str]:
    """One family outcome from its two runs."""
    kinds = (full["kind"], lora["kind"])
    if kinds == ("exact", "exact"):
        return "exact", "; ".join(dict.fromkeys(run["detail"] for run in (full, lora) if run["detail"]))
    if "exact" in kinds:
        other, name = (lora, "lora") if full["kind"] == "exact" else (full, "full")
        return "partial", f"{name} {other['kind']}: {other['detail']}"
    if full["kind"] == "unavailable":  # the plain references themselves cannot run here
        return "not runnable here", f"full: {full['detail']}"
    for kind in ("refused", "failed", "inexact"):
        for name, run in (("full", full), ("lora", lora)):
            if run["kind"] == kind:
                return kind, run["detail"] if kind == "refused" else f"{name}: {run['detail']}"
    return "failed", f"full: {full['detail']}; lora: {lora['detail']}"


def one_family(model_type: str) -> dict:
    """Everything measured for one family (the ``--one`` subprocess)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    from support.reference import reference_train

    row = {"model_type": model_type, "class": dict(families()).get(model_type, "?")}
    try:
        model = build_tiny(model_type)
        row["params"] = sum(p.numel() for p in model.parameters())
        row["layout"] = layout(model)
        batch = make_batch(model)
        try:
            reference_train(model, batch, 1)
        except Exception as exc:
            raise NotRunnable(
                f"plain PyTorch training failed: {type(exc).__name__}: {_one_line(exc)}"
            ) from exc
    except NotRunnable as exc:
        return {**row, "outcome": "not runnable here", "detail": str(exc)}
    row["full"] = run_mode(model, batch, "full")
    row["lora"] = run_mode(model, batch, "lora")
    row["outcome"], row["detail"] = outcome(row["full"], row["lora"])
    if adds_router_loss(model):
        try:
            row["router"] = run_mode(build_tiny(model_type, router_loss=True), batch, "full", ROUTER)
        except NotRunnable as exc:
            row["router"] = {"kind": "unavailable", "detail": str(exc)}
    return row


def adds_router_loss(model) -> bool:
    """The family's forward adds a router load-balancing loss when ``output_router_logits`` is on."""
    module = sys.modules.get(type(model).__module__)
    return hasattr(model.config, "output_router_logits") and hasattr(module, "load_balancing_loss_func")


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of the message (with the next one when it only introduces it, as HF's
    validation errors do), trimmed to ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------
# The walk (the parent process).


def run_isolated(model_type: str, timeout: float) -> dict:
    """Run ``--one model_type`` in a fresh interpreter (its own session, so a timeout kills it and
    everything it started) and read back its result line."""
    return _coverage.run_one(
        Path(__file__).resolve(), "--one", model_type, RESULT_MARK, timeout, "model_type"
    )


def walk(names: list[str], timeout: float) -> list[dict]:
    classes = dict(families())
    rows = []
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        row = run_isolated(name, timeout)
        row.setdefault("class", classes.get(name, "?"))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        _coverage.progress(i, len(names), name, row, 28)
    return rows


def counts(rows: list[dict]) -> dict[str, int]:
    return _coverage.counts(rows, OUTCOMES)


def write_json(path: Path, rows: list[dict], command: str, timeout: float) -> None:
    payload = {
        "command": command,
        "versions": _coverage.versions("transformers", "torch", "peft"),
        "settings": {
            "steps": STEPS,
            "batch": f"{BATCH} x {SEQ} tokens, first sequence left-padded by {LEFT_PAD}",
            "roundpipe": {k: v for k, v in ROUNDPIPE.items()},
            "router_loss": {**ROUTER, "router_aux_loss_coef": ROUTER_COEF},
            "lora": LORA,
            "timeout_s": timeout,
        },
        "counts": counts(rows),
        "families": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def write_docs(path: Path, rows: list[dict], command: str) -> None:
    import transformers

    lines = [
        "# Model coverage",
        "",
        f"Every causal-LM family of transformers {transformers.__version__} "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(rows)} entries), trained tiny with roundpipe and "
        "compared with plain PyTorch. Generated by `benchmarks/model_coverage.py`; do not edit by hand.",
        "",
        "| model_type | class | layout | outcome | detail |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["model_type"],
            r.get("class", "?"),
            r.get("layout", "-"),
            r["outcome"],
            r.get("detail", ""),
        ]
        lines.append("| " + " | ".join(_coverage.cell(c) for c in cells) + " |")
    lines += ["", "## Counts", "", "| outcome | families |", "|---|---|"]
    lines += [f"| {kind} | {n} |" for kind, n in counts(rows).items()]
    routed = [r for r in rows if "router" in r]
    if routed:
        exact = sum(r["router"]["kind"] == "exact" for r in routed)
        lines += [
            "",
            "## Router load-balancing loss",
            "",
            f"The {len(routed)} families whose forward adds HF's `load_balancing_loss_func` when "
            f"`output_router_logits=True`, trained in full once more with it on (coefficient "
            f'{ROUTER_COEF}; `RunConfig(devices="cpu:2", num_microbatches=2)`, the automatic choice, '
            f"which keeps to policies that run every forward first): {exact} exact.",
            "",
            "| model_type | outcome | detail |",
            "|---|---|---|",
        ]
        lines += [
            "| "
            + " | ".join(
                _coverage.cell(c) for c in (r["model_type"], r["router"]["kind"], r["router"]["detail"])
            )
            + " |"
            for r in routed
        ]
    lines += ["", "## What wrap time proves", "", PROOFS.strip()]
    title, _, text = RANDOM_DRAWS.strip().partition("\n\n")
    lines += ["", f"## {title}", "", text]
    lines += ["", "## How it is measured", "", HOW.strip(), "", "```", command, "```", ""]
    lines += _kept_sections(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# Sections other generators write on the same page, kept as they are when this walk rewrites it:
# benchmarks/peft_coverage.py's "peft methods" (between its markers), then
# benchmarks/family_tester_coverage.py's section, from its title to the end of the page.
TESTER_SECTION = "## transformers' tester configs"


def _kept_sections(path: Path) -> list[str]:
    """The other generators' sections of ``path`` (see above), each followed by a blank line."""
    from peft_coverage import DOCS_BEGIN, DOCS_END

    text = path.read_text() if path.exists() else ""
    kept = []
    if DOCS_BEGIN in text and DOCS_END in text:
        kept += [DOCS_BEGIN + text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0] + DOCS_END, ""]
    if TESTER_SECTION in text:
        tester = text[text.index(TESTER_SECTION) :].split(DOCS_BEGIN, 1)[0]
        kept += [tester.rstrip("\n"), ""]
    return kept


PROOFS = """
Every `roundpipe.wrap` (and `roundpipe train`) proves the layers on a probe of 2 sequences of 8
tokens, one left-padded, some labels -100, before it plans anything, and refuses with
`UnsupportedModel` a model they do not reproduce:

- **forward** (`roundpipe/models/verify.py`): the unwrapped model's own forward in eval mode; each
  layer run on what the model handed it must give what the model's layer gave, and the loss the
  model's loss. The first layer that differs is named.
- **training** (`roundpipe/models/training_proof.py`): one training step, in train mode with every
  dropout probability 0, of the model as you call it (`PeftModel(...)(input_ids=...,
  attention_mask=..., labels=...)`, or the HF model's forward) against the layers chained as the
  pipeline chains them. The loss must be the same (else the model adds a term outside the layers,
  as AdaLoRA's orthogonal regularizer does), then, from the loss back, the gradient of every
  trainable parameter and of the hidden state each layer hands on (else something outside the
  layers changes the backward: a custom autograd function, a backward hook, arguments computed per
  batch such as aLoRA's activation offsets; the first layer or parameter that differs is named).
  Then, with your dropout, the layers run twice from one seed must agree: a layer drawing from a
  generator the pipeline does not replay (a `torch.Generator` of its own, Python's `random`) is
  named. It costs four forward and backward passes of the probe.

peft methods known to train outside the layers are refused by name: prompt tuning, prefix tuning,
p-tuning and CPT (virtual tokens), AdaLoRA (its orthogonal regularizer and `update_and_allocate`)
and activated LoRA (`LoraConfig(alora_invocation_tokens=...)`).

A model over 1B parameters, on the meta device, or wrapped with `RunConfig(verify_model=False)` is
proved on a tiny model of its config class (`roundpipe.models.tiny.tiny_config`, seed 0) with the
same peft config. That proves the code: the model class, its forward and loss, the peft method and
its settings. It does not prove what belongs to your instance: hooks registered on it, modules
replaced in it, `requires_grad` set by hand, its weights (a difference that shows only at some
values, such as a tie in an MoE router's top-k), nor what only the full sizes exercise.
"""

RANDOM_DRAWS = """
Random draws in training

The runs above set dropout to 0. With it on, every random draw a layer makes in training is
replayed exactly in the backward's recomputation: dropout modules and probabilities (`lora_dropout`,
attention, residual and embedding dropout such as GPT-2's `embd_pdrop`), a MoE router's jitter,
peft LoHa's `module_dropout` and LoHa/LoKr's `rank_dropout` (drawn with `torch.rand` on the
host). Each training-mode layer runs seeded by (`RunConfig.seed`, step, layer, microbatch,
data-parallel rank), on the device's and the CPU's generator, so two runs with one seed agree bit
for bit and the draws do not depend on the device count (tests/test_random_draws.py). peft's
MonteCLoRA (`LoraConfig(monteclora_config=...)`) keeps its randomness in a sample buffer that
every forward advances, which no seed replays: it is refused at wrap time.
"""

HOW = f"""
Each family's default config (`transformers.CONFIG_MAPPING[model_type]()`) is shrunk by
`roundpipe.models.tiny.tiny_config` (hidden 64, 2 layers keeping one of each kind of layer, 4 heads,
2 kv heads, 4 experts, vocabulary 512), dropout and router jitter are set to 0, and the model is
built in fp32 after `torch.manual_seed(0)`. The batch is {BATCH} sequences of {SEQ} tokens, the first
left-padded by {LEFT_PAD} (attention mask 0, labels -100 there), with two more -100 labels.

Two runs per family, {STEPS} AdamW steps each (lr 1e-3, eps 1e-4, no weight decay): `full` (every
parameter trainable) and `lora` (peft `LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
init_lora_weights=False)`: with B = 0 the 2x rule below fails by chance on lora_B, whose first Adam
steps move it by about lr whatever the round-off).
roundpipe runs with `RunConfig(devices="cpu:2", num_microbatches=2, policy="roundpipe",
partition=None)`; plain PyTorch runs the same steps in fp32 and in float64. A run is exact when every
loss equals plain fp32 to rtol 1e-5 and every weight is no further from the float64 run than twice
as far as plain fp32 is, or within 1e-4 of plain fp32 elementwise (`assert_exact` in
tests/support/reference.py). Where the float64 run is not
finite (in several families float64 attention turns the fully masked rows of left padding into
NaN) or fails, the run is checked against plain fp32 only, by the suite's other rule (weights to
rtol 1e-4, atol 1e-6: `assert_same_run`), and the detail says so.

Outcomes: **exact** (both runs exact); **partial** (one exact, the detail says which other failed
and why); **refused** (roundpipe raised one of its own errors, e.g. `UnsupportedModel`: first line
of the message); **inexact** (the worst loss or weight); **failed** (any other exception, a crash
or the time limit); **not runnable here** (the tiny model cannot be built or trained by plain
PyTorch on this machine: a missing package, or a default config that transformers itself cannot
build). Layout `skeleton` means `model.model.{{embed_tokens, layers, norm}}` plus `lm_head`; otherwise
it names the block list, the token embedding and the final norm. Each family runs in a subprocess
of its own with a time limit.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (default: every causal-LM family)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per family (default 120)")
    ap.add_argument(
        "--out",
        type=Path,
        help="JSON results (default benchmarks/results/model_coverage.json; with --only "
        "model_coverage_only.json, so that a subset never overwrites the full walk the docs show)",
    )
    ap.add_argument(
        "--docs", type=Path, help=f"markdown page (default {DOCS.relative_to(REPO)}; not with --only)"
    )
    ap.add_argument(
        "--update",
        action="store_true",
        help="with --only: measure those families again and replace their rows in the full walk's "
        "JSON and docs (the rest keep what the last full walk measured)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess of one family
    args = ap.parse_args()
    if args.update and not args.only:
        ap.error("--update re-measures the families given with --only")
    if args.one:
        print(RESULT_MARK + json.dumps(one_family(args.one), default=str), flush=True)
        return
    known = [name for name, _ in families()]
    names = known
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"not causal-LM model types of this transformers: {', '.join(unknown)}")
    command = "python benchmarks/model_coverage.py" + "".join(f" {a}" for a in sys.argv[1:])
    rows = walk(names, args.timeout)
    _coverage.finish(
        rows, command, only=bool(args.only), update=args.update, out=args.out, docs=args.docs,
        results=RESULTS, stem="model_coverage", key="model_type", list_key="families", default_docs=DOCS,
        write_json=lambda path, rows, command: write_json(path, rows, command, args.timeout),
        write_docs=write_docs, outcomes=OUTCOMES,
    )  # fmt: skip


if __name__ == "__main__":
    main()
