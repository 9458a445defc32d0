#!/usr/bin/env bash
# GPU check: run on a machine with a CUDA GPU, using that machine's own torch (nothing installed).
#   PYTHONPATH=. bash scripts/gpu_check.sh            # on the GPU machine (python3 there)
#   bash scripts/gpu_check.sh --dry-run               # here: the same steps on cpu virtual devices
#
# Steps (each under its own timeout; a failure does not stop the later ones):
#   versions     python, torch (CUDA, cuDNN), transformers, peft, accelerate, GPU, memory, driver, git
#   equivalence  every executable policy x {cuda:0x2, cuda:0} vs plain PyTorch (tests/test_cuda.py)
#   memory       roundpipe policy, 386 MiB bf16 layers: measured peak vs the plan, every figure printed
#   smoke        bf16 LoRA training and the ledger-vs-torch.cuda test
#   demo         a short throughput run of scripts/gpu_throughput.py on cuda:0x2
#   train        `roundpipe train recipes/demo.yaml` for 20 steps on cuda:0x2 (SKIP without `datasets`)
#   sanitizer    the equivalence tests under TORCH_CUDA_SANITIZER=1, plus a control that the
#                sanitizer sees roundpipe's worker threads (last: it takes what the budget has left)
# Ends with one PASS / SKIP / FAIL line per step; exits non-zero if any step failed. The whole run
# stays within GPU_CHECK_BUDGET_S (default 450 s): each step's timeout is cut to what is left.
#
# --dry-run maps cuda:0x2 -> cpu:2 and cuda:0 -> cpu:1 (ROUNDPIPE_GPU_CHECK_DRY_RUN=1, read by
# tests/test_cuda.py), shrinks the memory test's model, never sets TORCH_CUDA_SANITIZER, and uses
# .venv/bin/python when there is one (PY=... overrides either way).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    -h | --help)
        sed -n '2,20p' "$0"
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
else
    unset ROUNDPIPE_GPU_CHECK_DRY_RUN
    D2=cuda:0x2
fi

BUDGET=${GPU_CHECK_BUDGET_S:-450}
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
SUMMARY=()
FAILED=0

# run_step NAME TIMEOUT_S COMMAND...: run it under timeout (cut to the budget left), log its output,
# and add a PASS / SKIP / FAIL line to the summary (pytest's own count line when there is one).
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        SUMMARY+=("FAIL  $name: not run, the ${BUDGET}s budget is spent")
        FAILED=1
        return
    fi
    ((limit > left)) && limit=$left
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
        SUMMARY+=("FAIL  $name: timed out after ${limit}s${counts}")
        FAILED=1
    elif ((rc != 0)); then
        SUMMARY+=("FAIL  $name: exit $rc after ${took}s${counts}")
        FAILED=1
    elif [[ -n "$counts" && "$counts" != *passed* ]]; then
        SUMMARY+=("SKIP  $name: ${took}s${counts}")
    else
        SUMMARY+=("PASS  $name: ${took}s${counts}")
    fi
}

cat >"$LOGDIR/versions.py" <<'EOF'
import importlib, importlib.util, os, platform, shutil, subprocess, sys

print("python      ", sys.version.split()[0], sys.executable, platform.platform())
print("dry run     ", os.environ.get("ROUNDPIPE_GPU_CHECK_DRY_RUN") == "1")
for name in ("torch", "transformers", "peft", "accelerate", "pytest", "packaging"):
    try:
        print(f"{name:<12}", importlib.import_module(name).__version__)
    except Exception as e:
        print(f"{name:<12} not importable: {type(e).__name__}: {e}")
import torch

