"""The ``gateway`` table of ``bench/run.py``."""

from __future__ import annotations

from bench.tables.common import measure, table


def section(quick: bool) -> str:
    n_seqs, seq_len, steps = (16, 1024, 2) if quick else (64, 1024, 5)
    direct = measure("direct_step_case", "api_cases", n_seqs=n_seqs, seq_len=seq_len, steps=steps)
    served = measure(
        "gateway_case", "api_cases", n_seqs=n_seqs, seq_len=seq_len, steps=steps,
        trivial=50 if quick else 300,
    )  # fmt: skip
    ratio = served["step_s"] / direct["step_s"]
    inside = served["step_s"] - served["outside_engine_s"]
    rows = [
        ["direct engine call in one process (plan + step)", f"{direct['step_s'] * 1e3:.0f}",
         "1.00", "-"],
        ["through the gateway (SDK, HTTP, Serve, controller, rank)",
         f"{served['step_s'] * 1e3:.0f}", f"{ratio:.3f}", "< 1.10"],
        ["... of which outside the engine (client, gateway, controller, Ray)",
         f"{served['outside_engine_s'] * 1e3:.0f}",
         f"{served['step_s'] / inside:.3f} of the in-service engine time", "< 1.10"],
    ]  # fmt: skip
    trivial = table(
        ["trivial call", "p50 ms", "p99 ms"],
        [
            ["GET /v1/health (gateway only)", f"{served['health_p50_ms']:.1f}",
             f"{served['health_p99_ms']:.1f}"],
            ["eval_batch of 3 tokens (controller + rank)", f"{served['tiny_eval_p50_ms']:.1f}",
             f"{served['tiny_eval_p99_ms']:.1f}"],
        ],
    )  # fmt: skip
    head = (
        f"### Gateway overhead: train_batch of {n_seqs} x {seq_len} = "
        f"{n_seqs * seq_len // 1024}K tokens on the embedded model, dp=1, one thread, median of "
        f"{steps} steps\n\n"
        "The direct call and the rank inside the service run the same engine code on one "
        "thread; on this 2-core machine the rank shares the cores with Ray's daemons, so its "
        "compute time varies by about 10% from run to run. The last row separates what the "
        "service adds (per-call time outside the engine, from the step's own timings).\n\n"
    )
    return head + table(["path", "ms", "ratio", "target"], rows) + "\n\n" + trivial
