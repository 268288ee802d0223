"""trainctl's benchmarks, one entry point: prints the tables and writes bench/results.md.

    python bench/run.py                 # every section
    python bench/run.py --only logprob  # logprob, cp_loss, mask (comma-separated)
    python bench/run.py --quick         # smaller sizes, for a smoke run (writes nothing)

Every measurement runs in a fresh process (``--child``) so peak memory is its own: the peak
resident set above the inputs (see bench/memory.py), never a number computed from shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tables import SECTIONS  # noqa: E402

RESULTS = ROOT / "bench" / "results.md"
SECTION_DIR = ROOT / "bench" / "results"
"""One file per section, so ``--only`` refreshes some tables and keeps the others."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import importlib

        job = json.loads(args.child)
        module = importlib.import_module(f"bench.{job.get('module', 'cases')}")
        print(json.dumps(getattr(module, job["fn"])(**job["kwargs"])))
        return 0
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {_cpus()} CPUs, torch {_torch_version()}, CPU"
    for name in args.only.split(","):
        text = SECTIONS[name](args.quick)
        print(text + "\n", flush=True)
        if not args.quick:
            SECTION_DIR.mkdir(exist_ok=True)
            (SECTION_DIR / f"{name}.md").write_text(f"{text}\n\n_Measured {stamp}; {machine}._\n")
    if not args.quick:
        sections = [SECTION_DIR / f"{n}.md" for n in SECTIONS]
        body = "\n".join(f.read_text() for f in sections if f.is_file())
        RESULTS.write_text(f"## Benchmarks\n\n{body}")
        print(f"wrote {RESULTS}")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
