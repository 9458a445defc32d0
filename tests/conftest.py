"""Every test runs with the cpu backend's stream sanitizer on (docs/design.md §5)."""

import os

os.environ.setdefault("ROUNDPIPE_SANITIZE", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--soak-steps",
        type=int,
        default=200,
        help="optimizer steps of tests/test_soak.py's run (a fault about every 20 of them)",
    )
