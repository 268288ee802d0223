"""Weights over a collective (``workers/sampler/collective.py``): an engine built with the
``gloo`` weight-transfer backend receives versions through vLLM's own weight-sync sequence
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``) while a sender broadcasts them in buckets, and then samples exactly
what the same weights give through the shipment path (fp32 on a CPU: 0.0). Two syncs share a
group; a new generation forms a new one; a client pinned to a replaced step gets it back from
the copy the engine kept (a broadcast cannot be replayed); a sender that dies after one bucket
leaves the engine serving what it served."""

from __future__ import annotations

import multiprocessing as mp
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import one_engine_cases as cases


def test_collective_syncs_are_exact_and_a_broken_send_changes_nothing() -> None:
    with mp.get_context("spawn").Pool(1) as pool:
        out: dict[str, Any] = pool.apply_async(cases.collective_sync).get(timeout=600)
    rounds = [out[f"v{seed}"] for seed in (0, 1, 2)]
    for step, r in enumerate(rounds, start=1):
        assert r["buckets"] > 1 and r["sent"].get("sent", 0) > 0, r
        assert r["step"] == (step, step), r
        assert r["same_tokens"] and r["logprobs"] > 20 and r["logprob_diff"] == 0.0, r
    assert rounds[0]["tokens"] != rounds[1]["tokens"] != rounds[2]["tokens"], "each sync took"
    # Versions the engine keeps: a pinned step swaps back exactly; one past them is refused.
    assert out["pinned_step_2"] is True, out
    status, message = out["pinned_step_1"]
    assert status == 500 and "keeps no copy of step 1" in message, out
    status, message = out["broken_send"]
    assert status == 500 and "did not receive step 4" in message and "serves step 3" in message
    assert out["after_broken_send"] == {"same": True, "step": 3}, out


def test_the_sync_benchmark_runs_and_prints_every_way() -> None:
    """``bench/collective_sync.py --quick`` (the embedded shape, nothing written): its sender
    must keep up with the collective's API, which it silently stopped doing twice."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "bench" / "collective_sync.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    row = re.search(r"^\| embedded \(0\.6M\) \| (.*) \|$", run.stdout, re.M)
    assert row is not None, run.stdout[-2000:]
    cells = [c.strip() for c in row.group(1).split("|")]
    assert all(float(c.rstrip("x")) > 0 for c in cells), cells
