"""The inter-node link of multi-node data parallelism: what a collective over it costs.

Each node runs its own pipeline; the nodes reduce the fp32 gradients, which live in host RAM, with
gloo over this network (``roundpipe/sim/data_parallel.py`` replays when). A :class:`Network` is a
named preset (``presets/hardware.json``, table ``networks``: ``10gbe``, ``25gbe``, ``100gbe``,
``200gbe-ib``, ``400gbe-ib``) or a custom ``"BW_GBPS:LATENCY_US"``: the bandwidth a collective's
stream *achieves* (bytes/s per direction; the presets take about 85% of the line rate), the
latency of one message step, and the algorithm (``ring``, the default, or ``tree``).

Time of one collective over ``N`` nodes on ``B`` bytes per node, bandwidth ``bw``, latency ``a``::

    time = max(wire / bw, summed / reduce_bw) + steps * a

gloo cuts a buffer into chunks and sums each received chunk into the local one while the next
arrives, so a collective runs at the slower of the wire and the host's sum (``reduce_bw``: see
:func:`host_reduce_bw`). Per node, ``wire`` is the bytes it sends, ``summed`` the bytes it adds:

=================  ===========  ============  ==========  =========  =========  ==========
collective         ring wire    ring summed   ring steps  tree wire  tree sum   tree steps
=================  ===========  ============  ==========  =========  =========  ==========
all-reduce         2(N-1)/N B   (N-1)/N B     2(N-1)      2B         B          2 log2 N
reduce-scatter     (N-1)/N B    (N-1)/N B     N-1         (N-1)/N B  (N-1)/N B  log2 N
all-gather         (N-1)/N B    0             N-1         (N-1)/N B  0          log2 N
reduce (to one)    2(N-1)/N B   (N-1)/N B     N           B          B          log2 N
broadcast          log2 N B     0             log2 N      B          0          log2 N
=================  ===========  ============  ==========  =========  =========  ==========

(``log2 N`` rounded up.) ``ring`` is what gloo runs: the all-reduce is a reduce-scatter and an
all-gather of ``B / N`` pieces around the ring, ``N - 1`` steps each; a reduce is a ring
reduce-scatter followed by a gather of the pieces to the root (``gloo/reduce.cc``), whose link
takes in ``(N-1)/N B`` more; a broadcast is a binomial tree that sends the whole buffer in each of
its ``log2 N`` rounds (``gloo/broadcast.cc``). ``tree`` is the latency-optimal family: a
double binary tree for the all-reduce (each node inner in one tree and a leaf in the other: it
sends ``2B`` and sums ``B``), recursive halving / doubling for reduce-scatter / all-gather,
pipelined binary trees for reduce and broadcast. It takes fewer steps but moves more bytes than
the ring's all-reduce. With one node every collective costs zero.

Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

from roundpipe.errors import ConfigError
from roundpipe.presets import Server

ALGORITHMS = ("ring", "tree")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast")
SUM_TRAFFIC_BYTES = 3  # fp32 a += b: read a, read b, write a, per byte summed
_GIGA = 1e9


@cache
def _table() -> dict:
    text = resources.files("roundpipe.presets").joinpath("hardware.json").read_text(encoding="utf-8")
    return json.loads(text)


def known_networks() -> list[str]:
    """The preset networks, slowest first."""
    nets = {k: v for k, v in _table()["networks"].items() if not k.startswith("_")}
    return sorted(nets, key=lambda k: nets[k]["achieved_gbs"])


def default_bucket_bytes() -> int:
    """Bytes per gradient bucket (``networks._defaults.bucket_mb``, MiB)."""
    return int(_table()["networks"]["_defaults"]["bucket_mb"] * (1 << 20))


@dataclass(frozen=True)
class Network:
    """An inter-node link in SI units: ``bandwidth`` achieved bytes/s per direction, ``latency_s``
    per message step, ``algorithm`` of the collectives (``ring`` or ``tree``)."""

    name: str
    bandwidth: float
    latency_s: float
    algorithm: str = "ring"
    line_gbps: float | None = None  # nominal line rate, Gbit/s (presets only)

    def __post_init__(self):
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ConfigError(
                f"network bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}"
            )
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"network latency must be >= 0 seconds, got {self.latency_s!r}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"unknown all-reduce algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
            )

    def describe(self) -> str:
        return (
            f"{self.name} ({self.algorithm}, {self.bandwidth / _GIGA:.2f} GB/s achieved, "
            f"{self.latency_s * 1e6:.0f} us per step)"
        )

    def time(self, collective: str, nbytes: float, nodes: int, reduce_bw: float = math.inf) -> float:
        """Seconds of ``collective`` on ``nbytes`` per node over ``nodes`` nodes (module docstring)."""
        wire, summed, steps = traffic(collective, nbytes, nodes, self.algorithm)
        return max(wire / self.bandwidth, summed / reduce_bw) + steps * self.latency_s

    def all_reduce_s(self, nbytes: float, nodes: int, reduce_bw: float = math.inf) -> float:
        """Ring: ``max(2(N-1)/N B / bw, (N-1)/N B / reduce_bw) + 2(N-1) a``."""
        return self.time("all_reduce", nbytes, nodes, reduce_bw)

    def reduce_scatter_s(self, nbytes: float, nodes: int, reduce_bw: float = math.inf) -> float:
        """Ring: ``max((N-1)/N B / bw, (N-1)/N B / reduce_bw) + (N-1) a``."""
        return self.time("reduce_scatter", nbytes, nodes, reduce_bw)

    def all_gather_s(self, nbytes: float, nodes: int) -> float:
        """Ring: ``(N-1)/N B / bw + (N-1) a`` (nothing to sum)."""
        return self.time("all_gather", nbytes, nodes)

    def reduce_s(self, nbytes: float, nodes: int, reduce_bw: float = math.inf) -> float:
        """Ring (gloo: reduce-scatter, then a gather to the root):
        ``max(2(N-1)/N B / bw, (N-1)/N B / reduce_bw) + N a``."""
        return self.time("reduce", nbytes, nodes, reduce_bw)

    def broadcast_s(self, nbytes: float, nodes: int) -> float:
        """Ring (gloo: a binomial tree of the whole buffer): ``log2 N (B / bw + a)``, rounded up."""
        return self.time("broadcast", nbytes, nodes)


def traffic(collective: str, nbytes: float, nodes: int, algorithm: str = "ring") -> tuple[float, float, int]:
    """``(wire bytes sent, bytes summed, message steps)`` per node (the module docstring's table)."""
    if collective not in COLLECTIVES:
        raise ConfigError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    check_nodes(nodes)
    if nodes == 1 or nbytes <= 0:
        return 0.0, 0.0, 0
    n, b = nodes, float(nbytes)
    share = (n - 1) / n * b
    depth = math.ceil(math.log2(n))
    if algorithm == "ring":
        steps = {"all_reduce": 2 * (n - 1), "reduce": n, "broadcast": depth}.get(collective, n - 1)
        wire = {"all_reduce": 2 * share, "reduce": 2 * share, "broadcast": depth * b}.get(collective, share)
        summed = {"all_reduce": share, "reduce_scatter": share, "reduce": share}.get(collective, 0.0)
    elif algorithm == "tree":
        steps = 2 * depth if collective == "all_reduce" else depth
        wire = {"all_reduce": 2 * b, "reduce_scatter": share, "all_gather": share}.get(collective, b)
        summed = {"all_reduce": b, "reduce_scatter": share, "reduce": b}.get(collective, 0.0)
    else:
        raise ConfigError(
            f"unknown all-reduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
        )
    return wire, summed, steps


def check_nodes(nodes) -> int:
    """``nodes`` as a positive int, else :class:`ConfigError`."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"the number of nodes must be a positive integer (1 for one server), got {nodes!r}")
    return nodes


def load_network(spec: str | Network, algorithm: str | None = None) -> Network:
    """A preset name (``100gbe``) or ``"BW_GBPS:LATENCY_US"`` (achieved Gbit/s and microseconds per
    message step, e.g. ``"80:10"``); ``algorithm`` overrides the preset's (``ring`` default).
    Anything else raises :class:`ConfigError` naming the presets."""
    if isinstance(spec, Network):
        net = spec
        return (
            net
            if algorithm is None
            else Network(net.name, net.bandwidth, net.latency_s, algorithm, net.line_gbps)
        )
    text = str(spec).strip().lower()
    table = _table()["networks"]
    algo = algorithm if algorithm is not None else table["_defaults"]["algorithm"]
    entry = table.get(text) if not text.startswith("_") else None
    if entry is not None:
        return Network(
            text, entry["achieved_gbs"] * _GIGA, entry["latency_us"] * 1e-6, algo, float(entry["line_gbps"])
        )
    choices = f"known networks: {', '.join(known_networks())}, or BW_GBPS:LATENCY_US such as 80:10"
    if ":" not in text:
        raise ConfigError(f"unknown network {spec!r}; {choices}")
    bw, _, lat = text.partition(":")
    try:
        gbps, latency_us = float(bw), float(lat)
    except ValueError:
        raise ConfigError(f"bad network {spec!r}: both figures must be numbers; {choices}") from None
    if not (gbps > 0 and math.isfinite(gbps)) or not (latency_us >= 0 and math.isfinite(latency_us)):
        raise ConfigError(
            f"bad network {spec!r}: the bandwidth must be > 0 Gbit/s and the latency >= 0 us; {choices}"
        )
    return Network(f"{gbps:g}Gb/s:{latency_us:g}us", gbps * _GIGA / 8, latency_us * 1e-6, algo)


def host_reduce_bw(server: Server) -> float:
    """Bytes of gradient a node's CPU sums per second in a gloo reduction: the server preset's
    ``host_reduce_gbs`` where it has one, else ``host_memory_bw x optimizer_efficiency / 3`` (an
    fp32 ``a += b`` moves 3 bytes per byte summed, at the share of the memory bandwidth the CPU
    AdamW step is assumed to reach; ``hardware.json`` networks ``_assumed.host_reduce``)."""
    topo = _table()["servers"].get(server.gpu.name, {})
    if topo.get("host_reduce_gbs"):
        return float(topo["host_reduce_gbs"]) * _GIGA
    return server.host_work_bw / SUM_TRAFFIC_BYTES


__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Network",
    "check_nodes",
    "default_bucket_bytes",
    "host_reduce_bw",
    "known_networks",
    "load_network",
    "traffic",
]
