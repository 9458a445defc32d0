"""Every test runs with the cpu backend's stream sanitizer on (docs/design.md §5)."""

import os

os.environ.setdefault("ROUNDPIPE_SANITIZE", "1")
