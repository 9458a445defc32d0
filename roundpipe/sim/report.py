"""Readable and JSON renderings of simulator results, shared by the CLI and the benchmarks."""

from __future__ import annotations

import json
import math
from typing import Any

from roundpipe.sim.result import SimResult

GIB = 1 << 30


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None, so ``json.dumps`` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(jsonable(value), indent=2)


def _num(x: float, fmt: str) -> str:
    return format(x, fmt) if math.isfinite(x) else "-"


def result_table(r: SimResult, title: str = "") -> str:
    """One simulated step as a small readable table."""
    lines = [title] if title else []
    lines += [
        f"  policy            {r.policy} ({r.optimizer} optimizer), {r.num_devices} devices, {r.num_microbatches} microbatches",
        f"  step time         {_num(r.iteration_s, '.3f')} s",
        f"  tokens/s          {r.tokens_per_s:,.0f}",
        f"  MFU               {r.mfu:.1%}",
        f"  bubble            {_num(r.bubble_total * 100, '.1f')}% idle/total, {_num(r.bubble_ideal * 100, '.1f')}% idle/ideal",
        f"  peak GPU memory   {r.peak_gpu / GIB:.2f} GiB (per device: "
        + ", ".join(f"{b / GIB:.1f}" for b in r.peak_gpu_bytes)
        + ")",
        f"  peak host memory  {r.peak_host_bytes / GIB:.1f} GiB",
        f"  PCIe per step     {r.h2d_bytes / 1e9:.1f} GB up, {r.d2h_bytes / 1e9:.1f} GB down",
        f"  CPU optimizer     {r.optimizer_busy_s:.2f} s busy per step, {r.accumulate_busy_s:.2f} s adding gradients",
        f"  fits              {'yes' if r.fits else 'NO: ' + r.reason}",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


__all__ = ["dumps", "jsonable", "result_table"]
