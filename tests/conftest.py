"""Test tiers by folder: unit (fast, no Ray), distributed (gloo ranks), service (real Ray,
Serve and HTTP), sampler (the service with vLLM sampler engines), gpu (skipped without CUDA).
Each test gets its folder's marker, and a tier's session resources end when the run leaves
its folder (``helpers/tiers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tiers import end_tier

_TIERS = ("unit", "distributed", "service", "sampler", "gpu")
_MARKS = {"deploy": "unit"}  # chart tests: fast, offline, no Ray


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        tier = _MARKS.get(folder, folder)
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    folder = Path(str(item.fspath)).parent.name
    if nextitem is None or Path(str(nextitem.fspath)).parent.name != folder:
        end_tier(folder)
    return result
