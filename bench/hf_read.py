"""What a rank's start from a Hugging Face checkpoint costs in host memory and time: each
rank reading its own shard (``workers/engine/hf_read.py``) against the whole model loaded in
float32 and then cut (how every rank started before), at Qwen3-0.6B's shape in bf16.

    python bench/hf_read.py            # ~40 s: writes a 1.1 GiB checkpoint to a temp dir
    python bench/hf_read.py --quick    # a tiny model (a smoke run)

Each row is one rank, measured in a fresh process: its peak resident memory above what the
process held before reading (``VmHWM`` after a reset; the mapped file's pages it touched count),
the seconds to read all its parameters (the shards ``weights.assign`` asks for), and the
elements it read. ``pp`` rows are the first of that many pipeline stages, which asks for the
embedding and its layers only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu import QWEN3_06B, TINY, write_checkpoint  # noqa: E402


def layouts(tp: int) -> list[tuple[str, int, int]]:
    """(how, tp, pp) of each row, measured on rank 0; ``tp``: the widest (the model's query
    groups)."""
    return [("whole", 1, 1), ("shard", 1, 1), ("whole", tp, 1), ("shard", tp, 1), ("shard", 1, 4)]


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    line = next(x for x in lines if x.startswith(field))
    return int(line.split()[1])


def _reset_peak() -> int:
    """Reset the peak resident memory to the current (Linux: ``clear_refs`` 5); the current."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def measure(directory: str, how: str, tp: int, pp: int) -> dict[str, Any]:
    """Rank 0's start at ``tp`` x ``pp``, read ``how`` (in this process: call it in a fresh
    one, so that its peak memory is its own)."""
    import torch
    from safetensors.torch import load_file

    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ModelConfig
    from trainctl.workers.engine.hf_read import CheckpointReader
    from trainctl.workers.engine.weights import shard_rule

    m = hf.model_config_from_hf(hf.read_config(Path(directory)), ModelConfig())
    stage_layers = -(-m.num_layers // pp)
    with CheckpointReader(Path(directory), m) as reader:
        shapes = {ours: tuple(reader.whole_shape(ours)) for ours, _, _ in hf.rows(m)}
    names = [n for n in shapes if not n.startswith("decoder.layers.") or _layer(n) < stage_layers]
    if pp > 1:
        names = [n for n in names if n != "output_layer.weight" and "final_layernorm" not in n]
    before, start = _reset_peak(), time.perf_counter()
    kept: list[torch.Tensor] = []
    if how == "whole":
        loaded: dict[str, torch.Tensor] = {}
        for f in sorted(Path(directory).glob("*.safetensors")):
            loaded |= {k: v.float() for k, v in load_file(str(f)).items()}
        full = hf.from_hf(loaded, m)
        del loaded
        read = sum(t.numel() for t in full.values())
        for n in names:
            kept.append(shard_rule(n).shard(full[n], 0, tp).clone())
        del full
    else:
        with CheckpointReader(Path(directory), m) as reader:
            for n in names:
                kept.append(reader.shard(n, shapes[n], 0, tp))
            read = reader.elements_read
    seconds = time.perf_counter() - start
    return {
        "how": how, "tp": tp, "pp": pp, "read_m": read / 1e6,
        "kept_m": sum(t.numel() for t in kept) / 1e6,
        "peak_mib": (_status_kib("VmHWM") - before) / 1024, "seconds": seconds,
    }  # fmt: skip


def _layer(name: str) -> int:
    return int(name.split(".")[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model (a smoke run)")
    ap.add_argument(
        "--measure", nargs=4, metavar=("DIR", "HOW", "TP", "PP"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.measure:
        directory, how, tp, pp = args.measure
        print(json.dumps(measure(directory, how, int(tp), int(pp))))
        return
    model = TINY if args.quick else QWEN3_06B
    with tempfile.TemporaryDirectory() as tmp:
        made = write_checkpoint(model, 4096, tmp)
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        print(f"checkpoint: {made['parameters'] / 1e9:.3g} G parameters, {size / 2**30:.2f} GiB")
        print("| rank 0 of | reads | read (M elements) | kept | peak memory (MiB) | seconds |")
        print("|---|---|---:|---:|---:|---:|")
        for how, tp, pp in layouts(model["num_query_groups"]):
            out = subprocess.run(
                [sys.executable, __file__, "--measure", tmp, how, str(tp), str(pp)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| tp {tp} x pp {pp} | {how} | {r['read_m']:,.3f} | {r['kept_m']:,.3f} "
                f"| {r['peak_mib']:,.0f} | {r['seconds']:.2f} |"
            )


if __name__ == "__main__":
    main()
