"""PNG Gantt chart of any :class:`~roundpipe.schedule.timeline.Timeline` (simulated or recorded).

One row per device and lane (``d0 compute``, ``d0 h2d``, ``d0 d2h``, ..., ``host``), one bar per
span, one colour per span kind (legend below the chart). matplotlib is imported inside
:func:`save_gantt` with the Agg backend, so importing this module costs nothing and needs no display.
"""

from __future__ import annotations

from roundpipe.errors import ConfigError
from roundpipe.schedule.deps import TaskKind
from roundpipe.schedule.flow import FUSED
from roundpipe.schedule.timeline import HOST_DEVICE, Timeline

KIND_COLOURS = {
    TaskKind.F: "#4C72B0",
    TaskKind.B: "#DD8452",
    FUSED: "#8172B3",
    TaskKind.I: "#C44E52",
    TaskKind.W: "#937860",
    "upload": "#55A868",
    "act": "#64B5CD",
    "download": "#DA8BC3",
    "stash": "#CCB974",
    "optim": "#8C8C8C",
    "idle": "#EEEEEE",
}
KIND_LABELS = {
    TaskKind.F: "forward",
    TaskKind.B: "backward (+recompute)",
    FUSED: "fused head F+B",
    TaskKind.I: "input grad",
    TaskKind.W: "weight grad",
    "upload": "weights up",
    "act": "activations / grads",
    "download": "weight grads down",
    "stash": "saved inputs down",
    "optim": "CPU optimizer",
}


def rows_of(timeline: Timeline) -> list[tuple[int, str]]:
    """The chart's rows, top to bottom: devices in order with their lanes, the host last."""
    rows = []
    for d in timeline.devices:
        if d == HOST_DEVICE:
            continue
        rows += [(d, lane) for lane in timeline.lanes(d)]
    if HOST_DEVICE in timeline.devices:
        rows += [(HOST_DEVICE, lane) for lane in timeline.lanes(HOST_DEVICE)]
    return rows


def save_gantt(timeline: Timeline, path: str, title: str | None = None, *, width: float = 14.0) -> None:
    """Draw ``timeline`` to ``path`` (PNG). Raises ConfigError for an empty timeline."""
    if not timeline.spans:
        raise ConfigError("the timeline has no spans to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = rows_of(timeline)
    index = {r: i for i, r in enumerate(rows)}
    by_row: dict[tuple[int, str], dict[str, list[tuple[float, float]]]] = {r: {} for r in rows}
    for s in timeline.spans:
        by_row[(s.device, s.lane)].setdefault(s.kind, []).append((s.start, s.duration))
    height = max(2.5, 0.28 * len(rows) + 1.5)
    fig, ax = plt.subplots(figsize=(width, height))
    for row, kinds in by_row.items():
        y = len(rows) - 1 - index[row]
        for kind, bars in kinds.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=KIND_COLOURS.get(kind, "#333333"), linewidth=0)
    labels = ["host" if d == HOST_DEVICE else f"d{d} {lane}" for d, lane in rows]
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels[::-1], fontsize=7)
    ax.set_xlim(0, timeline.makespan * 1.01 or 1.0)
    ax.set_xlabel("seconds from the start of the step")
    ends = timeline.meta.get("iteration_ends") or []
    for t in ends[:-1] if len(ends) > 1 else []:
        ax.axvline(t, color="black", linewidth=0.6, linestyle="--")
    used = sorted(
        {s.kind for s in timeline.spans},
        key=lambda k: list(KIND_COLOURS).index(k) if k in KIND_COLOURS else 99,
    )
    handles = [Patch(color=KIND_COLOURS.get(k, "#333333"), label=KIND_LABELS.get(k, k)) for k in used]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=min(6, len(handles)),
        fontsize=7,
    )
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["KIND_COLOURS", "rows_of", "save_gantt"]
