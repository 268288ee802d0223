"""What a scheduled checkpoint costs the step: written synchronously (the default) against in
the background (``--async-save``), on one model, layout and machine.

    python bench/save_stall.py            # the ~65M model of the checkpoint table, dp2
    python bench/save_stall.py --quick    # the embedded model (a smoke run)

Starts `trainctl serve --dp 2 --checkpoint-every-steps 2` with and without `--async-save` and
trains ``--steps`` steps of one batch. A saving step's `after_step_s` is what the save stalled
it (the whole save, or the copy of the state); the step after it runs while the background
write is going on, so its time against the same step of the synchronous run is what the
writer's competition for the cores costs. Prints a table and writes
bench/results/save_stall.md (full runs).
"""

from __future__ import annotations

import argparse
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

EVERY = 2


def _run(background: bool, model: dict[str, int] | None, steps: int) -> dict[str, Any]:
    vocab = (model or {}).get("vocab_size", 512)
    length = min(200, (model or {}).get("max_seq_len", 256) - 1)
    rng = np.random.default_rng(0)
    batch = [{"tokens": rng.integers(1, vocab, length).tolist()} for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--dp", "2", "--checkpoint-every-steps", str(EVERY)]
        flags += ["--async-save", str(background).lower()]
        svc = model_service(tmp, model, flags)
        with svc, svc.client() as c:
            params = int(c.info().engine["parameters_per_replica"])
            results = [c.train_batch(batch) for _ in range(steps)]
            t0 = time.perf_counter()
            while c.info().save_in_flight is not None:
                time.sleep(0.05)
            tail_s = time.perf_counter() - t0
            info = c.info()
            listed = [k.step for k in c.list_checkpoints().checkpoints]
    saving = [r for r in results if r.step % EVERY == 0]
    after = [r for r in results if r.step % EVERY == 1 and r.step > 1]
    return {
        "params": params,
        "stall": statistics.median(r.timings["after_step_s"] for r in saving),
        "step_after_save": statistics.median(r.timings["total_s"] for r in after),
        "step_plain": statistics.median(
            r.timings["total_s"] - r.timings.get("after_step_s", 0.0) for r in saving
        ),
        "tail_s": tail_s,
        "listed": listed,
        "error": info.last_save_error,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="the embedded model")
    args = ap.parse_args()
    model = None if args.quick else MODEL
    runs = {name: _run(name == "background", model, args.steps) for name in ("sync", "background")}
    sync = runs["sync"]["stall"]
    rows = [
        [name, f"{r['params'] / 1e6:.0f}M", f"{r['stall']:.2f}", f"{r['stall'] / sync:.2f}",
         f"{r['step_plain']:.2f}", f"{r['step_after_save']:.2f}", f"{r['tail_s']:.2f}",
         ", ".join(map(str, r["listed"])), r["error"] or "-"]
        for name, r in runs.items()
    ]  # fmt: skip
    headers = ["save", "model", "stall s", "stall / sync", "step s", "step after a save s",
               "left after the last step s", "checkpoints listed", "last_save_error"]  # fmt: skip
    text = (
        f"### A scheduled checkpoint every {EVERY} steps, written in the step or in the "
        f"background (dp2, ZeRO-1, {args.steps} steps of 8 x 200 tokens)\n\n"
        "Seconds, medians. 'stall': what the saving step waited for the save (its "
        "`after_step_s`: the whole save, or the copy of the state and the weights digest). "
        "'step': a step's own time without a save; 'step after a save': the next step, "
        "which runs while the background write goes on (the writer competes for the cores). "
        "'left after the last step': until the last background save was committed.\n\n"
        + table(headers, rows)
        + "\n"
    )
    publish(text, "save_stall", keep=not args.quick)


if __name__ == "__main__":
    main()
