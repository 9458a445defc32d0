"""Host syncs on the cpu backend: each one counted with what it read and the call site.

On a GPU, reading device data on the host (``.item()``, ``bool(t)``, a data-dependent output shape)
stalls the issuing thread until the stream drains; the issue mode (``cpu_clock.py``) counts every
one in a ``HostSyncs`` (``backend.host_syncs``, ``pipe.stats()["host_syncs"]``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

_ROUNDPIPE_BACKEND = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def call_site() -> str:
    """``file:line (function)`` of the nearest caller outside torch and this backend."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH) or name.startswith(_ROUNDPIPE_BACKEND) or name.startswith("<")):
            return f"{_short(name)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/roundpipe/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) - (0 if marker == "/site-packages/" else len("roundpipe/")) :]
    return path


@dataclass
class HostSyncs:
    """Host syncs since the last ``reset``: how many, and ``(what, call site)`` counts."""

    count: int = 0
    sites: Counter = field(default_factory=Counter)
    stalls: Counter = field(default_factory=Counter)  # backend artifacts: ops without a meta kernel
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, what: str, site: str) -> None:
        with self._lock:
            self.count += 1
            self.sites[(what, site)] += 1

    def stall(self, what: str) -> None:
        with self._lock:
            self.stalls[what] += 1

    def reset(self) -> None:
        with self._lock:
            self.count = 0
            self.sites = Counter()
            self.stalls = Counter()

    def report(self) -> dict:
        with self._lock:
            return {
                "count": self.count,
                "sites": [
                    {"what": what, "where": site, "count": n} for (what, site), n in self.sites.most_common()
                ],
                "eager_ops": dict(self.stalls),
            }
