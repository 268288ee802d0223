"""The asynchronous RL benchmark case (run by run.py in a fresh process).

``async_rl_case`` starts ``trainctl serve --samplers 1 --sampler-sync in_flight
--max-staleness 2`` (the embedded model, dp=1) and runs ``examples/async_rl.py``'s comparison
against it: the synchronous loop and the asynchronous one (one and two steps' worth of groups
in flight), interleaved, each until its reward reaches 0.8.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from examples import async_rl


def async_rl_case(runs: int, delay: float) -> dict[str, Any]:
    from trainctl.local import LocalService

    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "in_flight",
                 "--max-staleness", "2")  # fmt: skip
        svc = LocalService(Path(tmp) / "data", *flags, start_timeout_s=900)
        with svc:
            args = argparse.Namespace(
                runs=runs, delay=delay, prompts=8, until=0.8, max_iterations=60, lr=2e-3,
                seed=0, in_flight=1,
            )  # fmt: skip
            before = os.getloadavg()[0]
            results = async_rl.compare(svc.url, args)
            return {
                "table": async_rl.table(results, args.until),
                "load_before": before,
                "load_after": os.getloadavg()[0],
                "runs": runs,
                "delay": delay,
            }
