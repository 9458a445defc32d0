"""The ``roundpipe`` command: ``train``, ``demo``, ``partition``, ``simulate``, ``plan`` and ``costs``.

Each command lives in its own module of ``roundpipe/commands/``, imported only when it runs (so
``roundpipe plan`` never imports torch); this file only picks one and hands it the arguments.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "train": (
        "roundpipe.commands.train",
        "fine-tune a model as a YAML recipe says (roundpipe train RECIPE.yaml)",
    ),
    "demo": (
        "roundpipe.commands.demo",
        "train recipes/demo.yaml: a small model learns to reverse strings (what `make demo` runs)",
    ),
    "partition": ("roundpipe.commands.partition", "print balanced partition plans for preset models"),
    "simulate": (
        "roundpipe.commands.simulate",
        "simulate one configuration: step time, tokens/s, memory, fits",
    ),
    "plan": ("roundpipe.commands.plan", "search policy, partition and microbatches (or --max-seq-len)"),
    "costs": (
        "roundpipe.commands.costs",
        "per-layer forward/backward seconds and bytes the cost model predicts (or --calibration)",
    ),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="roundpipe",
        description="Fine-tune Hugging Face LLMs on GPUs far smaller than the model.",
        epilog="Run `roundpipe COMMAND --help` for a command's options.",
    )
    parser.add_argument(
        "command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items())
    )
    args, rest = parser.parse_known_args(argv[:1])
    import importlib

    module = importlib.import_module(COMMANDS[args.command][0])
    module.main(argv[1:] + rest)


if __name__ == "__main__":
    main()
