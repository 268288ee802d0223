"""What every benchmark table uses: a measurement in a fresh process, and markdown tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.memory import child_env

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "run.py"


MEMORY_MODULES = ("cases", "parallel_cases", "tree_cases", "lora_cases", "checkpoint_cases")
"""The case modules that measure peak memory (``child_env``)."""


def measure(fn: str, module: str = "cases", **kwargs: Any) -> dict[str, float]:
    """Run ``bench.<module>.<fn>(**kwargs)`` in a fresh process and return its result.

    Memory cases (``cases``, ``parallel_cases``) run with ``child_env()`` (small allocations
    from mmap, so peaks are exact); the cases that start a service time it as users run it,
    with the plain environment.
    """
    job = json.dumps({"fn": fn, "module": module, "kwargs": kwargs})
    memory = module in MEMORY_MODULES
    env = child_env() if memory else {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(RUN), "--child", job],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"{fn}({kwargs}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def lora_client(url: str, api_key: str, tokens: list[int]) -> tuple[Any, Any, str, Any]:
    """Through the real ``tinker`` SDK: a service client, a LoRA training client (rank 4) on
    the served model, its session id, and one cross-entropy datum of ``tokens``."""
    import numpy as np
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=api_key)
    base = sc.get_server_capabilities().supported_models[0].model_name
    tc = sc.create_lora_training_client(base_model=base, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                        "weights": np.ones(len(tokens) - 1, np.float32)},
    )  # fmt: skip
    return sc, tc, tc.model_id.split(":", 1)[0], datum


def publish(text: str, name: str, *, keep: bool) -> None:
    """A standalone script's table, printed; ``keep`` (a full run): also written to
    ``bench/results/<name>.md``, where docs/benchmarks.md takes it from."""
    print("\n" + text)
    if keep:
        out = ROOT / "bench" / "results" / f"{name}.md"
        out.write_text(text + "\n")
        print(f"wrote {out}")


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def relative_rows(runs: list[tuple[str, dict[str, float]]]) -> list[list[str]]:
    """Peak and time of each run, and their ratios to the first run's."""
    base = runs[0][1]
    return [
        [
            label,
            f"{r['peak_MiB']:.0f}",
            f"{r['peak_MiB'] / base['peak_MiB']:.2f}",
            f"{r['time_s']:.1f}",
            f"{r['time_s'] / base['time_s']:.2f}",
        ]
        for label, r in runs
    ]


def model_service(tmp: str, model: dict[str, int] | None, flags: list[str]) -> Any:
    """`trainctl serve FLAGS` (not started) in the directory ``tmp``, on ``model``'s shape
    (an engine config written there; None: the embedded model), with a start timeout for a
    model of a few hundred MB on this machine."""
    from trainctl.local import LocalService

    flags = list(flags)
    if model is not None:
        cfg = Path(tmp) / "engine.json"
        cfg.write_text(json.dumps({"model": model}))
        flags += ["--engine-config", str(cfg)]
    return LocalService(Path(tmp) / "data", *flags, start_timeout_s=900)
