"""The ``load`` table of ``bench/run.py``."""

from __future__ import annotations

from typing import Any

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    duration, clients = (15.0, 4) if quick else (60.0, 8)
    r: Any = measure("load_case", "api_cases", duration_s=duration, clients=clients)
    rows = [
        [kind, str(r[kind]["n"]), f"{r[kind]['p50_ms']:.0f}", f"{r[kind]['p95_ms']:.0f}",
         f"{r[kind]['p99_ms']:.0f}"]
        for kind in ("train_batch", "eval_batch", "logprobs") if kind in r
    ]  # fmt: skip
    errors = ", ".join(f"{k}: {n}" for k, n in sorted(r["errors"].items())) or "none"
    head = (
        f"### Load run: {clients} concurrent clients for {duration:.0f} s against `trainctl "
        "serve` (dp=2), each call a random train_batch, eval_batch or logprobs of 4 sequences "
        "of 16-255 tokens; no client retries\n\n"
        f"served {r['served']} requests ({r['served'] / duration:.1f}/s), {r['steps']} optimizer "
        f"steps; errors by type: {errors}; 5xx: {r['errors_5xx']} (target 0)\n\n"
    )
    return head + table(["call", "served", "p50 ms", "p95 ms", "p99 ms"], rows)
