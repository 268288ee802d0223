"""The GPU tier runs only where torch sees a CUDA device; elsewhere each of its tests is
skipped, saying so. ``scripts/gpu`` runs it on a GPU machine (no Ray there: nothing here needs
it). ``TRAINCTL_GPU_ARTIFACTS``: a folder for what the tier writes (the memory snapshot and
its picture)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here: the GPU tier runs on a GPU (scripts/gpu)")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    where = os.environ.get("TRAINCTL_GPU_ARTIFACTS")
    path = Path(where) if where else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path
