"""A lost rank, from the kill to a ready service: rebuilt from the surviving replica's memory
against from the newest checkpoint, on one model, layout and machine.

    python bench/recovery.py              # the ~58M model of the checkpoint table, 3 kills each
    python bench/recovery.py --quick      # the embedded model, 1 kill each (a smoke run)

Starts `trainctl serve --dp 2 --distributed-optimizer off` twice: with recovery from peers
(the default) and with `--peer-recovery false` (the checkpoint path). In each, a checkpoint is
saved and one more step trained (the step a checkpoint restore loses); then, ``--kills``
times, rank 1 is SIGKILLed while a train call runs, and the seconds to `GET /v1/ready`
answering again are timed, with what `info.recovery` says. Prints a table and writes
bench/results/recovery.md (full runs).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import signal
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
MARKS = (
    ("copy", "phase: copying the survivors' state"),
    ("rebuild", "phase: rebuilding workers"),
    ("restore", r"phase: (restoring step|loading )"),
    ("done", "recovered from "),
)
"""The recovery's log lines, in order: each part's seconds run from its line to the next."""
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")


def _parts(log: str, since: float) -> dict[str, float]:
    """Seconds of each part of the last recovery after unix time ``since``, from the service
    log's timestamps (the controller logs each phase)."""
    at: dict[str, float] = {}
    for line in log.splitlines():
        stamp = STAMP.search(line)  # after Ray's "(Controller pid=...)" prefix
        if stamp is None:
            continue
        t = datetime.datetime.strptime(stamp[0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t < since:
            continue
        for name, pattern in MARKS:
            if name not in at and re.search(pattern, line):
                at[name] = t
    names = [n for n, _ in MARKS if n in at]
    return {a: at[b] - at[a] for a, b in itertools.pairwise(names)}


def _batch(seed: int, n: int, length: int, vocab: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(1, vocab, length).tolist()} for _ in range(n)]


def _run(source: str, model: dict[str, int] | None, kills: int) -> dict[str, Any]:
    vocab = (model or {}).get("vocab_size", 512)
    length = min(200, (model or {}).get("max_seq_len", 256) - 1)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--dp", "2", "--distributed-optimizer", "off", *SOURCES[source]]
        svc = model_service(tmp, model, flags)
        with svc, svc.client() as c:
            params = int(c.info().engine["parameters_per_replica"])
            c.train_batch(_batch(0, 4, length, vocab))
            t0 = time.perf_counter()
            saved = c.save_checkpoint()
            save_s = time.perf_counter() - t0
            c.train_batch(_batch(1, 4, length, vocab))  # the step a restore loses
            times, lost, sources, parts = [], [], [], []
            for k in range(kills):
                step = c.info().step
                victim = c.info().ranks[1].pid
                assert victim is not None
                op = c.submit("train_batch", _batch(100 + k, 32, length, vocab))
                while c.operation(op.id).status.value == "queued":
                    time.sleep(0.02)
                time.sleep(0.3)  # inside the step
                os.kill(victim, signal.SIGKILL)
                t0, at = time.perf_counter(), time.time()
                failed = c.operation(op.id, wait_s=60)  # the failure surfaces, then the rebuild
                assert failed.status.value == "failed", failed
                while not c.is_ready():
                    time.sleep(0.05)
                times.append(time.perf_counter() - t0)
                info = c.info()
                assert info.recovery is not None and info.recovery.at >= at, info.recovery
                sources.append(info.recovery.source)
                parts.append(_parts(svc.log(), at))
                lost.append(step - info.step)
                if info.step < step:  # back at the checkpoint: train the lost step again
                    c.train_batch(_batch(1, 4, length, vocab))
            assert saved.checkpoint_id
    return {
        "params": params, "times": times, "lost": lost, "sources": sources, "save_s": save_s,
        "parts": {k: statistics.median(p.get(k, 0.0) for p in parts)
                  for k in ("copy", "rebuild", "restore")},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the embedded model, one kill each")
    args = ap.parse_args()
    model = None if args.quick else MODEL
    kills = 1 if args.quick else args.kills
    rows = []
    for source in SOURCES:
        r = _run(source, model, kills)
        t, parts = r["times"], r["parts"]
        rows.append([
            source, f"{r['params'] / 1e6:.0f}M", f"{statistics.median(t):.1f}",
            f"{min(t):.1f} / {max(t):.1f}", f"{parts['copy']:.1f}", f"{parts['rebuild']:.1f}",
            f"{parts['restore']:.1f}", ", ".join(sorted(set(r["sources"]))), str(max(r["lost"])),
            f"{r['save_s']:.1f}",
        ])  # fmt: skip
    headers = ["restored from", "model", "kill → ready s (median)", "min / max", "copy s",
               "rebuild s", "restore s", "recovery.source", "steps lost", "save s"]  # fmt: skip
    text = (
        f"### A rank SIGKILLed mid-step, to ready again: from the survivor's memory or from "
        f"the checkpoint (dp2, replicated optimizer, {kills} kill(s) each)\n\n"
        "Seconds from the kill to `GET /v1/ready` answering 200 (the rebuild: new rank "
        "actors, process group, engine build, and the state restored). 'steps lost': the "
        "steps the restore undid (one step was trained after the checkpoint). 'save s': one "
        "checkpoint save of the same state, for scale. The parts (medians, from the service "
        "log): copy = the survivors' state into the object store; rebuild = new rank actors, "
        "process group and engine build; restore = the state cut and applied (from the copy, "
        "or proved and read from the checkpoint's files). The rest of kill → ready is the "
        "failure surfacing and the samplers' sync.\n\n" + table(headers, rows) + "\n"
    )
    publish(text, "recovery", keep=not args.quick)


if __name__ == "__main__":
    main()
