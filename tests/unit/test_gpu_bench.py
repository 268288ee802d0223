"""The GPU benchmark (``bench/gpu.py``) runs anywhere in its smoke mode: a tiny model on the
CPU through every code path a lent GPU's minutes would otherwise find broken - the shared
checkpoint, trainctl's step, the transformers ladder (its Liger rows reported as skipped),
the ragged row, the correctness gate and the provenance record. A step that skips a layer's
backward must fail the gate."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.bench_scripts import ROOT, load

gpu_batches, gpu_gate, gpu_provenance = map(load, ("gpu_batches", "gpu_gate", "gpu_provenance"))


def _bench(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(out), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    return proc, json.loads((out / "gpu.json").read_text())


def test_smoke_measures_every_row_and_each_passes_the_gate(tmp_path: Path) -> None:
    proc, result = _bench(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = result["rows"]
    packed, ragged = rows.values()
    variant, recomputed = (
        "trainctl norm_kernel=eager",
        "trainctl recompute=elementwise",
    )  # the default
    assert set(packed["cells"]) == {
        "trainctl",
        variant,
        recomputed,
        "hf_amp",
        "hf_bf16",
        "hf_liger",
        "hf_liger_compile",
    }
    assert packed["cells"]["trainctl"]["config"].endswith("RMSNorm eager)")  # auto, on a CPU
    assert packed["cells"][variant]["config"].endswith("variant: norm_kernel=eager")
    assert packed["cells"][recomputed]["config"].endswith("variant: recompute=elementwise")
    for name in ("hf_liger", "hf_liger_compile"):
        assert "Triton" in packed["cells"][name]["skipped"]
    assert len(set(ragged["lengths"])) >= 30
    assert set(ragged["cells"]) == {"trainctl", variant, recomputed, "hf_amp"}
    for shape in rows.values():
        measured = [c for c in shape["cells"].values() if "skipped" not in c]
        assert len(measured) >= 2
        for cell in measured:
            assert cell["gate"] == "pass", cell
            assert len(cell["steps"]) == 4 and all(t > 0 for t in cell["steps"])
        # The same checkpoint and batch: step 1 agrees to fp32 rounding on the CPU.
        ref = shape["cells"]["hf_amp"]
        assert math.isclose(shape["cells"]["trainctl"]["losses"][0], ref["losses"][0], rel_tol=1e-5)
    prov = result["provenance"]
    assert len(prov["code"]["commit"]) == 40 and prov["code"]["source"] == "git"
    assert prov["software"]["torch"] and prov["software"]["allocator"] == gpu_provenance.ALLOCATOR
    assert "| pass |" in (tmp_path / "gpu.md").read_text()


def test_a_step_that_skips_a_layers_backward_fails_the_gate(tmp_path: Path) -> None:
    proc, result = _bench(
        tmp_path, "--fault", "skip-layer-backward", "--ragged", "", "--ladder", "hf_amp",
        "--trainctl-variants", "",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    [shape] = result["rows"].values()
    gate = shape["cells"]["trainctl"]["gate"]
    assert any("grad norm" in why for why in gate), gate
    assert shape["cells"]["hf_amp"]["gate"] == "pass"
    assert "FAILED THE GATE" in proc.stderr
    assert "not published" in (tmp_path / "gpu.md").read_text()


def test_ragged_batch_is_32k_tokens_in_many_lengths() -> None:
    lengths = gpu_batches.ragged(32768)
    assert sum(lengths) == 32768 and len(set(lengths)) >= gpu_batches.RAGGED_MIN_DISTINCT
    assert min(lengths) >= 128 and max(lengths) <= 4096
    assert gpu_batches.ragged(32768) == lengths  # a fixed seed: the same batch everywhere
    # Enough distinct lengths for the engine's varlen attention path.
    from trainctl.workers.ops import packed_attention

    assert len(packed_attention.equal_runs(lengths)) > packed_attention.VARLEN_MIN_RUNS


def test_mfu_peak_only_for_an_exactly_named_card() -> None:
    assert gpu_provenance.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_provenance.peak_flops("NVIDIA H100 PCIe") == 756e12
    # A card of another form factor or an unknown one gets no MFU, not the SXM part's peak.
    assert gpu_provenance.peak_flops("NVIDIA H100") is None
    assert gpu_provenance.peak_flops("NVIDIA H200 141GB HBM3e PCIe") is None


def _run(losses: list[float], norms: list[float]) -> dict[str, Any]:
    return {"losses": losses, "grad_norms": norms}


def test_gate_rules() -> None:
    ref = _run([12.0, 11.5], [2.0])
    assert gpu_gate.problems(_run([12.01, 11.6], [2.03]), ref) == []
    assert "step-1 loss" in gpu_gate.problems(_run([12.05, 11.6], [2.0]), ref)[0]
    assert "grad norm" in gpu_gate.problems(_run([12.0, 11.6], [2.1]), ref)[0]
    assert "did not fall" in gpu_gate.problems(_run([12.0, 12.0], [2.0]), ref)[0]
    assert "non-finite" in gpu_gate.problems(_run([12.0, float("nan")], [2.0]), ref)[0]
    assert "reference" in gpu_gate.problems(_run([12.0, 11.0], [2.0]), _run([12.0, 12.1], [2.0]))[0]
    assert gpu_gate.problems(_run([12.0, 11.0], [2.0]), None) == [
        "no reference row to compare with"
    ]


def test_a_trainctl_variant_names_engine_config_fields() -> None:
    """``--trainctl-variants``: ``field=value`` pairs joined by '+', a value read as JSON where
    it parses; anything else is refused naming the entry."""
    import pytest

    gpu = load("gpu")
    got = gpu.overrides("norm_kernel=compiled+logprob_chunk_size=1024")
    assert got == {"norm_kernel": "compiled", "logprob_chunk_size": 1024}
    with pytest.raises(SystemExit, match="'chunk' is not field=value"):
        gpu.overrides("norm_kernel=compiled+chunk")
