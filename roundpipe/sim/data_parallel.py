"""Multi-node data parallelism: one node's simulated step, stretched by the gradient reduction.

``N`` nodes each run the same pipeline on ``global_batch / N`` sequences and reduce the fp32
gradients, which live in host RAM, with gloo over the inter-node network (``network.py``). The
replay follows the runtime's reducer (``roundpipe/distributed/reducer.py``):

- **Buckets**: the trainable layers in canonical order (the highest first), whole layers, a run
  closed once it holds at least ``bucket_bytes`` (25 MiB, ``RunConfig.dp_bucket_bytes``; a larger
  layer goes alone) and, when sharded, where the owning node changes. A bucket is issued once
  every layer in it is final *and* every bucket before it is issued (gloo matches collectives by
  issue order), so it can wait for a later gradient.
- **When a gradient is final**: from the single-node simulation's timeline, when the last
  ``download`` span of an operation that backpropagates the layer ends (its ``optim`` span starts
  then or later).
- **The network** runs one collective at a time, whichever can start first (a tie goes to the
  gradients).
- **Not sharded**: each bucket is all-reduced; one reduction thread per node takes the buckets in
  order, waits for each and steps its layers (the sync optimizer's eager steps, each as long as
  in the single-node step).
- **``optimizer_sharding: nodes``**: node ``k`` owns a contiguous run of layers with about
  ``1/N`` of the bytes (``DataParallel.owners``). Each bucket is reduced to its owner (gloo:
  reduce-scatter, then a gather to the root), the owner steps it and starts the broadcast of the
  new fp32 masters (gloo: a binomial tree of the whole bucket), which stays in flight while the
  reduction thread goes on to the next bucket; the step ends when the last broadcast has arrived.
  Every node keeps the fp32
  masters (the broadcast writes them); the moments (8 of AdamW's 12 bytes per parameter,
  ``partition/cost.py``) live on the owner only, so host RAM falls by ``moments x (N - 1) / N``
  per node on average (the fullest owner is reported too).

The step: ``sync`` optimizer, ``max(single-node step, the reduction thread's end)``; ``async``
(one step stale) gives the reduction the next step too: ``max(single-node step, network busy
time, the thread's end / 2)``. Tokens/s counts the global batch; the scaling efficiency is
``tokens/s / (N x the single node's tokens/s)`` for the same per-node pipeline, i.e. what the
network costs. ``bottleneck`` is ``"reduction"`` when the network's busy time exceeds the backward
it can hide behind (first to last gradient final), else ``"pipeline"``.

Not modelled: the collectives of the two process groups (gradients, weights) sharing the link at
once (here they take turns), the reduction competing with the optimizer and the copy engines for
host memory bandwidth, stragglers (every node runs the identical step), the receivers' refresh of
their compute copies. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import FP32, GRAD_HOST_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM
from roundpipe.presets import Server
from roundpipe.schedule.flow import device_flows
from roundpipe.schedule.table import ScheduleTable
from roundpipe.sim.network import (
    Network,
    check_nodes,
    default_bucket_bytes,
    host_reduce_bw,
    known_networks,
    load_network,
)
from roundpipe.sim.options import SimOptions
from roundpipe.sim.result import SimResult
from roundpipe.sim.workload import Workload

SHARDING_CHOICES = ("none", "nodes")
MOMENT_BYTES_PER_PARAM = (
    OPTIMIZER_BYTES_PER_PARAM - FP32
)  # AdamW exp_avg + exp_avg_sq; the rest is the master


@dataclass(frozen=True)
class LayerGradient:
    """One trainable layer of the single-node step: its index in the layer list, when its fp32
    gradient is final on the host (seconds from the step's start), its bytes, and how long its
    optimizer step took."""

    index: int
    name: str
    ready_s: float
    nbytes: int
    step_s: float


@dataclass(frozen=True)
class NodeStep:
    """What the replay needs of one node's simulated step."""

    step_s: float  # the single-node step (its period, under the async optimizer)
    tokens_per_step: float
    last_update_s: float  # end of the last optimizer step of the (first) step
    optimizer: str  # "sync" | "async"
    host_bytes: int  # peak host RAM of the node (model state + hand-offs), the simulator's figure
    moment_bytes: int  # AdamW moments of every trainable parameter
    layers: tuple[LayerGradient, ...]  # canonical order: the highest layer first

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def grad_bytes(self) -> int:
        return sum(g.nbytes for g in self.layers)

    @property
    def backward_window_s(self) -> float:
        """From the first gradient final to the last: the backward a reduction can hide behind."""
        if not self.layers:
            return 0.0
        return max(g.ready_s for g in self.layers) - min(g.ready_s for g in self.layers)


def node_step(result: SimResult, workload: Workload, table: ScheduleTable) -> NodeStep:
    """The per-layer gradient times of ``result``, a simulation of ``table`` with ``workload``
    (``record_timeline=True``).

    A layer's gradient is final when the last download of it in the step lands (the ``download``
    spans of the operations that backpropagate it, their first occurrence: the first step of an
    async run); a trainable layer that moves no gradient bytes is final when its optimizer step
    starts. Raises :class:`ConfigError` when the result has no timeline or misses a trainable
    layer's optimizer step (simulated with ``optimizer_time=False``)."""
    if result.raw_spans is None:
        raise ConfigError(
            "the multi-node prediction needs the step's timeline: simulate with record_timeline=True"
        )
    grads_of = {
        op.label: op.work.bwd_layers for row in device_flows(table) for op in row if op.work.weight_grads
    }
    steps: dict[str, tuple[float, float]] = {}
    downloads: dict[str, float] = {}
    for _dev, _lane, name, kind, start, end in result.raw_spans:
        if kind == "optim" and name.startswith("step:"):
            steps.setdefault(name[5:], (start, end))
        elif kind == "download" and name.startswith("grad:"):
            downloads.setdefault(name[5:], end)
    final: dict[int, float] = {}
    for label, end in downloads.items():
        for i in grads_of.get(label, ()):
            final[i] = max(final.get(i, 0.0), end)
    layers = []
    for i, lw in enumerate(workload.layers):
        if lw.trainable_params <= 0:
            continue
        if lw.name not in steps:
            raise ConfigError(
                f"the simulated step has no optimizer step for {lw.name}; simulate with optimizer_time=True"
            )
        start, end = steps[lw.name]
        nbytes = lw.trainable_params * GRAD_HOST_BYTES_PER_PARAM
        layers.append(LayerGradient(i, lw.name, min(final.get(i, start), start), nbytes, end - start))
    trainable = sum(lw.trainable_params for lw in workload.layers)
    return NodeStep(
        step_s=result.iteration_s,
        tokens_per_step=result.tokens_per_s * result.iteration_s,
        last_update_s=max((steps[g.name][1] for g in layers), default=0.0),
        optimizer=result.optimizer,
        host_bytes=result.peak_host_bytes,
        moment_bytes=trainable * MOMENT_BYTES_PER_PARAM,
        layers=tuple(reversed(layers)),
    )


def owners(layers: tuple[LayerGradient, ...], nodes: int) -> list[int]:
    """The node that owns (steps) each layer when sharded: contiguous runs in canonical order with
    about equal bytes, the runtime's rule (a layer goes to the node its middle byte falls in)."""
    total = sum(g.nbytes for g in layers) or 1
    out, before = [], 0
    for g in layers:
        out.append(min(nodes - 1, int((before + g.nbytes / 2) * nodes / total)))
        before += g.nbytes
    return out


@dataclass(frozen=True)
class Bucket:
    """Whole layers reduced together (indexes into ``NodeStep.layers``), stepped by ``owner``."""

    layers: tuple[int, ...]
    nbytes: int
    ready_s: float  # when its last layer is final
    owner: int = 0


def buckets(
    layers: tuple[LayerGradient, ...], bucket_bytes: int, owner_of: list[int] | None = None
) -> list[Bucket]:
    """The runtime's buckets (``reducer.plan_buckets``): runs of whole layers in canonical order,
    closed once a run holds ``bucket_bytes`` or more, or where ``owner_of`` changes."""
    if bucket_bytes < 1:
        raise ConfigError(f"bucket bytes must be >= 1, got {bucket_bytes}")
    owner_of = owner_of or [0] * len(layers)
    out: list[Bucket] = []
    run: list[int] = []

    def close():
        if run:
            members = tuple(run)
            nbytes = sum(layers[i].nbytes for i in members)
            out.append(Bucket(members, nbytes, max(layers[i].ready_s for i in members), owner_of[members[0]]))
            run.clear()

    for i in range(len(layers)):
        if run and (owner_of[i] != owner_of[run[0]] or sum(layers[j].nbytes for j in run) >= bucket_bytes):
            close()
        run.append(i)
    close()
    return out


@dataclass(frozen=True)
class Replay:
    """When the network and the reduction thread ran after the gradients became final."""

    end_s: float  # the reduction's end: the last step (sharded: or the last broadcast, if later)
    reduce_s: float  # network busy time of the gradient collectives
    broadcast_s: float  # network busy time of the new weights' broadcasts (sharded only)
    overlapped_s: float  # network busy time before the single-node step would have ended
    num_buckets: int


def replay(
    step: NodeStep,
    nodes: int,
    network: Network,
    reduce_bw: float,
    *,
    sharded: bool = False,
    bucket_bytes: int | None = None,
) -> Replay:
    """Replay the reductions and optimizer steps of ``step`` on ``nodes`` nodes (module docstring)."""
    check_nodes(nodes)
    if nodes == 1:
        return Replay(step.last_update_s, 0.0, 0.0, 0.0, 0)
    owner_of = owners(step.layers, nodes) if sharded else None
    cut = buckets(step.layers, bucket_bytes or default_bucket_bytes(), owner_of)
    issued, t = [], 0.0
    for b in cut:  # in order: a bucket waits for every bucket before it
        t = max(t, b.ready_s)
        issued.append(t)
    reduce_kind = "reduce" if sharded else "all_reduce"
    free = reduce_s = broadcast_s = overlapped = thread = 0.0
    reduced: list[float] = []

    def run(start: float, dur: float) -> float:
        nonlocal overlapped
        overlapped += max(0.0, min(start + dur, step.step_s) - start)
        return start + dur

    def next_reduce() -> None:
        nonlocal free, reduce_s
        k = len(reduced)
        dur = network.time(reduce_kind, cut[k].nbytes, nodes, reduce_bw)
        free = run(max(free, issued[k]), dur)
        reduce_s += dur
        reduced.append(free)

    for k, b in enumerate(cut):  # the reduction thread, bucket after bucket
        while len(reduced) <= k:
            next_reduce()
        thread = max(thread, reduced[k]) + sum(step.layers[i].step_s for i in b.layers)
        if sharded:  # the owner's new weights to everyone; later gradients go first if they can
            while len(reduced) < len(cut) and max(free, issued[len(reduced)]) <= max(free, thread):
                next_reduce()
            dur = network.time("broadcast", b.nbytes, nodes)
            free = run(max(free, thread), dur)  # in flight: the thread goes on to the next bucket
            broadcast_s += dur
    return Replay(max(thread, free) if sharded else thread, reduce_s, broadcast_s, overlapped, len(cut))


@dataclass(frozen=True)
class MultiNodePrediction:
    """The figures of one multi-node configuration (times in seconds, memory in bytes)."""

    nodes: int
    network: str
    algorithm: str
    bandwidth: float  # achieved bytes/s
    latency_s: float
    sharded: bool
    grad_bytes: int  # fp32 gradient bytes each node reduces per step
    num_buckets: int
    reduce_s: float  # network busy time: the gradient collectives
    broadcast_s: float  # network busy time: the new weights' broadcasts (sharded)
    overlapped_s: float  # of the network's busy time, what ran while the pipeline still computed
    backward_window_s: float
    exposed_s: float  # how much longer the step is than one node's
    node_step_s: float
    step_s: float
    node_tokens_per_s: float
    tokens_per_s: float
    scaling_efficiency: float
    host_bytes_per_node: int  # with the sharding chosen
    host_bytes_unsharded: int
    host_bytes_sharded: int  # on average (the moments split evenly)
    host_bytes_sharded_max: int  # on the node that owns the most bytes
    moment_bytes: int
    bottleneck: str  # "pipeline" | "reduction"
    notes: tuple[str, ...] = field(default=())

    @property
    def comm_s(self) -> float:
        return self.reduce_s + self.broadcast_s

    def to_dict(self) -> dict:
        return {
            "nodes": self.nodes,
            "network": self.network,
            "algorithm": self.algorithm,
            "bandwidth_bytes_per_s": self.bandwidth,
            "latency_s": self.latency_s,
            "optimizer_sharding": "nodes" if self.sharded else "none",
            "grad_bytes_per_step": self.grad_bytes,
            "num_buckets": self.num_buckets,
            "reduction_s": self.reduce_s,
            "broadcast_s": self.broadcast_s,
            "overlapped_s": self.overlapped_s,
            "backward_window_s": self.backward_window_s,
            "exposed_s": self.exposed_s,
            "node_step_s": self.node_step_s,
            "step_s": self.step_s,
            "node_tokens_per_s": self.node_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "scaling_efficiency": self.scaling_efficiency,
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_bytes_per_node_unsharded": self.host_bytes_unsharded,
            "host_bytes_per_node_sharded": self.host_bytes_sharded,
            "host_bytes_per_node_sharded_max": self.host_bytes_sharded_max,
            "optimizer_moment_bytes": self.moment_bytes,
            "bottleneck": self.bottleneck,
            "notes": list(self.notes),
        }


def check_sharding(value: str | bool | None) -> bool:
    """``"nodes"`` (or True) -> sharded, ``"none"`` / None / False -> not; else :class:`ConfigError`."""
    if value is None or value is False or value == "none":
        return False
    if value is True or value == "nodes":
        return True
    raise ConfigError(f"unknown optimizer sharding {value!r}; choose one of {', '.join(SHARDING_CHOICES)}")


def predict(
    step: NodeStep,
    nodes: int,
    network: Network | str,
    reduce_bw: float,
    *,
    sharding: str | bool | None = None,
    bucket_bytes: int | None = None,
) -> MultiNodePrediction:
    """The multi-node figures of ``step`` (one node's pipeline on its share of the batch)."""
    check_nodes(nodes)
    net = load_network(network)
    sharded = check_sharding(sharding)
    if not reduce_bw > 0:
        raise ConfigError(f"the host reduce rate must be > 0 bytes/s, got {reduce_bw!r}")
    rep = replay(step, nodes, net, reduce_bw, sharded=sharded, bucket_bytes=bucket_bytes)
    if nodes == 1:
        step_s = step.step_s
    elif step.optimizer == "async":
        step_s = max(step.step_s, rep.reduce_s + rep.broadcast_s, rep.end_s / 2)
    else:
        step_s = max(step.step_s, rep.end_s)
    tokens = nodes * step.tokens_per_step / step_s if step_s > 0 else 0.0
    node_tokens = step.tokens_per_s
    saved = step.moment_bytes * (nodes - 1) // nodes
    owned = [0] * nodes
    for g, o in zip(step.layers, owners(step.layers, nodes)):
        owned[o] += g.nbytes // GRAD_HOST_BYTES_PER_PARAM * MOMENT_BYTES_PER_PARAM
    window = step.backward_window_s
    comm = rep.reduce_s + rep.broadcast_s
    return MultiNodePrediction(
        nodes=nodes,
        network=net.name,
        algorithm=net.algorithm,
        bandwidth=net.bandwidth,
        latency_s=net.latency_s,
        sharded=sharded,
        grad_bytes=step.grad_bytes,
        num_buckets=rep.num_buckets,
        reduce_s=rep.reduce_s,
        broadcast_s=rep.broadcast_s,
        overlapped_s=rep.overlapped_s,
        backward_window_s=window,
        exposed_s=step_s - step.step_s,
        node_step_s=step.step_s,
        step_s=step_s,
        node_tokens_per_s=node_tokens,
        tokens_per_s=tokens,
        scaling_efficiency=tokens / (nodes * node_tokens) if node_tokens > 0 else 0.0,
        host_bytes_per_node=step.host_bytes - (saved if sharded else 0),
        host_bytes_unsharded=step.host_bytes,
        host_bytes_sharded=step.host_bytes - saved,
        host_bytes_sharded_max=step.host_bytes - step.moment_bytes + max(owned),
        moment_bytes=step.moment_bytes,
        bottleneck="reduction" if nodes > 1 and comm > window else "pipeline",
    )


def lifting_network(
    step: NodeStep, nodes: int, network: Network, reduce_bw: float, *, sharding: str | bool | None = None
) -> MultiNodePrediction | None:
    """The prediction on the slowest preset network faster than ``network`` on which the step is
    pipeline-bound (None: on none of them)."""
    for name in known_networks():
        candidate = load_network(name, network.algorithm)
        if candidate.bandwidth <= network.bandwidth:
            continue
        pred = predict(step, nodes, candidate, reduce_bw, sharding=sharding)
        if pred.bottleneck == "pipeline":
            return pred
    return None


def bottleneck_line(pred: MultiNodePrediction, lift: MultiNodePrediction | None) -> str:
    """One sentence: what bounds the step and, when it is the reduction, what network lifts it."""
    if pred.bottleneck == "pipeline":
        return (
            f"the pipeline, not the reduction, bounds the step: {pred.comm_s:.2f} s of network time fits in "
            f"the {pred.backward_window_s:.2f} s of backward it hides behind"
        )
    what = (
        f"the reduction, not the pipeline, bounds the step on {pred.network}: {pred.comm_s:.2f} s of network "
        f"time against {pred.backward_window_s:.2f} s of backward to hide it behind"
    )
    if lift is not None:
        return (
            f"{what}; {lift.network} would lift it ({lift.tokens_per_s:,.0f} tokens/s, "
            f"{lift.scaling_efficiency:.1%} scaling efficiency)"
        )
    return (
        f"{what}; no preset network lifts it: train LoRA adapters, use fewer nodes or a larger batch per node "
        f"(more backward to hide behind)"
    )


def simulate_for_nodes(prepared, options: SimOptions | None = None) -> SimResult:
    """Simulate ``prepared`` (a ``scenario.Prepared``) with the timeline the replay reads."""
    from roundpipe.sim.simulator import simulate

    opts = replace(options or SimOptions(), optimizer=prepared.scenario.optimizer, record_timeline=True)
    return simulate(prepared.table, prepared.workload, prepared.hardware, opts, notes=prepared.notes)


def predict_prepared(
    prepared,
    nodes: int,
    network: Network | str,
    *,
    sharding: str | bool | None = None,
    options: SimOptions | None = None,
) -> tuple[SimResult, NodeStep, MultiNodePrediction]:
    """Simulate one node's pipeline (``prepared``: its share of the batch) and predict ``nodes`` of them."""
    result = simulate_for_nodes(prepared, options)
    step = node_step(result, prepared.workload, prepared.table)
    server: Server = prepared.hardware
    return result, step, predict(step, nodes, network, host_reduce_bw(server), sharding=sharding)


def local_batch(global_batch: int, nodes: int) -> int:
    """Sequences per node: ``global_batch / nodes``, which must be whole."""
    check_nodes(nodes)
    if global_batch % nodes:
        lower = global_batch - global_batch % nodes
        raise ConfigError(
            f"a global batch of {global_batch} sequences does not split evenly over {nodes} nodes; "
            f"use a multiple of {nodes} (e.g. {lower or nodes} or {lower + nodes})"
        )
    return global_batch // nodes


__all__ = [
    "Bucket",
    "LayerGradient",
    "MultiNodePrediction",
    "NodeStep",
    "Replay",
    "bottleneck_line",
    "buckets",
    "check_sharding",
    "lifting_network",
    "local_batch",
    "node_step",
    "owners",
    "predict",
    "predict_prepared",
    "replay",
    "simulate_for_nodes",
]
