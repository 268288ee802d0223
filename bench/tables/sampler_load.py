"""The ``sampler_load`` table of ``bench/run.py``: one vLLM engine's throughput as more
requests are in flight, and a burst of samples past the admission bound."""

from __future__ import annotations

from typing import Any

from bench.sampler_load_cases import BIG, REQUEST, SMALL
from bench.tables.common import measure, table


def section(quick: bool) -> str:
    in_flight, requests, burst, bound = ([1, 8], 8, 200, 64) if quick else (
        [1, 4, 16, 32], 32, 2000, 256)  # fmt: skip
    r: dict[str, Any] = measure(
        "sampler_load_case", "sampler_load_cases",
        in_flight=in_flight, requests=requests, burst=burst, bound=bound,
    )  # fmt: skip
    base = r["throughput"][0]["tokens_per_s"]
    rows = [
        [str(t["in_flight"]), f"{t['tokens_per_s']:.0f}", f"{t['tokens_per_s'] / base:.1f}x",
         f"{t['wall_s']:.2f}", f"{t['p50_s']:.2f}", f"{t['max_s']:.2f}"]
        for t in r["throughput"]
    ]  # fmt: skip
    b = r["burst"]
    shape = f"{len(REQUEST['prompts'])} prompts x n={REQUEST['n']} x {REQUEST['max_tokens']}"
    heads = ["k in flight", "tokens/s", "vs k=1", "wall s", "p50 latency s", "max latency s"]
    text = (
        "### Samplers under load: `trainctl serve --samplers 1` (dp=1, the embedded model, one "
        "vLLM engine, fp32, CPU), plain HTTP\n\n"
        f"Throughput: the same {requests} requests ({shape} new tokens each), at most k in "
        "flight; the engine runs every request it holds at once (`--sampler-concurrency` 64), "
        "so their sequences share its steps.\n\n" + table(heads, rows)
    )
    codes = ", ".join(f"{v} x {k}" for k, v in b["codes"].items())
    heads = ["answers", "429s with Retry-After", "429 p50 s", "429 p99 s", "200 p50 s",
             "200 max s", "burst s", "sync right after s", "sample right after s"]  # fmt: skip
    seconds = ("limited_p50_s", "limited_p99_s", "served_p50_s", "served_max_s", "burst_s",
               "sync_after_s", "sample_after_s")  # fmt: skip
    row = [codes, "all" if b["retry_after"] else "NOT ALL"] + [f"{b[k]:.2f}" for k in seconds]
    text += (
        f"\n\nAdmission: {r['burst_size']:,} samples ({len(SMALL['prompts'])} prompt x "
        f"{SMALL['max_tokens']} tokens) sent at once to samplers bounded at "
        f"`--sampler-max-queued {r['bound']}`.\n\n" + table(heads, [row])
    )
    gone = r["leaver"]
    big = f"{len(BIG['prompts'])} prompts x n={BIG['n']} x {BIG['max_tokens']} new tokens"
    text += (
        f"\n\nA client that leaves: a sample of {big} whose HTTP client gives up after 1 s; "
        "the gateway cancels it and the engine aborts its sequences.\n\n"
        + table(
            ["engine holds no request s after the client left", "a sync sent then s"],
            [[f"{gone['stopped_after_s']:.2f}", f"{gone['sync_after_s']:.2f}"]],
        )
    )
    return text
