"""The ``roundpipe`` command: ``demo``, ``partition``, ``simulate`` and ``plan``.

``roundpipe train`` arrives with the trainer; until then the command offers what exists.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": ("roundpipe.demo", "LoRA-fine-tune a small model built from a config (what `make demo` runs)"),
    "partition": ("roundpipe.partition.__main__", "print balanced partition plans for preset models"),
    "simulate": (
        "roundpipe.sim.simulate_command",
        "simulate one configuration: step time, tokens/s, memory, fits",
    ),
    "plan": ("roundpipe.sim.plan_command", "search policy, partition and microbatches (or --max-seq-len)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="roundpipe",
        description="Fine-tune Hugging Face LLMs on GPUs far smaller than the model.",
        epilog="Run `roundpipe COMMAND --help` for a command's options. train is not available yet.",
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
