"""Weights streamed from the ranks that own them: the service's sync, split and measured.

    python bench/weight_stream.py            # embedded, 113M, the largest shape; the baseline
    python bench/weight_stream.py --quick    # the embedded shape only, no baseline

Each row is ``trainctl serve --dp 2 --samplers 1 --sampler-sync manual`` with one
``--sampler-transport``, ``POST /v1/weights/sync`` ``--syncs`` times after the first, and the
medians of what each sync reports: *convert* (the slowest owner turning its shards into
buckets of Hugging Face pieces), *transfer* (putting them in the object store, or sending
them: the collective converts the next bucket while the last is on its way, so its transfer
includes its conversion), *gather* (until the weights were ready to load: the plan, and for
the object store the owners' puts), *load* (until the engine had fetched or received,
assembled and loaded them) and the *sync* (gather + load). *Rank peak* is the most host
memory a rank added during a sync (its ``VmHWM`` reset at the start, less its ``VmRSS`` then:
the service's own ``rank_peak_bytes``, the largest of the syncs); it counts the shared-memory
pages a rank writes into Ray's object store, which are the shipment itself (the object
store's, counted once on the node). *Private* is the rank's own memory alone (``RssAnon``,
sampled every 2 ms: ``rank_private_peak_bytes``), set against the bucket (``--bucket-mb``).
glibc is told to return freed buffers at once (``MALLOC_MMAP_THRESHOLD_``).

**The baseline** is the object-store sync as it was before (``--baseline``, a commit: every
rank's shards gathered on rank 0, merged and converted there, then put as one object), run
from a worktree of that commit at 113M in the same run: its *sync* is what the streamed one is
set against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "weight_stream.md"
BASELINE = "db42ebb"
"""The last commit whose syncs merge on rank 0."""

SHAPES: dict[str, dict[str, int]] = {
    "embedded": {},
    "113M": {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8,
             "num_query_groups": 4, "ffn_hidden_size": 2816, "vocab_size": 32000},
    "300M": {"num_layers": 8, "hidden_size": 1536, "num_attention_heads": 12,
             "num_query_groups": 4, "ffn_hidden_size": 4096, "vocab_size": 32000},
}  # fmt: skip
"""Each shape's model fields over the embedded default's. 300M is the largest that fits this
machine (24 GiB) at dp2 in fp32 with AdamW on both ranks, one engine and its kept versions."""

HEADER = (
    "| model | MiB | transport | buckets of MiB | convert ms | transfer ms | gather ms "
    "| load ms | sync ms | sync s / GiB | rank peak MiB | of it private MiB | private / bucket "
    "| peak / model | sync / baseline |\n|" + "---|" * 15
)


def _size(fields: dict[str, int]) -> int:
    """The model's bytes in fp32, as the engines hold it."""
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import EngineConfig, ModelConfig

    return 4 * hf.parameter_count(ModelConfig(**{**asdict(EngineConfig().model), **fields}))


