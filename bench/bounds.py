"""Bounded tables: 100,000 calls into each in-memory table, and the process RSS after
10,000 and after 100,000 (flat = bounded).

    python bench/bounds.py            # 100,000 calls per table
    python bench/bounds.py --quick    # 20,000

Runs the real classes in this process, without Ray or HTTP: the controller's operation
queue (finished operations and their idempotency keys) and the gateway's Tinker state
(sessions, futures, a model's seq_id dedup window). Writes bench/results/bounds.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _operations(n: int, probe: Callable[[int], None]) -> int:
    """``n`` keyed operations, each holding a 64 KiB request until it finishes."""
    from trainctl.api import OperationKind
    from trainctl.workers.control.op_queue import OperationQueue

    q = OperationQueue(max_queued=64)
    for i in range(n):
        request = bytearray(64 << 10)

        async def run(_: Any, request: bytearray = request) -> int:
            return len(request)

        q.submit(OperationKind.TRAIN_BATCH, run, key=f"k{i}", fingerprint=str(i))
        del request, run
        if q.depth >= 32:
            await q.idle()
        probe(i + 1)
    await q.idle()
    return len(q._ops)


async def _sessions(n: int, probe: Callable[[int], None]) -> int:
    from trainctl.service.tinker.state import TinkerState

    state = TinkerState()
    for i in range(n):
        state.add_model(state.create_session(), 0)
        probe(i + 1)
    return len(state.sessions) + len(state.models)


async def _futures(n: int, probe: Callable[[int], None]) -> int:
    """``n`` requests of one model in seq_id order, each with a 16 KiB result."""
    from trainctl.service.tinker.state import TinkerState

    state = TinkerState()
    model = state.add_model(state.create_session(), 0)
    for i in range(1, n + 1):

        async def admit() -> Awaitable[Any]:
            return asyncio.sleep(0, bytes(16 << 10))

        f = state.submit(model, i, str(i), "forward_backward", admit)
        await f.done.wait()
        probe(i)
    return len(state.futures) + len(model.seen)


Table = Callable[[int, Callable[[int], None]], Coroutine[Any, Any, int]]
TABLES: dict[str, tuple[str, Table]] = {
    "operations": ("finished operations and idempotency keys (controller)", _operations),
    "sessions": ("Tinker sessions and model handles (gateway)", _sessions),
    "futures": ("Tinker futures and the seq_id dedup window (gateway)", _futures),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n = 20_000 if args.quick else 100_000
    warm = n // 10
    rows = []
    for name, (what, fn) in TABLES.items():
        marks: dict[int, float] = {}

        def probe(i: int, marks: dict[int, float] = marks) -> None:
            if i in (warm, n):
                gc.collect()
                marks[i] = rss_mib()

        held: int = asyncio.run(fn(n, probe))
        rows.append((what, marks[warm], marks[n], held))
        print(f"{name}: {marks[warm]:.1f} -> {marks[n]:.1f} MiB, {held} entries held")
    table = [
        f"#### Bounded tables: RSS of this process after {warm:,} and after {n:,} calls "
        "into each table (real classes, in process)",
        "",
        f"| table | RSS after {warm:,} (MiB) | RSS after {n:,} (MiB) | growth (MiB) | "
        "entries held at the end |",
        "|---|---|---|---|---|",
    ]
    for what, a, b, held in rows:
        table.append(f"| {what} | {a:.1f} | {b:.1f} | {b - a:+.1f} | {held:,} |")
    text = "\n".join(table) + "\n"
    print(text)
    if not args.quick:
        (ROOT / "bench" / "results" / "bounds.md").write_text(text)


if __name__ == "__main__":
    main()
