"""The staged GPU probe runs anywhere in its smoke mode (tiny sizes, the CPU here): every
section finishes and writes its numbers, so a lent GPU's minutes go to measuring, not to
finding a broken script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_probe_smoke_runs_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_probe.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "probe.json").read_text())
    assert set(results) == {"env", "attention", "optimizer", "elementwise", "head"}
    assert not [k for k, v in results.items() if "error" in v], results
    # Every variant measured a time, and agreed with its reference where it has one.
    for pack in (v for v in results["attention"].values() if isinstance(v, dict)):
        for name in ("slices", "runs", "runs_copy"):
            assert isinstance(pack[f"{name}_ms"], float), pack
            assert float(pack[f"{name}_vs_slices"]) < 1e-5, pack
    head = results["head"]["512_tokens"]
    assert float(head["fused_compiled_c256_lp_vs_ce"]) < 1e-4, head
    for key in ("fused_compiled_c256_grads_vs_ce", "loss_in_forward_c256_grads_vs_ce"):
        assert all(float(r) < 1e-4 for r in head[key].split(" / ")), (key, head)
    assert results["optimizer"]["adamw_fused_ms"] > 0
    # The compiled elementwise forms (what CUDA runs) compute what the eager ones do.
    ew = results["elementwise"]
    for key in ("rope_compiled_vs_eager", "qknorm_rope_compiled_vs_eager",
                "swiglu_megatron_fused_vs_eager"):  # fmt: skip
        assert float(ew[key]) < 1e-5, (key, ew)