print("torch cuda  ", torch.version.cuda, "| cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
print("sanitizer   ", "torch.cuda._sanitizer", "present" if importlib.util.find_spec("torch.cuda._sanitizer") else "absent")
print("cpus        ", os.cpu_count(), "| host memory",
      f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB" if hasattr(os, "sysconf") else "?")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        print(f"gpu {i}       ", p.name, f"| capability {p.major}.{p.minor} | {p.multi_processor_count} SMs",
              f"| total {total / 2**30:.1f} GiB, free {free / 2**30:.1f} GiB")
    print("bf16        ", torch.cuda.is_bf16_supported())
else:
    print("gpu         ", "none: torch.cuda.is_available() is False")
if shutil.which("nvidia-smi"):
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    print("nvidia-smi  ", (out.stdout or out.stderr).strip())
else:
    print("nvidia-smi  ", "not found")
EOF

PYTEST=("$PY" -m pytest tests/test_cuda.py -p no:cacheprovider -o addopts="" -m cuda -v -rsfE --tb=short --durations=5)

echo "=== gpu_check $( ((DRY)) && echo "--dry-run (cpu backend)" || echo "(cuda)"), python: $PY, budget ${BUDGET}s"
run_step versions 45 "$PY" "$LOGDIR/versions.py"
if command -v git >/dev/null 2>&1 && timeout 10 git rev-parse HEAD >/dev/null 2>&1; then
    echo "git          $(git rev-parse HEAD) ($(timeout 10 git status --porcelain 2>/dev/null | wc -l) changed paths)"
else
    echo "git          not available here"
fi

run_step equivalence 75 "${PYTEST[@]}" -k "trains_like_plain_pytorch"

run_step memory 120 "${PYTEST[@]}" -s -k "peak_memory"

run_step smoke 45 "${PYTEST[@]}" -s -k "bf16 or ledger"

if ((DRY)); then
    run_step demo 55 "$PY" scripts/gpu_throughput.py --devices "$D2" --steps 3 --batch 8 --seq 32 --dtype bf16
else
    run_step demo 60 "$PY" scripts/gpu_throughput.py --devices "$D2" --steps 20 --batch 32 --seq 256 --dtype bf16
fi

TRAIN_ARGS=(--set "run.devices=$D2" --set run.max_steps=20 --set eval.every=10 --set "run.output_dir=${TMPDIR:-/tmp}/roundpipe-gpu-check-train"
    --set "data.train=${TMPDIR:-/tmp}/roundpipe-gpu-check-train/data/train.jsonl" --set "data.eval=${TMPDIR:-/tmp}/roundpipe-gpu-check-train/data/eval.jsonl"
    --set "data.synthetic_samples=[2000,64]" --set logging.progress=false)
if "$PY" -c 'import datasets' 2>/dev/null; then
    run_step train 60 "$PY" -m roundpipe.cli train recipes/demo.yaml "${TRAIN_ARGS[@]}"
else
    SUMMARY+=("SKIP  train: this python has no datasets (the training product reads data with it)")
fi

# Last, as the slowest and least predictable step: it gets what is left of the budget (up to 240 s).
if ((DRY)); then
    # No CUDA here: the sanitizer is never set; the step still runs (its control test skips).
    run_step sanitizer 240 "${PYTEST[@]}" -k "sanitizer or trains_like_plain_pytorch"
elif "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch.cuda._sanitizer") is None)' 2>/dev/null; then
    run_step sanitizer 240 env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -k "sanitizer or trains_like_plain_pytorch"
else
    SUMMARY+=("SKIP  sanitizer: this torch has no torch.cuda._sanitizer")
fi

# The figures that matter, once more at the end (where a truncated output tail still shows them).
echo
echo "=== digest"
grep -hE '^(python|torch|transformers|peft|gpu|nvidia-smi) ' "$LOGDIR/versions.log" 2>/dev/null
grep -hE '^memory |^  (plan per worker|measured peak|above weights|within plan)' "$LOGDIR/memory.log" 2>/dev/null
grep -hE 'tokens/s|^loss ' "$LOGDIR/demo.log" 2>/dev/null | tail -n 2
grep -hE '^(simulator|eval at|done)' "$LOGDIR/train.log" 2>/dev/null | tail -n 4
for log in "$LOGDIR"/*.log; do
    grep -hE '^(FAILED|ERROR) ' "$log" 2>/dev/null | cut -c1-400
done
[[ -n "$KEEP" ]] && echo "full logs: $KEEP/gpu_check.log, $LOGDIR/"

echo
echo "=== summary (${SECONDS}s in all)"
printf '%s\n' "${SUMMARY[@]}"
if [[ -n "${TEE_PID:-}" ]]; then
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
fi
exit $FAILED