@contextmanager
def _baseline_tree(commit: str) -> Any:
    """``PYTHONPATH`` for a worktree of ``commit``: a ``trainctl`` of links to its folders,
    found before this checkout's install (``trainctl`` is a namespace package)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), commit],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            links = Path(tmp) / "path" / "trainctl"
            links.mkdir(parents=True)
            for name in ("api", "clients", "local", "service", "workers"):
                (links / name).symlink_to(tree / name)
            yield str(links.parent)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)


def _service(
    fields: dict[str, int], transport: str, syncs: int, bucket_mb: int, pythonpath: str | None
) -> dict[str, Any]:
    from trainctl.local import LocalService

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "engine.json"
        cfg.write_text(json.dumps({"model": fields}))
        flags = ("--dp", "2", "--samplers", "1", "--sampler-sync", "manual",
                 "--sampler-transport", transport, "--sampler-bucket-mb", str(bucket_mb),
                 "--sampler-versions", "2", "--sampler-kv-cache-gib", "1",
                 "--engine-config", str(cfg), "--max-tokens-per-microbatch", "8192")  # fmt: skip
        env: dict[str, str | None] = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        svc = LocalService(Path(tmp) / "data", *flags, start_timeout_s=1500, env=env)
        with svc, svc.client() as tc:
            tc.sync_weights()  # past the first: steady syncs
            runs = [tc.sync_weights() for _ in range(syncs)]
    med = {k: statistics.median(getattr(r, k) or 0.0 for r in runs)
           for k in ("gather_s", "load_s", "convert_s", "transfer_s")}  # fmt: skip
    peaks = [r.rank_peak_bytes for r in runs if getattr(r, "rank_peak_bytes", None) is not None]
    private = [p for r in runs if (p := getattr(r, "rank_private_peak_bytes", None)) is not None]
    return {
        "bytes": runs[0].bytes,
        **med,
        "sync_s": statistics.median(r.gather_s + r.load_s for r in runs),
        "peak": max(peaks) if peaks else None,
        "private": max(private) if private else None,
        "streamed": getattr(runs[0], "convert_s", None) is not None,
    }


def _row(label: str, transport: str, r: dict[str, Any], bucket_mb: int, model: int,
         baseline: float | None) -> str:  # fmt: skip
    ms = {k: f"{1e3 * r[k]:.0f}" for k in ("convert_s", "transfer_s", "gather_s", "load_s",
                                           "sync_s")}  # fmt: skip
    peak, private = r["peak"], r["private"]
    cells = [
        label, f"{model / 2**20:.0f}", transport, str(bucket_mb) if r["streamed"] else "-",
        ms["convert_s"] if r["streamed"] else "-", ms["transfer_s"] if r["streamed"] else "-",
        ms["gather_s"], ms["load_s"], ms["sync_s"], f"{r['sync_s'] / (r['bytes'] / 2**30):.2f}",
        "-" if peak is None else f"{peak / 2**20:.0f}",
        "-" if private is None else f"{private / 2**20:.0f}",
        "-" if private is None else f"{private / (bucket_mb * 2**20):.2f}",
        "-" if peak is None else f"{peak / model:.2f}",
        "-" if baseline is None else f"{r['sync_s'] / baseline:.2f}x",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--baseline", default=BASELINE, help="the commit to set 113M against")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="the embedded shape only, no baseline")
    a = ap.parse_args()
    shapes = ["embedded"] if a.quick else a.shapes.split(",")
    rows, baseline = [], None
    print(HEADER, flush=True)
    if not a.quick and "113M" in shapes:
        with _baseline_tree(a.baseline) as path:
            r = _service(SHAPES["113M"], "object_store", a.syncs, a.bucket_mb, path)
        if r["streamed"]:
            sys.exit("the baseline service ran this checkout's code, not the baseline's")
        baseline = r["sync_s"]
        rows.append(_row(f"113M, baseline {a.baseline}", "object_store", r, a.bucket_mb,
                         _size(SHAPES["113M"]), 1.0 * baseline))  # fmt: skip
        print(rows[-1], flush=True)
    for label in shapes:
        model = _size(SHAPES[label])
        for transport in ("object_store", "collective"):
            r = _service(SHAPES[label], transport, a.syncs, a.bucket_mb, None)
            rows.append(_row(label, transport, r, a.bucket_mb, model,
                             baseline if label == "113M" else None))  # fmt: skip
            print(rows[-1], flush=True)
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python "
        f"bench/weight_stream.py`: `trainctl serve --dp 2 --samplers 1`, median of {a.syncs} "
        f"syncs each (the largest peak), buckets of {a.bucket_mb} MiB, fp32, on "
        f"{os.cpu_count()} cores.", "", HEADER, *rows,
    ])  # fmt: skip
    if not a.quick:
        RESULT.write_text(text + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
