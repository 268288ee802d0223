"""What a Tinker sampling client costs to create, as the cookbook's loop creates one: a step,
``save_weights_for_sampler``, then ``create_sampling_client`` on the new path.

    python bench/sampling_client.py             # 30 steps, then 400 creations, 8 at a time
    python bench/sampling_client.py --steps 10

Starts `trainctl serve --dp=1 --max-adapters 2 --samplers 1` (a vLLM engine on the CPU) and
trains a LoRA model through the real ``tinker`` SDK. Each step it times the SDK's
``create_sampling_client`` and a raw ``POST /api/v1/create_sampling_session`` (the server's
part alone), and ``GET /v1/info`` right after (what a creation used to read: every rank hashes
its weights once per step). Then 8 threads create sampling clients for the last path, 50
each. Prints a table and writes bench/results/sampling_client.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables.common import lora_client, publish  # noqa: E402
from trainctl.local import LocalService  # noqa: E402

KEY = "tml-bench-sampling-client"
TOKENS = [5, 17, 3, 9, 22, 41, 7, 8]
THREADS, PER_THREAD = 8, 50


def _ms(xs: list[float]) -> str:
    a = np.array(xs) * 1e3
    return f"{np.median(a):.1f} / {np.percentile(a, 95):.1f} / {a.max():.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    from tinker import types

    with tempfile.TemporaryDirectory(prefix="trainctl-sampling-client-") as tmp:
        svc = LocalService(
            Path(tmp) / "data", "--dp", "1", "--max-adapters", "2", "--samplers", "1",
            start_timeout_s=600,
        )  # fmt: skip
        svc.start()
        try:
            sc, tc, session, datum = lora_client(svc.url, KEY, TOKENS)
            http = httpx.Client(base_url=svc.url, timeout=60, headers={"X-API-Key": KEY})
            sdk, raw, info, floor, seq = [], [], [], [], 10_000
            path = ""
            for i in range(args.steps):
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                path = tc.save_weights_for_sampler(name=f"s{i}").result().path
                t0 = time.perf_counter()
                sc.create_sampling_client(model_path=path).result()
                sdk.append(time.perf_counter() - t0)
                seq += 1
                t0 = time.perf_counter()
                body = {"session_id": session, "sampling_session_seq_id": seq, "model_path": path}
                r = http.post("/api/v1/create_sampling_session", json=body)
                raw.append(time.perf_counter() - t0)
                r.raise_for_status()
                t0 = time.perf_counter()
                http.get("/v1/info").raise_for_status()
                info.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                http.get("/api/v1/healthz").raise_for_status()
                floor.append(time.perf_counter() - t0)

            def creations(k: int) -> list[float]:
                out = []
                with httpx.Client(base_url=svc.url, timeout=60, headers={"X-API-Key": KEY}) as h:
                    for j in range(PER_THREAD):
                        t0 = time.perf_counter()
                        n = 100_000 + k * PER_THREAD + j
                        body = {"session_id": session, "model_path": path,
                                "sampling_session_seq_id": n}  # fmt: skip
                        r = h.post("/api/v1/create_sampling_session", json=body)
                        out.append(time.perf_counter() - t0)
                        r.raise_for_status()
                return out

            t0 = time.perf_counter()
            with ThreadPoolExecutor(THREADS) as pool:
                together = [x for xs in pool.map(creations, range(THREADS)) for x in xs]
            wall = time.perf_counter() - t0
            sc.close("success").result()
        finally:
            svc.stop()
    table = (
        f"### Creating a Tinker sampling client after each of {args.steps} steps (LoRA rank "
        "4, one vLLM engine on the CPU, dp1)\n\n"
        "Milliseconds, median / p95 / max. Sequential: one creation after each step and "
        "`save_weights_for_sampler`, as the cookbook's loop does. `GET /v1/info` right after "
        "the step is what a creation read before issue 65 (every rank hashes its weights "
        f"once per step). Concurrent: {THREADS} threads, {PER_THREAD} creations each, for the "
        "last path.\n\n"
        "| call | concurrency | ms: median / p95 / max |\n|---|---|---|\n"
        f"| SDK `create_sampling_client` | 1 | {_ms(sdk)} |\n"
        f"| `POST /api/v1/create_sampling_session` | 1 | {_ms(raw)} |\n"
        f"| `GET /v1/info` after the step (the old path's read) | 1 | {_ms(info)} |\n"
        f"| `GET /api/v1/healthz` (HTTP through Serve, no work: the floor) | 1 | {_ms(floor)} |\n"
        f"| `POST /api/v1/create_sampling_session` | {THREADS} | {_ms(together)} "
        f"({len(together) / wall:.0f} creations/s) |\n"
    )
    publish(table, "sampling_client", keep=args.steps >= 30)


if __name__ == "__main__":
    main()
