"""Where a run writes: inside its run directory, and nowhere else.

The run directory (``run.output_dir``, default ``runs/NAME``) is the user's choice. A recipe --
perhaps written by someone else -- must not make roundpipe write anywhere outside it, so every
path a run writes is checked here against the run directory, both resolved (symlinks followed):

- ``run.name`` forms ``runs/NAME`` when ``run.output_dir`` is unset: it must be a plain name.
- ``data.train`` and ``data.eval`` are *written* when ``data.synthetic`` is set: they must lie
  inside the run directory and not on a name the run writes itself.
- The names the run writes (``RUN_DIR_ENTRIES``: ``config.yaml``, ``checkpoints/``, ...) must
  not lead outside through a symlink planted there (``runs/x/checkpoints -> /etc``), and neither
  may the files in the directories whose file names other libraries choose (``FILLED_BY_OTHERS``:
  exports, TensorBoard).

The rule for symlinks: one that stays inside the run directory is followed; one that leads
outside is refused, never written through. A refusal is a ``RecipeError`` naming the key, the
value and what to write instead; it comes at recipe load (``TrainConfig.check``), again when the
run starts (``Trainer.fit``), and where each writer forms its path. The checks read the
filesystem as it is when they run: they stop recipes and planted links, not a process that swaps
links while the run writes (such a process must not have write access to the run directory).

Pure ``os`` / ``pathlib``: the recipe loader imports this, and it must not import torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from roundpipe.errors import RecipeError

# Every name the trainer and its writers create in the run directory (a test checks that a real
# run writes nothing else there). Entries that are directories end up holding only files the run
# writes into fresh names, except those in FILLED_BY_OTHERS.
RUN_DIR_ENTRIES = (
    "config.yaml",
    "train.log",
    "plan.json",
    "metrics.jsonl",
    "tensorboard",
    "wandb",
    "loss.png",
    "timeline.png",
    "timeline.trace.json",
    "checkpoints",
    "export",
    "export/adapter",
    "export/merged",
)
# Directories whose file names are chosen by another library (tensorboard, save_pretrained): their
# existing entries are checked one by one before the run writes into them.
FILLED_BY_OTHERS = ("tensorboard", "wandb", "export/adapter", "export/merged")

_NOT_IN_A_NAME = ("/", "\\", ":", "\0")  # ':' makes a Windows drive (C:x), '\0' ends a C string
_LINK_HINT = (
    "remove the symlink (or point it inside the run directory), or set run.output_dir to another directory"
)
_EXPORT_HINT = "remove the symlink (or point it inside the directory), or write to another directory"


def plain_run_name(name: str) -> None:
    """Refuse a ``run.name`` that would not stay one directory below ``runs/``.

    Raises:
        RecipeError: the name is empty, ``.`` or ``..``, or holds ``/``, ``\\``, ``:`` or a NUL;
            the message suggests a plain name and ``run.output_dir``.
    """
    if name.strip() and name != "." and ".." not in name and not any(c in name for c in _NOT_IN_A_NAME):
        return
    plain = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).replace("..", "-").strip(".-") or "run"
    raise RecipeError(
        f"run.name {name!r} is not a plain name: it names the run directory runs/NAME, so it may not "
        f"be empty or hold '..', '/', '\\', ':' or a NUL; write e.g. run.name: {plain}, or set "
        f"run.output_dir to the directory the run should write to"
    )


def escape(base: str | os.PathLike, path: str | os.PathLike) -> str | None:
    """None when ``path`` lies inside ``base`` (or is it), both resolved with symlinks followed;
    otherwise a phrase saying where it leads instead (and through which symlink), for messages.

    Relative paths are taken from the working directory, as every path in a recipe is.
    """
    try:
        root, target = Path(base).resolve(), Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL in the name
        return f"cannot be resolved ({exc})"
    if target == root or root in target.parents:
        return None
    return f"resolves to {target}{_through_link(Path(base), Path(path))}"


def _through_link(base: Path, path: Path) -> str:
    """`` through the symlink L -> T`` for the first symlink below ``base`` on the way to ``path``."""
    top, where = Path(os.path.abspath(base)), Path(os.path.abspath(path))
    if top not in where.parents:
        return ""  # outside by its very spelling: absolute elsewhere, or '..' climbing out
    part = top
    for name in where.relative_to(top).parts:
        part = part / name
        if part.is_symlink():
            return f" through the symlink {part} -> {os.readlink(part)}"
    return ""


def inside_run_dir(
    run_dir: str | os.PathLike,
    path: str | os.PathLike,
    key: str,
    value: Any = None,
    instead: str | None = None,
    area: str = "the run directory",
) -> Path:
    """``path`` (unchanged) when it lies inside ``run_dir``, both resolved; else ``RecipeError``.

    The one check every writer of a run makes before it writes.

    Args:
        run_dir: the run directory, as the recipe gives it.
        path: what is about to be written: ``run_dir / NAME`` for a name of roundpipe's, or a path
            a recipe gives (relative to the working directory).
        key: the recipe key whose value decided ``path``, named in the message.
        value: that key's value as given, when it is not ``path`` itself.
        instead: what to write instead; by default the advice for a symlink that leads out.
        area: what ``run_dir`` is, for the message.

    Raises:
        RecipeError: ``path`` resolves outside ``run_dir``: the message names ``key``, the value,
            where the path leads (and through which symlink) and what to do instead.
    """
    why = escape(run_dir, path)
    if why is None:
        return Path(path)
    shown = str(path) if value is None else str(value)
    subject = f"{key} {shown!r}" + ("" if shown == str(path) else f": {path}")
    raise RecipeError(
        f"{subject} {why}: it must lie inside {area} {_resolved_text(run_dir)}; {instead or _LINK_HINT}"
    )


def run_file(run_dir: str | os.PathLike, name: str) -> Path:
    """``run_dir / name`` for one of roundpipe's own names, refused when a symlink there leads out."""
    return inside_run_dir(run_dir, Path(run_dir) / name, "run.output_dir", value=run_dir)


