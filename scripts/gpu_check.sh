#!/usr/bin/env bash
# GPU check: run on a machine with a CUDA GPU, using that machine's own torch (nothing installed).
#   PYTHONPATH=. bash scripts/gpu_check.sh            # on the GPU machine (python3 there)
#   bash scripts/gpu_check.sh --dry-run               # here: the same steps on cpu virtual devices
#
# Steps (each under its own timeout; a failure does not stop the later ones):
#   versions     python, torch (CUDA, cuDNN), transformers, peft, accelerate, GPU, memory, driver, git
#   equivalence  every executable policy x {cuda:0x2, cuda:0} vs plain PyTorch (tests/test_cuda.py)
#   memory       roundpipe policy, 386 MiB bf16 layers: measured peak vs the plan, every figure printed
#   smoke        bf16 LoRA training, QLoRA (nf4, int8, fp8) against plain PyTorch, and the ledger-vs-torch.cuda test
#   clock        CUDA's clock (a closure runs when issued, the GPU behind): a slow-GPU LoRA run (a
#                torch.cuda._sleep before every compute) with the embedding alone in a backward
#                stage vs plain PyTorch; a warm step with an attention mask under
#                torch.cuda.set_sync_debug_mode("error"); the pinned pool over 20 variable-length steps
#   throughput   benchmarks/gpu_throughput.py: a 1.5B Qwen3-shaped model, seq 4096, LoRA and full
#                fine-tuning; roundpipe on cuda:0x1 / cuda:0x2 vs plain HF vs FSDP2 CPU offload
#                (keeps to its own budget, about 200 s; also writes benchmarks/results/gpu_throughput.*)
#   lanes        benchmarks/virtual_server.py --lanes cuda:0: each lane's busy seconds of a small run on
#                the GPU beside the virtual server's prediction for that GPU (docs/virtual.md)
#   train        `roundpipe train recipes/demo.yaml` for 20 steps on cuda:0x2 (SKIP without `datasets`)
#   sanitizer    the roundpipe policy's equivalence tests under TORCH_CUDA_SANITIZER=1, with two
#                controls: the sanitizer sees roundpipe's worker threads, and flags a step whose
#                compute streams' waits were removed (last; SKIP with under 45 s left)
# Ends with one PASS / SKIP / FAIL line per step, then ONE JSON object, the last line of the output:
# every step's status and figures, the throughput results and the versions (also written to
# gpu_check.json beside the logs). Exits non-zero if any step failed. The whole run stays within
# GPU_CHECK_BUDGET_S (default 540 s, 9 of a lent GPU's 15 minutes, which also pay for its start,
# about 45 s the first time, and leave enough to start a machine again): the steps' own timeouts add
# up to 530 s, and each is cut to what is left of the budget.
#
# --dry-run maps cuda:0x2 -> cpu:2 and cuda:0 -> cpu:1 (ROUNDPIPE_GPU_CHECK_DRY_RUN=1, read by
# tests/test_cuda.py), shrinks the memory test's and the throughput benchmark's models, never sets
# TORCH_CUDA_SANITIZER, and uses .venv/bin/python when there is one (PY=... overrides either way).
# Its timeouts and default budget are GPU_CHECK_DRY_SCALE (default 4) times the GPU ones: a small
# shared CPU runs these steps several times slower than the GPU machine does.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    -h | --help)
        sed -n '2,34p' "$0"
        exit 0
        ;;
    *)
        echo "usage: $0 [--dry-run]" >&2
        exit 2
        ;;
esac

