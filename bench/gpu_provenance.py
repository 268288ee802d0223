"""Where a GPU result came from: the code (commit and dirty flag), the software (torch, CUDA,
cuDNN, transformers, Liger, megatron-core), the card (its exact name, driver, power limit and
clocks before and after the run) and the allocator's settings, and the card's dense bf16 peak
for MFU.

The peak is looked up by the exact string ``torch.cuda.get_device_name()`` returns. A card not
in the table gets no MFU: a PCIe or NVL part has a lower peak than the SXM part of the same
name, so a substring match would overstate its MFU.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PEAK_BF16_TFLOPS: dict[str, float] = {
    # Dense bf16 (no sparsity), by NVIDIA's datasheets.
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM5
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,  # SXM
    "NVIDIA H200 NVL": 836.0,
}
"""Dense bf16 TFLOP/s by the exact device name."""

ALLOCATOR = "expandable_segments:True"
"""``PYTORCH_CUDA_ALLOC_CONF`` for every measured process: fragmentation no side's numbers
should pay for."""

_SMI_FIELDS = (
    "power.limit", "power.draw", "clocks.sm", "clocks.mem", "clocks.max.sm", "temperature.gpu",
)  # fmt: skip


def peak_flops(device_name: str) -> float | None:
    """The card's dense bf16 FLOP/s, or None for a card not in the table (no MFU then)."""
    tflops = PEAK_BF16_TFLOPS.get(device_name.strip())
    return tflops * 1e12 if tflops is not None else None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def code() -> dict[str, Any]:
    """The commit and whether the tree differs from it: ``TRAINCTL_COMMIT`` and
    ``TRAINCTL_DIRTY`` where the sender set them from its own checkout (a copy sent to a GPU
    machine can carry a stale ``.git``), else git's answer here."""
    if "TRAINCTL_COMMIT" in os.environ:
        return {
            "commit": os.environ["TRAINCTL_COMMIT"],
            "dirty": os.environ.get("TRAINCTL_DIRTY", "unknown"),
            "source": "TRAINCTL_COMMIT (set by the sender)",
        }
    commit = _git("rev-parse", "HEAD")
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": bool(status), "source": "git"}
    return {"commit": "unknown", "dirty": "unknown", "source": "no git, no TRAINCTL_COMMIT"}


def card() -> dict[str, Any]:
    """``nvidia-smi``'s reading of the card now (power and clocks move over a run: read it
    before and after), or why there is none."""
    query = ",".join(("name", "driver_version", *_SMI_FIELDS))
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return {"nvidia-smi": f"unavailable ({type(e).__name__})"}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(("name", "driver", *_SMI_FIELDS), values, strict=False))


def software() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger-kernel"),
        "megatron_core": _version("megatron-core"),
        "triton": _version("triton"),
        "device": torch.cuda.get_device_name() if cuda else "CPU (no CUDA device)",
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def record() -> dict[str, Any]:
    """Everything above but the after-run reading of the card (``card()`` again at the end)."""
    return {"code": code(), "software": software(), "card_before": card()}
