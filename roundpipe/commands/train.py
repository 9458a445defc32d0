"""``roundpipe train RECIPE.yaml [--set group.key=value ...] [--resume auto|PATH | --overwrite]``.

Reads the recipe (``roundpipe.train.recipe``), runs ``Trainer.fit`` and exits 0 when the run
completed, 130 when a signal stopped it after writing a checkpoint, 2 on a recipe, data or setting
error or a run refused for memory it would not find (host RAM, a device; the message says what to
change), 1 when the run failed (one line here; the traceback, and
whether a checkpoint of the last completed step was written, in the run's ``train.log``).

Under ``torchrun`` every rank runs this command; rank 0 alone prints progress and writes the run
directory, and every rank prints its own error line (``roundpipe train [rank 1/2]: failed: ...``)
and exits with the code above, so the torchrun agent sees the failure and stops (or restarts,
``--max-restarts``) the others.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    from roundpipe.train.recipe_reference import help_epilog

    ap = argparse.ArgumentParser(
        prog="roundpipe train",
        description="Fine-tune a Hugging Face causal LM as a YAML recipe says (docs/recipes.md).",
        epilog="Recipe keys (give them in the YAML file or with --set):\n\n" + help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("recipe", help="the YAML recipe, e.g. recipes/demo.yaml")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="GROUP.KEY=VALUE",
        help="override one recipe key (the value is read as YAML); repeatable",
    )
    ap.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from the newest checkpoint of the run (auto: start afresh if there is none) or from PATH",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="the run directory holds an earlier run: remove its outputs (checkpoints/, export/, "
        "metrics.jsonl, train.log, config.yaml, plots, tensorboard/) and start afresh there; "
        "without it (or --resume) such a run directory is refused",
    )
    args = ap.parse_args(argv)
    from roundpipe.errors import ConfigError, DeviceMemoryError, HostMemoryError, InputError

    prog = f"roundpipe train{_rank_tag()}"

    try:
        from roundpipe.testing import faults
        from roundpipe.train.recipe import load_recipe
        from roundpipe.train.trainer import LOG_FILE, Trainer

        faults.from_environment()  # ROUNDPIPE_FAULTS: only the reliability tests set it
        config = load_recipe(args.recipe, args.overrides)
        trainer = Trainer(config, resume=args.resume, overwrite=args.overwrite)
        result = trainer.fit()
    except (ConfigError, InputError, HostMemoryError, DeviceMemoryError) as err:  # say what to change
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as err:  # the run failed: one line here, the traceback in the run's log
        first = str(err).splitlines()[0] if str(err) else ""
        where = ""
        if "trainer" in locals():
            where = (
                f" (traceback in {trainer.run_dir / LOG_FILE})"
                if trainer.ranks.is_main
                else " (traceback above)"
            )
        print(f"{prog}: failed: {type(err).__name__}: {first}{where}", file=sys.stderr, flush=True)
        sys.exit(1)
    if result.interrupted:
        sys.exit(130)
    # The trainer printed (and wrote to train.log) the `done:` line.


def _rank_tag() -> str:
    """`` [rank R/N]`` under a launcher of several ranks (torchrun), else nothing."""
    import os

    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f" [rank {rank}/{world}]" if world.isdigit() and int(world) > 1 else ""


if __name__ == "__main__":
    main()