if [[ -z "${PY:-}" ]]; then
    if ((DRY)) && [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TORCH_CUDA_SANITIZER
if ((DRY)); then
    export ROUNDPIPE_GPU_CHECK_DRY_RUN=1
    D2=cpu:2
    D1=cpu:1
else
    unset ROUNDPIPE_GPU_CHECK_DRY_RUN
    D2=cuda:0x2
    D1=cuda:0
fi

SCALE=1
((DRY)) && SCALE=${GPU_CHECK_DRY_SCALE:-4}
BUDGET=${GPU_CHECK_BUDGET_S:-$((540 * SCALE))}
# Full logs go to GPU_CHECK_LOG_DIR, else to $OUT when the device runner provides one (only the
# tail of the output comes back from there), else to a temporary folder removed at the end.
KEEP=${GPU_CHECK_LOG_DIR:-${OUT:-}}
if [[ -n "$KEEP" ]]; then
    LOGDIR=$KEEP/gpu_check_logs
    mkdir -p "$LOGDIR"
    exec > >(tee "$KEEP/gpu_check.log") 2>&1
    TEE_PID=$!
else
    LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
    trap 'rm -rf "$LOGDIR"' EXIT
fi
: >"$LOGDIR/steps.tsv"
SUMMARY=()
FAILED=0

# note STATUS NAME DETAIL [SECONDS]: a summary line, and a row of steps.tsv for the final JSON.
note() {
    SUMMARY+=("$1  $2: $3")
    printf '%s\t%s\t%s\t%s\n' "$2" "$1" "${4:-}" "$3" >>"$LOGDIR/steps.tsv"
    [[ $1 == FAIL ]] && FAILED=1
    return 0
}

# step_limit TIMEOUT_S: the timeout a step gets, scaled for a dry run and cut to the budget left.
step_limit() {
    local limit=$(($1 * SCALE)) left=$((BUDGET - SECONDS))
    ((limit > left)) && limit=$left
    echo "$limit"
}

# run_step NAME TIMEOUT_S COMMAND...: run it under timeout (scaled, cut to the budget left), log its
# output, and note PASS / SKIP / FAIL (with pytest's own count line when there is one).
run_step() {
    local name=$1 limit
    limit=$(step_limit "$2")
    shift 2
    if ((limit < 20)); then
        note FAIL "$name" "not run, the ${BUDGET}s budget is spent"
        return
    fi
    local log="$LOGDIR/$name.log" t0=$SECONDS rc
    echo
    echo "=== $name (timeout ${limit}s, at ${SECONDS}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0)) counts
    counts=$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|error|errors|deselected)|no tests ran' "$log" |
        tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    counts=${counts:+, $counts}
    if ((rc == 124 || rc == 137)); then
        note FAIL "$name" "timed out after ${limit}s${counts}" "$took"
    elif ((rc != 0)); then
        note FAIL "$name" "exit $rc after ${took}s${counts}" "$took"
    elif [[ -n "$counts" && "$counts" != *passed* ]]; then
        note SKIP "$name" "${took}s${counts}" "$took"
    else
        note PASS "$name" "${took}s${counts}" "$took"
    fi
}

# Prints the versions, and writes them as JSON to argv[1] for the final JSON object.
cat >"$LOGDIR/versions.py" <<'PYEOF'
import importlib, importlib.metadata, importlib.util, json, os, platform, shutil, subprocess, sys

found = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
         "dry_run": os.environ.get("ROUNDPIPE_GPU_CHECK_DRY_RUN") == "1"}
print("python      ", found["python"], found["executable"], found["platform"])
print("dry run     ", found["dry_run"])
# Versions from the installed metadata, not by importing: a cold import of datasets alone (pyarrow,
# pandas) outlasted this step's 20 s on a fresh machine.
for name in ("torch", "transformers", "peft", "accelerate", "pytest", "packaging", "datasets"):
    try:
        found[name] = importlib.metadata.version(name)
    except Exception as e:
        found[name] = f"not importable: {type(e).__name__}: {e}"
    print(f"{name:<12}", found[name])
missing = [n for n in ("transformers", "peft", "accelerate", "pytest", "packaging", "datasets")
           if str(found[n]).startswith("not importable")]
if missing:  # a GPU machine without a registry: the wheels travel with the working tree
    print("missing     ", ", ".join(missing), "- bring them as wheels: where pip reaches a registry,",
          "`python3 -m pip download --no-deps --only-binary=:all: -d .whl NAME==VERSION` for each (and each",
          "dependency it lacks), carry .whl to this machine, then `python3 -m pip install --no-index",
          "--no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH`;",
          "the steps that need them SKIP with their reason meanwhile")
