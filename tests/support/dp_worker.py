"""One data-parallel rank of tests/test_data_parallel.py, launched as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/support/dp_worker.py OUT_DIR CASES_JSON

Trains every case (a dict of ``train_case``'s arguments) in turn in the same process group and
writes ``OUT_DIR/<name>.rank<r>.pt``: the losses, the trained weights, and the bytes of optimizer
state this rank holds (its tensors, measured), or the error the case raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
torch.set_num_threads(1)

from support.dp_cases import train_case  # noqa: E402


def main() -> None:
    out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    for case in cases:
        name = case.pop("name")
        try:
            result = train_case(**case)
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                      "traceback": traceback.format_exc(), "time": time.time()}  # fmt: skip
        torch.save(result, out / f"{name}.rank{rank}.pt")
        if "error" in result and case.get("stop_on_error", True):
            break


if __name__ == "__main__":
    main()
