"""Benchmark cases of the samplers under load (run by run.py in a fresh process each).

``sampler_load_case`` starts ``trainctl serve --samplers 1`` (dp=1, the embedded model, one
vLLM engine) and measures, over plain HTTP:

- **throughput against concurrency**: the same 32 sample requests, sent with at most ``k``
  in flight, for each ``k``; the engine runs the requests it holds at once (up to
  ``--sampler-concurrency``), so more in flight fill its steps;
- **admission**: ``burst`` requests sent at once to samplers bounded at ``bound``
  (``--sampler-max-queued``): how many were served, how many answered 429 and how fast, and
  how long a weight sync and a sample sent right after the burst took;
- **a client that leaves**: a request of 500 prompts x n=64 x 64 new tokens (minutes of
  engine work) whose client gives up after 1 s: how long until the engine holds no request,
  and how long a weight sync sent then takes.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REQUEST: dict[str, Any] = {
    "prompts": [[1, 2, 3, 4], [5, 6, 7]], "n": 4, "max_tokens": 32, "temperature": 1.0,
}  # fmt: skip
"""One request of the throughput runs: 2 prompts x 4 completions x 32 new tokens."""

SMALL: dict[str, Any] = {"prompts": [[1, 2, 3]], "max_tokens": 16}
"""One request of the burst."""


def _percentile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _throughput(url: str, in_flight: int, requests: int) -> dict[str, float]:
    import httpx

    gate = asyncio.Semaphore(in_flight)
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(seed: int) -> None:
            nonlocal tokens
            async with gate:
                t0 = time.perf_counter()
                r = await http.post("/v1/sample", json={**REQUEST, "seed": seed})
                latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            tokens += sum(len(c["tokens"]) for s in r.json()["samples"] for c in s["completions"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return {
        "in_flight": in_flight,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "p50_s": statistics.median(latencies),
        "max_s": max(latencies),
    }


async def _burst(url: str, burst: int) -> dict[str, Any]:
    import httpx

    answers: list[tuple[int, float, bool]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(seed: int) -> None:
            t0 = time.perf_counter()
            r = await http.post("/v1/sample", json={**SMALL, "seed": seed})
            answers.append((r.status_code, time.perf_counter() - t0, "retry-after" in r.headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(burst)))
        wall = time.perf_counter() - t0
    codes: dict[int, int] = {}
    for code, _, _ in answers:
        codes[code] = codes.get(code, 0) + 1
    limited = [s for code, s, _ in answers if code == 429]
    served = [s for code, s, _ in answers if code == 200]
    return {
        "codes": {str(k): v for k, v in sorted(codes.items())},
        "retry_after": all(h for code, _, h in answers if code == 429),
        "burst_s": wall,
        "limited_p50_s": _percentile(limited, 0.5),
        "limited_p99_s": _percentile(limited, 0.99),
        "served_p50_s": _percentile(served, 0.5),
        "served_max_s": max(served, default=float("nan")),
    }


BIG: dict[str, Any] = {"prompts": [[1, 2, 3]] * 500, "n": 64, "max_tokens": 64, "seed": 1}
"""The request whose client leaves: 32,000 sequences."""


def _leaver(url: str, tc: Any) -> dict[str, float]:
    import httpx

    try:
        httpx.post(f"{url}/v1/sample", json=BIG, timeout=1.0)
        raise RuntimeError("the big sample answered within a second: it measures nothing")
    except httpx.ReadTimeout:
        left = time.perf_counter()

    def in_flight() -> int:
        return sum(e.in_flight for e in tc.info().samplers.engines)

    while in_flight() and time.perf_counter() - left < 600:
        time.sleep(0.02)
    stopped = time.perf_counter()
    tc.sync_weights()
    return {
        "stopped_after_s": stopped - left,
        "sync_after_s": time.perf_counter() - stopped,
    }


def sampler_load_case(in_flight: list[int], requests: int, burst: int, bound: int) -> dict:
    from trainctl.local import LocalService

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * burst)), hard))
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "manual",
                 "--sampler-max-queued", str(bound))  # fmt: skip
        svc = LocalService(Path(tmp) / "data", *flags, start_timeout_s=900)
        with svc, svc.client() as tc:
            tc.sync_weights()
            tc.sample([[1, 2]], max_tokens=4)  # warm
            runs = [asyncio.run(_throughput(svc.url, k, requests)) for k in in_flight]
            burst_run = asyncio.run(_burst(svc.url, burst))
            t0 = time.perf_counter()
            tc.sync_weights()
            burst_run["sync_after_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            tc.sample([[1, 2, 3]], max_tokens=16)
            burst_run["sample_after_s"] = time.perf_counter() - t0
            leaver = _leaver(svc.url, tc)
    return {
        "throughput": runs,
        "burst": burst_run,
        "leaver": leaver,
        "bound": bound,
        "burst_size": burst,
    }
