"""``roundpipe plan``: which policy, partition and microbatch count to use (the tuner), or with
``--max-seq-len`` the longest sequence that fits.

Examples::

    roundpipe plan --model qwen3-235b-a22b --hardware 8xrtx4090 --seq-len 4096 --lora-rank 16
    roundpipe plan --model qwen3-8b --hardware 8xrtx4090 --max-seq-len --json
    roundpipe plan --model qwen3-1.7b --max-seq-len --dtype fp16 --rope-scaling yarn:2
    roundpipe plan --model qwen3-32b --hardware 8xrtx4090 --seq-len 4096 --nodes 2 --network 100gbe

Prints the best plan and a ranked table of alternatives, or with ``--json`` one JSON object (the
best plan's policy, num_microbatches, tokens_per_s, iteration_s, bubble_fraction, peak_gpu_bytes,
peak_host_bytes, fits, plus ``alternatives``; with ``--max-seq-len``, ``max_seq_len``, the
``binding_limit`` (GPU memory, host RAM or position embeddings), ``binding_detail`` in figures and,
when the positions bind, ``memory_max_seq_len``: how long a sequence memory alone would allow).

``--nodes N`` (default 1: nothing changes) plans one node's pipeline on ``global_batch / N``
sequences, then predicts ``N`` such servers reducing their fp32 CPU gradients over ``--network``
(a preset or ``BW_GBPS:LATENCY_US``), optionally with ``--optimizer-sharding nodes``
(``sim/data_parallel.py``): printed after the plan, and under ``multinode`` in the JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import cast

from roundpipe.commands.model_args import (
    HOST_HELP,
    add_model_args,
    host_fields,
    host_text,
    model_settings,
    target,
)
from roundpipe.errors import ConfigError, RoundpipeError
from roundpipe.sim.report import GIB, dumps, result_table
from roundpipe.sim.result import SimResult
from roundpipe.sim.tune import DEFAULT_TIME_BUDGET_S


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="roundpipe plan", description=__doc__.split("\n\n")[0], epilog=HOST_HELP
    )
    add_model_args(ap)
    ap.add_argument("--max-seq-len", action="store_true", help="find the longest sequence that fits instead")
    ap.add_argument("--policies", default=None, help="comma-separated policies to search (default: all)")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help=f"seconds the search may take (default {DEFAULT_TIME_BUDGET_S:.0f})",
    )
    ap.add_argument("--top", type=int, default=12, help="rows of the ranked table to print")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="servers in data parallel, each on global-batch / nodes (default 1)",
    )
    ap.add_argument(
        "--network",
        default="100gbe",
        help="inter-node network for --nodes: 10gbe, 25gbe, 100gbe (default), 200gbe-ib, 400gbe-ib, or "
        "BW_GBPS:LATENCY_US (achieved Gbit/s, microseconds per message step)",
    )
    ap.add_argument("--allreduce", default=None, help="collective algorithm: ring (default) or tree")
    ap.add_argument(
        "--optimizer-sharding",
        default="none",
        help="none (default) or nodes: each node keeps the AdamW moments of and steps 1/N of the layers",
    )
    args = ap.parse_args(argv)
    try:
        from roundpipe.partition.model_plan import EVERY_LAYER
        from roundpipe.sim.data_parallel import check_sharding, local_batch
        from roundpipe.sim.network import check_nodes, load_network
        from roundpipe.sim.seq_limit import max_seq_len
        from roundpipe.sim.tune import format_ranked, tune

        model, server = target(args)
        check_nodes(args.nodes)
        network = load_network(args.network, args.allreduce)
        check_sharding(args.optimizer_sharding)
        settings = model_settings(args)
        if args.nodes > 1:
            if args.max_seq_len:
                raise ConfigError(
                    "--max-seq-len is per server; drop --nodes (the longest sequence does not depend on it)"
                )
            settings["global_batch"] = local_batch(args.global_batch, args.nodes)
        if args.max_seq_len:
            limit = max_seq_len(model, server, **model_settings(args), optimizer=args.optimizer)
            res = limit.result
            if args.json:
                out = {"model": args.model, "hardware": args.hardware}
                out.update(host_fields(server))
                out.update(res.to_dict() if res is not None else {"fits": False})
                out.update(limit.to_dict())
                print(dumps(out))
            else:
                print(
                    f"{args.model} on {args.hardware} ({host_text(server)}): the longest sequence that "
                    f"fits is {limit.tokens:,} tokens ({res.policy if res is not None else 'no plan'})"
                )
                print(f"  binding limit     {limit.binding}: {limit.detail}")
                if res is not None:
                    print(result_table(res))
                stages = limit.plan.stages if limit.plan is not None else None
                if isinstance(stages, tuple):
                    backward = (
                        "one layer per backward stage"
                        if stages[1] == EVERY_LAYER
                        else f"{stages[1]} backward"
                    )
                    print(f"  stages            {stages[0]} forward, {backward}")
                if limit.plan is not None and limit.plan.round_size is not None:
                    print(
                        f"  rounds            of {limit.plan.round_size} microbatches "
                        "(RunConfig.round_size: the host keeps two rounds' stage inputs)"
                    )
            return
        if args.seq_len is None:
            raise ConfigError("give --seq-len N (or --max-seq-len to find the longest that fits)")
        policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
        result = tune(
            model,
            server,
            seq_len=args.seq_len,
            optimizer=args.optimizer,
            policies=policies,
            time_budget_s=args.time_budget,
            **settings,
        )
        multi = _multinode(args, server, result.best, settings, network) if args.nodes > 1 else None
    except (RoundpipeError, ValueError) as err:
        print(f"roundpipe plan: error: {err}", file=sys.stderr)
        sys.exit(2)
    best = result.best
    best_result = cast(SimResult, best.result)  # the tuner simulates every candidate
    if args.json:
        out = {"model": args.model, "hardware": args.hardware, "seq_len": args.seq_len}
        out.update(host_fields(server))
        out.update(best_result.to_dict())
        out.update(best.summary())
        out["alternatives"] = [c.summary() for c in result.ranked[1:]]
        out["search_s"] = result.elapsed_s
        out["notes"] = list(result.notes) + list(best_result.notes)
        if multi is not None:
            out["nodes"] = args.nodes
            out["multinode"] = multi
        print(dumps(out))
        return
    tuned = "full" if args.lora_rank is None else f"LoRA r={args.lora_rank}"
    batch = (
        f"batch {args.global_batch}"
        if args.nodes == 1
        else f"batch {settings['global_batch']} per node ({args.global_batch} over {args.nodes} nodes)"
    )
    print(
        f"best plan for {args.model} on {args.hardware} ({host_text(server)}), seq {args.seq_len}, {batch}, {tuned}: "
        f"{best.policy} with {best.num_microbatches} microbatches, {best.stages[0]} forward / {best.stages[1]} backward "
        f"stages, {best.head_shards} head shard(s)"
    )
    print(result_table(best_result))
    print()
    print(f"ranked alternatives (searched {len(result.ranked)} in {result.elapsed_s:.1f} s):")
    print(format_ranked(result, args.top))
    for note in result.notes:
        print(f"note: {note}")
    if multi is not None:
        print()
        print(multinode_table(multi))


def _multinode(args, server, best, settings: dict, network) -> dict:
    """The multi-node prediction of the tuner's ``best`` candidate (re-simulated with its timeline),
    as a dict (``MultiNodePrediction.to_dict`` plus the lifting network and the bottleneck line)."""
    from roundpipe.sim.data_parallel import bottleneck_line, lifting_network, predict_prepared
    from roundpipe.sim.network import host_reduce_bw
    from roundpipe.sim.scenario import Scenario, prepare

    if best.forward is None:
        raise ConfigError(
            f"no plan fits one node, so there is nothing to run on {args.nodes}: {best.result.reason}"
        )
    scenario = Scenario(
        args.model, server, best.policy, seq_len=args.seq_len, microbatches=best.num_microbatches,
        partitions=best.bounds, head_shards=best.head_shards, round_size=best.round_size,
        optimizer=args.optimizer, **settings,
    )  # fmt: skip
    prepared = prepare(scenario)
    result, step, pred = predict_prepared(prepared, args.nodes, network, sharding=args.optimizer_sharding)
    notes = []
    if not math.isclose(result.iteration_s, best.result.iteration_s, rel_tol=1e-9):
        notes.append(
            f"the re-simulated node step ({result.iteration_s:.3f} s) differs from the plan's "
            f"({best.result.iteration_s:.3f} s)"
        )
    lift = None
    if pred.bottleneck == "reduction":
        lift = lifting_network(
            step, args.nodes, network, host_reduce_bw(prepared.hardware), sharding=pred.sharded
        )
    out = pred.to_dict()
    out.update(
        global_batch=args.global_batch,
        batch_per_node=settings["global_batch"],
        hardware_per_node=prepared.hardware.name,
        lifting_network=lift.network if lift is not None else None,
        summary=bottleneck_line(pred, lift),
        notes=notes,
    )
    return out


def multinode_table(m: dict) -> str:
    """The multi-node prediction (``_multinode``'s dict) as a small readable table."""
    sharded = m["optimizer_sharding"] == "nodes"
    other = m["host_bytes_per_node_unsharded" if sharded else "host_bytes_per_node_sharded"]
    lines = [
        f"multi-node: {m['nodes']} x {m['hardware_per_node']} over {m['network']} ({m['algorithm']}, "
        f"{m['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s achieved, {m['latency_s'] * 1e6:.0f} us per step), "
        f"global batch {m['global_batch']} ({m['batch_per_node']} per node)",
        f"  gradients         {m['grad_bytes_per_step'] / 1e9:.2f} GB fp32 per node per step, "
        f"{m['num_buckets']:,} buckets",
        f"  network busy      {m['reduction_s']:.2f} s "
        + (
            f"reduce to the owners + {m['broadcast_s']:.2f} s broadcast of the new weights"
            if sharded
            else "all-reduce"
        )
        + f", {m['overlapped_s']:.2f} s of it while the pipeline computes "
        f"(backward window {m['backward_window_s']:.2f} s)",
        f"  step time         {m['step_s']:.3f} s (one node {m['node_step_s']:.3f} s): "
        f"{m['exposed_s']:.3f} s exposed reduction",
        f"  tokens/s          {m['tokens_per_s']:,.0f} ({m['scaling_efficiency']:.1%} of {m['nodes']} x "
        f"{m['node_tokens_per_s']:,.0f})",
        f"  host memory       {m['host_bytes_per_node'] / GIB:.1f} GiB per node"
        + (
            f" on average, {m['host_bytes_per_node_sharded_max'] / GIB:.1f} GiB on the fullest owner "
            f"(not sharded: {other / GIB:.1f} GiB)"
            if sharded
            else f" (--optimizer-sharding nodes: {other / GIB:.1f} GiB)"
        ),
        f"  bottleneck        {m['bottleneck']}",
        f"  {m['summary']}",
    ]
    lines += [f"  note: {n}" for n in m["notes"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
