#!/usr/bin/env bash
# GPU check: run on a machine with a CUDA GPU, using that machine's own torch (nothing installed).
#   PYTHONPATH=. bash scripts/gpu_check.sh
# Runs the cuda-marked tests and a short throughput run of the demo; must finish in < 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "peft", peft.__version__); print(torch.cuda.get_device_name(0))'
rc=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -o addopts="" || rc=$?
timeout 120 python3 -m roundpipe.demo --devices cuda:0x2 --steps 20 --batch 32 --seq 256 --dtype bf16 || rc=$?
exit $rc
