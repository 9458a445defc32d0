"""Rewrite the generated tables of the docs from the code that declares them.

docs/guide.md's RunConfig table comes from ``roundpipe.settings_table`` (one line per
``_setting`` declaration); docs/recipes.md is ``python -m roundpipe.train.recipe --markdown``.
Run from the repository root: ``.venv/bin/python scripts/docs_tables.py``; ``--check`` only says
whether the pages are up to date (exit 1 if not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from roundpipe.settings_table import GUIDE_TABLE_END, GUIDE_TABLE_START, settings_table

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def with_table(page: str) -> str:
    """``page`` with its generated block replaced by the current table."""
    start, end = page.index(GUIDE_TABLE_START), page.index(GUIDE_TABLE_END) + len(GUIDE_TABLE_END)
    return page[:start] + settings_table() + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    page = GUIDE.read_text()
    new = with_table(page)
    if args.check:
        if new != page:
            print(f"{GUIDE} is stale: run scripts/docs_tables.py", file=sys.stderr)
            return 1
        return 0
    GUIDE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
