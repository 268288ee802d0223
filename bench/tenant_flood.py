"""One tenant floods the session table at the default bounds while another trains.

    python bench/tenant_flood.py               # a 60 s flood
    python bench/tenant_flood.py --seconds 20

Starts `trainctl serve --dp=1 --max-adapters 4` with three tenants (alice, bob, carol) at the
default table bounds: each tenant's share of the 1,024 Tinker sessions is 256
(docs/security.md, "Fair shares"). carol opens sessions from 16 threads for the whole run;
bob trains a LoRA model through the real ``tinker`` SDK meanwhile, a step at a time, and his
session is checked with a raw heartbeat every step. Before trainctl shared the table out,
bob's session was evicted within the minute (404 on every call). Prints a table and writes
bench/results/tenant_flood.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables.common import lora_client, publish  # noqa: E402
from trainctl.local import LocalService  # noqa: E402

KEYS = {
    "alice": "alice-key-0a1b2c3d4e5f6a7b",
    "bob": "bob-key-9f8e7d6c5b4a3f2e",
    "carol": "carol-key-5566778899aabbcc",
}
TOKENS = [5, 17, 3, 9, 22, 41, 7, 8]


def flood(url: str, stop: threading.Event, codes: Counter[int], threads: int = 16) -> None:
    """carol: ``create_session`` from ``threads`` threads until ``stop``."""

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                r = http.post("/api/v1/create_session", json={},
                              headers={"X-API-Key": f"tml-{KEYS['carol']}"})  # fmt: skip
                codes[r.status_code] += 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    stop.wait()
    for t in pool:
        t.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    from tinker import types

    with tempfile.TemporaryDirectory(prefix="trainctl-flood-") as tmp:
        keys = Path(tmp) / "api-keys"
        keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
        svc = LocalService(
            Path(tmp) / "data",
            "--dp",
            "1",
            "--max-adapters",
            "4",
            f"--api-keys={keys}",
            start_timeout_s=300,
            env={"TRAINCTL_API_TOKEN": "operator-token-5f1e2d3c4b5a6978"},
        )
        svc.start()
        try:
            sc, tc, session, datum = lora_client(svc.url, f"tml-{KEYS['bob']}", TOKENS)
            stop, codes = threading.Event(), Counter[int]()
            flooder = threading.Thread(target=flood, args=(svc.url, stop, codes))
            flooder.start()
            steps, errors, beats = 0, 0, Counter[int]()
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                try:
                    tc.forward_backward([datum], "cross_entropy").result()
                    steps = int(tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                                .metrics["step:max"])  # fmt: skip
                except Exception as e:  # a lost session: what this bench is here to catch
                    errors += 1
                    print(f"bob's step failed: {e}")
                r = httpx.post(f"{svc.url}/api/v1/session_heartbeat", timeout=30,
                               json={"session_id": session},
                               headers={"X-API-Key": f"tml-{KEYS['bob']}"})  # fmt: skip
                beats[r.status_code] += 1
            stop.set()
            flooder.join()
            elapsed = time.monotonic() - t0
            operator = {"Authorization": "Bearer operator-token-5f1e2d3c4b5a6978"}
            metrics = httpx.get(f"{svc.url}/metrics", headers=operator, timeout=30).text
            sc.close("success").result()
        finally:
            svc.stop()
    refused = [ln for ln in metrics.splitlines() if ln.startswith("trainctl_tenant_refusals")]
    evicted = [ln for ln in metrics.splitlines() if ln.startswith("trainctl_tenant_evictions")]
    table = (
        f"### One tenant floods Tinker sessions from 16 threads for {elapsed:.0f} s at the "
        "default bounds (3 tenants + operator: 256 sessions each); another trains through "
        "the `tinker` SDK\n\n"
        "| carol's create_session: 200 / 429 | bob's steps | bob's failed steps | "
        "bob's heartbeats: 200 / other |\n|---|---|---|---|\n"
        f"| {codes[200]:,} / {codes[429]:,} | {steps} | {errors} | "
        f"{beats[200]} / {sum(beats.values()) - beats[200]} |\n\n"
        + "\n".join(f"    {ln}" for ln in refused + evicted)
    )
    publish(table, "tenant_flood", keep=args.seconds >= 60)


if __name__ == "__main__":
    main()