found["missing"] = missing
import torch

found["torch_cuda"] = torch.version.cuda
found["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
found["cuda_sanitizer"] = importlib.util.find_spec("torch.cuda._sanitizer") is not None
found["cpus"] = os.cpu_count()
found["host_memory_gib"] = (round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
                            if hasattr(os, "sysconf") else None)
print("torch cuda  ", found["torch_cuda"], "| cudnn", found["cudnn"])
print("sanitizer   ", "torch.cuda._sanitizer", "present" if found["cuda_sanitizer"] else "absent")
print("cpus        ", found["cpus"], "| host memory", f"{found['host_memory_gib']} GiB")
found["gpus"] = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                              "total_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1)})
        print(f"gpu {i}       ", p.name, f"| capability {p.major}.{p.minor} | {p.multi_processor_count} SMs",
              f"| total {total / 2**30:.1f} GiB, free {free / 2**30:.1f} GiB")
    found["bf16"] = torch.cuda.is_bf16_supported()
    print("bf16        ", found["bf16"])
else:
    print("gpu         ", "none: torch.cuda.is_available() is False")
if shutil.which("nvidia-smi"):
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    found["nvidia_smi"] = (out.stdout or out.stderr).strip()
else:
    found["nvidia_smi"] = "not found"
print("nvidia-smi  ", found["nvidia_smi"])
with open(sys.argv[1], "w") as f:
    json.dump(found, f)
PYEOF

# Reads the step rows, the logs and the JSON files the steps left in LOGDIR; prints ONE JSON object
# on one line (and writes it to LOGDIR/gpu_check.json).
cat >"$LOGDIR/summary.py" <<'PYEOF'
import json, os, re, sys

logdir, dry, budget, elapsed, python, git, failed = sys.argv[1:8]


def read(name):
    try:
        with open(os.path.join(logdir, name), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def load(name):
    try:
        with open(os.path.join(logdir, name)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"unreadable": f"{name}: {type(e).__name__}: {e}"}


def numbers(text):
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text)]


steps = {}
for line in read("steps.tsv").splitlines():
    name, status, seconds, detail = (line.split("\t") + ["", "", ""])[:4]
    steps[name] = {"status": status, "seconds": int(seconds) if seconds.isdigit() else None, "detail": detail}

# The memory test's figures (tests/test_cuda.py prints them), one entry per case, in MiB.
memory, case = [], None
for line in read("memory.log").splitlines():
    if line.startswith("memory "):
        case = {"case": line[len("memory "):]}
        memory.append(case)
    elif case is not None and line.startswith("  ") and not line.startswith("    ") and ":" in line:
        key, _, value = line.strip().partition(":")
        key = re.sub(r"\W+", "_", key.strip()).strip("_")
        if key == "within_plan":
            case["within_plan"] = value.strip().startswith("True")
            case["within_strict_plan"] = value.strip().endswith("True")
        elif key == "plan_per_worker":  # "P MiB (strict, nothing in flight: S MiB); bound B MiB ..."
            case.update(zip(("plan_mib", "strict_plan_mib", "bound_mib"), numbers(value)))
        elif key in ("weights_of_two_stages", "working_set", "in_flight"):  # "... = TOTAL MiB"
            case[key + "_mib"] = numbers(value.split(" = ")[-1])[0]
        elif key == "above_weights_working_set":
            case["above_weights_and_working_set_mib"] = numbers(value)[0]
        elif key.endswith("_peak_per_step"):  # per step, per device: "a/b; c/d MiB (GPU, above ...)"
            case[key + "_mib"] = [numbers(s) for s in value.split("MiB")[0].split(";")]
m = re.search(r"ledger peak ([\d.]+) MiB, real peak ([\d.]+) MiB, largest layer ([\d.]+) MiB", read("smoke.log"))
smoke = dict(zip(("ledger_peak_mib", "real_peak_mib", "largest_layer_mib"), map(float, m.groups()))) if m else {}

