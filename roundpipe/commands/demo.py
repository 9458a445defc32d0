"""``make demo`` / ``roundpipe demo``: train ``recipes/demo.yaml``.

A small Qwen3-shaped model built from config numbers learns to reverse strings of letters; the
data is generated into the run directory with a held-out set it never trains on, and the run ends
with the held-out exact match, a few greedy answers next to the references, and the saved model.
The same as ``roundpipe train recipes/demo.yaml --overwrite``: each demo starts afresh in
``runs/demo`` unless ``--resume`` is given; extra arguments are passed on (``--set ...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from roundpipe.commands.train import main as train

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not RECIPE.exists():
        raise SystemExit(f"{RECIPE} is missing: run the demo from a roundpipe checkout")
    fresh = [] if {"--resume", "--overwrite"} & {a.split("=")[0] for a in argv} else ["--overwrite"]
    train([str(RECIPE), *fresh, *argv])


if __name__ == "__main__":
    main()