def previous_run(run_dir: str | os.PathLike) -> list[str]:
    """What an earlier run left in ``run_dir`` that a new run would mix with its own: a non-empty
    ``metrics.jsonl``, a checkpoint, an export (empty when there is none). A run that failed before
    its first step leaves only ``config.yaml`` and ``train.log``: starting again there is fine."""
    run_dir = Path(run_dir)
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    if (run_dir / "export").exists():
        found.append("export/")
    return found


def clear_run(run_dir: str | os.PathLike) -> list[str]:
    """Remove every output of an earlier run from ``run_dir`` (the names of ``RUN_DIR_ENTRIES`` at
    its top level: a symlink is removed, never followed); other files (data files the recipe
    reads) stay. Returns the names removed."""
    import shutil

    removed = []
    for name in RUN_DIR_ENTRIES:
        if "/" in name:
            continue  # inside a top-level entry, which goes as a whole
        path = run_file(run_dir, name)
        if path.is_symlink() or path.is_file():
            path.unlink()
            removed.append(name)
        elif path.is_dir():
            shutil.rmtree(path)
            removed.append(name + "/")
    return removed


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Every name of ``RUN_DIR_ENTRIES`` and every entry already in ``FILLED_BY_OTHERS`` stays
    inside ``run_dir``. Cheap: a few ``lstat`` calls, and a listing of three directories."""
    for name in RUN_DIR_ENTRIES:
        run_file(run_dir, name)
    for name in FILLED_BY_OTHERS:
        check_filled_dir(Path(run_dir) / name, "run.output_dir", value=run_dir, base=run_dir)


def check_filled_dir(
    directory: str | os.PathLike, key: str, value: Any = None, base: str | os.PathLike | None = None
) -> None:
    """Before a library whose file names roundpipe does not choose (``save_pretrained``,
    tensorboard) writes into ``directory``: none of its entries may lead outside ``base``
    (default: ``directory`` itself). A missing directory is fine."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in sorted(directory.iterdir()):
        if base is None:
            inside_run_dir(directory, entry, key, value=value, instead=_EXPORT_HINT, area="the directory")
        else:
            inside_run_dir(base, entry, key, value=value)


def check_run_paths(cfg) -> Path:
    """Every path the run of ``cfg`` (a ``TrainConfig``) will write lies inside its run directory.

    Returns:
        The run directory, as the recipe gives it.

    Raises:
        RecipeError: ``run.name`` is not a plain name when it forms ``runs/NAME``; a file that
            ``data.synthetic`` writes lies outside the run directory or on one of its own names;
            a symlink in the run directory leads outside it.
    """
    if not cfg.run.output_dir:
        plain_run_name(cfg.run.name)
    run_dir = Path(cfg.output_dir)
    why = escape(run_dir, run_dir)
    if why is not None:
        raise RecipeError(f"run.output_dir {str(run_dir)!r} {why}; give a directory the run can write to")
    check_run_dir(run_dir)
    if cfg.data.synthetic is not None:
        for key, value in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
            if value is not None:
                _check_synthetic_file(run_dir, key, value)
    return run_dir


def _check_synthetic_file(run_dir: Path, key: str, value: str) -> None:
    """A file ``data.synthetic`` writes: inside the run directory, on none of the run's own names."""
    suggestion = run_dir / "data" / (Path(value).name or key.split(".")[1] + ".jsonl")
    instead = (
        f"data.synthetic writes this file there: write e.g. "
        f"{key}: {suggestion}, or generate the data once and drop data.synthetic"
    )
    inside_run_dir(run_dir, value, key, instead=instead)
    relative = Path(value).resolve().relative_to(run_dir.resolve())  # inside: checked just above
    taken = max(
        (n for n in RUN_DIR_ENTRIES if relative == Path(n) or Path(n) in relative.parents),
        key=len,
        default=None,
    )
    if taken is not None or relative == Path("."):
        what = "the run directory itself" if taken is None else f"on {taken}, which the run writes itself"
        raise RecipeError(
            f"{key} {value!r} is {what}: data.synthetic would overwrite it or be overwritten; "
            f"write e.g. {key}: {suggestion}"
        )


def _resolved_text(path: str | os.PathLike) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError, ValueError):
        return str(path)