throughput = load("gpu_throughput.json")
if "modes" in throughput:  # the figures, without the per-step lists and tracebacks (in the file)
    keep = ("status", "reason", "devices", "tokens_per_s", "step_s_median", "timed_steps", "first_loss", "ratio_to",
            "peak_gpu_allocated_bytes", "peak_gpu_reserved_bytes", "h2d_bytes_per_step", "h2d_gb_per_s",
            "h2d_fraction_of_pinned_peak", "policy", "num_microbatches", "trainable_parameters", "setup_s")
    throughput = {
        **{k: throughput.get(k) for k in ("complete", "dry_run", "model", "pinned_copy", "elapsed_s", "budget_s")},
        "setup": {k: throughput.get("setup", {}).get(k) for k in ("batch", "seq", "rows", "warmup", "timed", "lora_rank")},
        "modes": {
            mode: {"loss_check": block.get("loss_check"),
                   "systems": {key: {k: r[k] for k in keep if k in r} for key, r in block.get("systems", {}).items()}}
            for mode, block in throughput["modes"].items()
        },
    }
train = [line for line in read("train.log").splitlines() if re.match(r"(simulator|eval at|done)", line)]


def compact(x):
    """Floats to 4 significant digits, long strings cut: the object has to fit an output's tail."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, str) and len(x) > 300:
        return x[:300] + "..."
    if isinstance(x, dict):
        return {k: compact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [compact(v) for v in x]
    return x


out = {
    "gpu_check": {"ok": failed == "0", "dry_run": dry == "1", "budget_s": int(budget), "elapsed_s": int(elapsed),
                  "python": python, "git": git},
    "steps": steps,
    "versions": load("versions.json"),
    "memory": memory,
    "smoke": smoke,
    "throughput": throughput,
    "lanes": load("lanes.json"),
    "train": train[-4:],
}
text = json.dumps(compact(out), separators=(",", ":"), default=str)
with open(os.path.join(logdir, "gpu_check.json"), "w") as f:
    f.write(text + "\n")
print(text)
PYEOF

PYTEST=("$PY" -m pytest tests/test_cuda.py -p no:cacheprovider -o addopts="" -m cuda -v -rsfE --tb=short --durations=5)

echo "=== gpu_check $( ((DRY)) && echo "--dry-run (cpu backend)" || echo "(cuda)"), python: $PY, budget ${BUDGET}s"
run_step versions 25 "$PY" "$LOGDIR/versions.py" "$LOGDIR/versions.json"
if command -v git >/dev/null 2>&1 && timeout 10 git rev-parse HEAD >/dev/null 2>&1; then
    GIT="$(git rev-parse HEAD) ($(timeout 10 git status --porcelain 2>/dev/null | wc -l) changed paths)"
else
    GIT="not available here"
fi
echo "git          $GIT"

# (the slow-GPU equivalence case is the clock step's)
run_step equivalence 60 "${PYTEST[@]}" -k "trains_like_plain_pytorch and not cudas_clock"

run_step memory 115 "${PYTEST[@]}" -s -k "peak_memory"

run_step smoke 45 "${PYTEST[@]}" -s -k "bf16 or ledger or qlora"

run_step clock 40 "${PYTEST[@]}" -s -k "cudas_clock"

# The benchmark keeps to its own budget, 30 s (scaled) under the step's timeout for its imports and
# its summary, so that it ends with its figures rather than being killed; it also rewrites its JSON
# after every system, so a run cut short keeps what it measured.
limit=$(step_limit 110)
THROUGHPUT=("$PY" benchmarks/gpu_throughput.py --json "$LOGDIR/gpu_throughput.json" --budget-s $((limit - 30 * SCALE)))
# A dry run's files (gpu_throughput_dry_run.*) go beside the logs, not into benchmarks/results.
((DRY)) && THROUGHPUT=(env "ROUNDPIPE_BENCH_RESULTS=$LOGDIR/results" "${THROUGHPUT[@]}" --dry-run)
if ((limit < 90 * SCALE)); then # building the 1.5B model and one step of each system: ~90 s at least
    note SKIP throughput "only ${limit}s of the ${BUDGET}s budget left, under the $((90 * SCALE))s it needs"
else
    run_step throughput 110 "${THROUGHPUT[@]}"
fi
if ((!DRY)) && [[ -n "$KEEP" ]]; then # what it wrote into benchmarks/results, beside the logs
    cp benchmarks/results/gpu_throughput.json benchmarks/results/gpu_throughput.md "$KEEP/" 2>/dev/null
fi

# Each lane's busy seconds in a small run on one GPU, beside the virtual server's prediction for it.
run_step lanes 40 "$PY" benchmarks/virtual_server.py --lanes "$D1" --json "$LOGDIR/lanes.json"

TRAIN_ARGS=(--set "run.devices=$D2" --set run.max_steps=20 --set eval.every=10 --set "run.output_dir=${TMPDIR:-/tmp}/roundpipe-gpu-check-train"
    --set "data.train=${TMPDIR:-/tmp}/roundpipe-gpu-check-train/data/train.jsonl" --set "data.eval=${TMPDIR:-/tmp}/roundpipe-gpu-check-train/data/eval.jsonl"
    --set "data.synthetic_samples=[2000,64]" --set logging.progress=false)
if "$PY" -c 'import datasets' 2>/dev/null; then
    run_step train 30 "$PY" -m roundpipe.cli train recipes/demo.yaml --overwrite "${TRAIN_ARGS[@]}"
else
    note SKIP train "this python has no datasets (the training product reads data with it)"
fi

# Last, as the slowest and least predictable step (the sanitizer walks the stack at every kernel):
# the controls and the roundpipe policy's equivalence cases; with under 45 s left it could only time
# out, so it is skipped and says why.
SANITIZED=(-k "sanitizer or (trains_like_plain_pytorch and roundpipe-)")
if (($(step_limit 65) < 45 * SCALE)); then
    note SKIP sanitizer "only $((BUDGET - SECONDS))s of the ${BUDGET}s budget left, under the $((45 * SCALE))s it needs"
elif ((DRY)); then
    # No CUDA here: TORCH_CUDA_SANITIZER is never set; the cpu backend's own checks flag the control.
    run_step sanitizer 65 "${PYTEST[@]}" -s "${SANITIZED[@]}"
elif "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch.cuda._sanitizer") is None)' 2>/dev/null; then
    run_step sanitizer 65 env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -s "${SANITIZED[@]}"
else
    note SKIP sanitizer "this torch has no torch.cuda._sanitizer"
fi

# The figures that matter, once more at the end (where a truncated output tail still shows them).
echo
echo "=== digest"
grep -hE '^(python|torch|transformers|peft|gpu|nvidia-smi) ' "$LOGDIR/versions.log" 2>/dev/null
grep -hE '^memory |^  (plan per worker|measured peak|above weights|within plan)' "$LOGDIR/memory.log" 2>/dev/null
grep -hE '^(model:|pinned copy peak:|\| (lora|full) |(lora|full): first-step|gpu_throughput:)' "$LOGDIR/throughput.log" 2>/dev/null
grep -hE '^(simulator|eval at|done)' "$LOGDIR/train.log" 2>/dev/null | tail -n 4
for log in "$LOGDIR"/*.log; do
    grep -hE '^(FAILED|ERROR) ' "$log" 2>/dev/null | cut -c1-400
done
[[ -n "$KEEP" ]] && echo "full logs: $KEEP/gpu_check.log, $LOGDIR/ (JSON: $LOGDIR/gpu_check.json)"

echo
echo "=== summary (${SECONDS}s in all)"
printf '%s\n' "${SUMMARY[@]}"
echo
echo "=== json"
"$PY" "$LOGDIR/summary.py" "$LOGDIR" "$DRY" "$BUDGET" "$SECONDS" "$PY" "$GIT" "$FAILED" ||
    echo '{"gpu_check":{"ok":false,"error":"the summary script failed: see the summary lines above"}}'
if [[ -n "${TEE_PID:-}" ]]; then
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
fi
exit $FAILED
