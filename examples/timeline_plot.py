"""A picture of timelines (``GET /v1/timeline``'s Chrome trace JSON), side by side: one panel a
trace, one line a process (the controller, each rank, each sampler engine), a bar per span of
work, coloured by what it is. ``examples/async_rl.py --timeline`` draws one synchronous and one
asynchronous iteration with it.

    python examples/timeline_plot.py sync.json async.json out.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KINDS = {
    "sample": ("sampling", "tab:blue"),
    "weight_sync": ("weight sync", "tab:green"),
    "sync": ("weight sync", "tab:green"),
}
"""A span's legend and colour by its name; every operation of the trainer is ``training``."""
TRAINING = ("training", "tab:orange")
ROWS = ("controller", "rank", "engine")
"""The rows drawn, in this order (the gateway's spans only wrap the others)."""


def _kind(name: str) -> tuple[str, str]:
    return KINDS.get(name, TRAINING)


def _top_spans(trace: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The rows to draw, and each row's outermost spans (a span whose parent is on another
    row, or none), with the row's name."""
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    rows = [n for n in sorted(names.values(), key=_row_order) if n.split(" ")[0] in ROWS]
    spans = [{**e, "row": names[e["pid"]]} for e in trace["traceEvents"] if e["ph"] == "X"]
    row_of = {e["args"]["span_id"]: e["row"] for e in spans}
    top = [
        e for e in spans
        if e["row"] in rows and row_of.get(e["args"].get("parent_id", "")) != e["row"]
        and e["name"] not in ("queued", "queue", "wait")
    ]  # fmt: skip
    return rows, top


def _row_order(row: str) -> tuple[int, int]:
    kind, _, n = row.partition(" ")
    return (ROWS.index(kind) if kind in ROWS else len(ROWS), int(n) if n.isdigit() else 0)


def draw(traces: dict[str, dict[str, Any]], out: Path) -> None:
    """One panel per trace (its title the key), sharing the time axis's scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, len(traces), figsize=(7 * len(traces), 3.2), squeeze=False)
    spans_of = {title: _top_spans(t) for title, t in traces.items()}
    width = max(
        ((max(e["ts"] + e["dur"] for e in top) - min(e["ts"] for e in top)) / 1e6
         for _, top in spans_of.values() if top),
        default=1.0,  # no spans in any trace: empty panels
    )  # fmt: skip
    for ax, (title, (rows, top)) in zip(axes[0], spans_of.items(), strict=True):
        t0 = min((e["ts"] for e in top), default=0.0)
        for y, row in enumerate(rows):
            for e in (e for e in top if e["row"] == row):
                ax.broken_barh([((e["ts"] - t0) / 1e6, max(e["dur"] / 1e6, width / 500))],
                               (y - 0.35, 0.7), color=_kind(e["name"])[1])  # fmt: skip
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_xlim(0, width)
        ax.set_xlabel("seconds")
        ax.set_title(title)
    legend = {label: colour for label, colour in [*KINDS.values(), TRAINING]}
    fig.legend(handles=[Patch(color=c, label=label) for label, c in legend.items()],
               loc="lower center", ncol=len(legend), frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[-1].strip())
        return 2
    *inputs, out = sys.argv[1:]
    draw({Path(p).stem: json.loads(Path(p).read_text()) for p in inputs}, Path(out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
