"""``bench/saved_activations.py``: its ledger charges what autograd really keeps (a storage
once, whole, to the module that first kept it; parameters never), and the script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from helpers.bench_scripts import ROOT, load

saved_activations = load("saved_activations")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 2)  # [n, 8], a storage of its own
        y = torch.sin(wide[:, :4])  # keeps a view of `wide`: the whole storage stays alive
        return self.lin(y * y)  # `*` keeps y twice (one storage); the linear its input, weight


def test_the_ledger_charges_whole_storages_once_and_no_parameter() -> None:
    block, n = _Block(), 3
    x = torch.randn(n, 4, requires_grad=True)
    with saved_activations.recording([block]) as ledger:
        out = block(x)
    out.sum().backward()  # what was kept was usable
    f32 = 4
    assert dict(ledger.by_site) == {
        "(top)": n * 8 * f32 + n * 4 * f32,  # `wide` whole (sin's view of it), then y once
        "lin": n * 4 * f32,  # y * y; the weight is a parameter
    }


def test_the_script_prints_both_sides(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "saved_activations.py"),
         "--tokens", "32", "--layers", "1", "--vocab", "256"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| trainctl (bf16")]
    rows += [line for line in proc.stdout.splitlines() if line.startswith("| transformers")]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        assert int(row.split("|")[2].replace(",", "")) > 10_000, row  # bytes a token a layer
    assert "layer.self_attention.core_attention" in proc.stdout
