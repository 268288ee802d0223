"""A lost node under ``--on-node-loss shrink``: from the node's loss to training again on fewer
replicas, and back to the configured layout once the node returns.

    python bench/shrink.py            # the ~58M model of the checkpoint table
    python bench/shrink.py --quick    # the embedded model (a smoke run)

A simulated cluster (``ray.cluster_utils.Cluster``: a head with no rank slot and three nodes of
one slot each, all on this machine) serves ``--dp 3 --on-node-loss shrink`` with a checkpoint
every step, twice: restored from the surviving ranks' memory (``--distributed-optimizer off``)
and from the newest checkpoint (``--peer-recovery false``). After one step, the node of the
last rank is removed and a train call is made through the SDK, which retries it under one
idempotency key: "loss → training" is the seconds from the removal to that call's answer (the
failure surfacing, the rebuild on dp2, the state restored, the step itself). The node is added
back, one step trained (its checkpoint lets the group grow), and "grow" is the seconds from
that step's answer to the service ready again on dp3. Each layout's step time is the median of
three steps. With ``--on-node-loss wait`` the service would train again only once the node is
back. Prints a table and writes bench/results/shrink.md (full runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.checkpoint_cases import MODEL  # noqa: E402
from bench.tables.common import model_service, publish, table  # noqa: E402

SOURCES = {"peer": (), "checkpoint": ("--peer-recovery", "false")}
NODES = 3


def _batch(seed: int, n: int, length: int, vocab: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(1, vocab, length).tolist()} for _ in range(n)]


def _steps(c: Any, batch: list[dict[str, Any]], n: int = 3) -> float:
    """The median seconds of ``n`` train calls (each also writes its checkpoint)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.train_batch(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run(source: str, model: dict[str, int] | None) -> dict[str, Any]:
    from ray.cluster_utils import Cluster

    from trainctl.clients import RetryPolicy

    vocab = (model or {}).get("vocab_size", 512)
    length = min(200, (model or {}).get("max_seq_len", 256) - 1)
    batch = _batch(0, 6, length, vocab)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as tmp:
            flags = [
                f"--ray-address={cluster.address}", "--dp", "3", "--rank-num-cpus", "1",
                "--on-node-loss", "shrink", "--distributed-optimizer", "off",
                "--checkpoint-every-steps", "1", *SOURCES[source],
            ]  # fmt: skip
            svc = model_service(tmp, model, flags)
            with svc, svc.client() as c:
                params = int(c.info().engine["parameters_per_replica"])
                step_dp3 = _steps(c, batch)
                last = c.info().ranks[-1].node
                victim = next(n for n in cluster.worker_nodes if n.node_id[:12] in last)
                patient = svc.client(retry=RetryPolicy(max_retries=120, backoff_s=0.5))
                cluster.remove_node(victim, allow_graceful=True)
                t0 = time.perf_counter()
                patient.train_batch(batch)
                back_s = time.perf_counter() - t0
                shrunk = c.info()
                step_dp2 = _steps(c, batch)
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
                c.train_batch(batch)  # its checkpoint: then the grow, ahead of anything else
                t0 = time.perf_counter()
                while True:
                    try:
                        info = c.info()
                        if info.layout["dp"] == NODES and info.weights_digest:
                            break
                    except Exception:  # 503 while the ranks are rebuilt
                        pass
                    time.sleep(0.1)
                grow_s = time.perf_counter() - t0
                step_again = _steps(c, batch)
    finally:
        cluster.shutdown()
    rec = shrunk.recovery
    assert rec is not None and shrunk.layout["dp"] == 2, shrunk
    return {
        "params": params, "back_s": back_s, "grow_s": grow_s, "source": rec.source,
        "lost": shrunk.steps_lost, "steps": (step_dp3, step_dp2, step_again),
        "lost_after": info.steps_lost,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the embedded model")
    args = ap.parse_args()
    # The simulated cluster and the service it serves share one Ray auth setting: neither
    # reads a token an earlier Ray left in the real home directory.
    os.environ["HOME"] = tempfile.mkdtemp(prefix="trainctl-bench-home-")
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(var, None)
    model = None if args.quick else MODEL
    rows = []
    for source in SOURCES:
        r = _run(source, model)
        dp3, dp2, again = r["steps"]
        rows.append([
            source, f"{r['params'] / 1e6:.0f}M", f"{r['back_s']:.1f}", r["source"],
            str(r["lost"]), f"{dp3:.2f}", f"{dp2:.2f}", f"{r['grow_s']:.1f}", f"{again:.2f}",
            str(r["lost_after"]),
        ])  # fmt: skip
    headers = ["restored from", "model", "loss → training s", "recovery.source", "steps lost",
               "step s dp3", "step s dp2", "grow s", "step s dp3 again",
               "steps lost after the grow"]  # fmt: skip
    text = (
        "### A lost node under --on-node-loss shrink: dp3 → dp2 at once, dp3 again after the "
        "next checkpoint (a simulated 3-node cluster, one rank slot a node)\n\n"
        "'loss → training s': from the node's removal to the answer of a train call made "
        "right after it (retried by the SDK under one idempotency key: the failure, the "
        "rebuild on dp2, the restore and the step). 'grow s': from the answer of the first "
        "step after the node came back (its checkpoint queues the grow) to the service ready "
        "on dp3. Step times are medians of three steps, each with its checkpoint (all the "
        "ranks share this machine's 2 cores, so fewer ranks are not slower here).\n\n"
        + table(headers, rows) + "\n"
    )  # fmt: skip
    publish(text, "shrink", keep=not args.quick)


if __name__ == "__main__":
    main()
