"""Test tiers by folder: unit (fast, no Ray), distributed (gloo ranks), service (real Ray,
Serve and HTTP), sampler (the service with vLLM sampler engines), gpu (skipped without CUDA).
Each test gets its folder's marker, and a tier's session resources end when the run leaves
its folder (``helpers/tiers.py``).

``scripts/test`` runs the tests on two pytest-xdist workers. A group of tests that shares state
runs on one worker, in one piece (``group_of``): a tier whose session fixtures all its modules
share (the rank pools of ``distributed/``, the sampler services of ``sampler/``), the modules
that use the service tier's one shared ``service``, and each other module with its module
fixtures. The heavy tiers come first, so that the many small unit modules fill the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.tiers import end_tier

_TIERS = ("unit", "distributed", "service", "sampler", "gpu")
_MARKS = {"deploy": "unit"}  # chart tests: fast, offline, no Ray
_SHARED_BY_THE_TIER = ("distributed", "sampler")
"""Tiers whose session fixtures (pools, services) every module shares: one group each."""
SHARED_SERVICE_MODULES = ("test_service.py", "test_fuzz.py", "test_hostile_matrix.py")
"""The service tier's modules that use its one session ``service``
(``tests/service/conftest.py``); collection fails if another module uses it unlisted."""
_ORDER = ("distributed", "service", "sampler", "gpu", "deploy", "unit")
"""The longest group first (the distributed tier, about a third of the run), the unit tier's
small modules last, to fill the end. The sampler tier runs after the service tier: beside the
distributed tier its engines slowed that tier from 17 to 22 minutes in a CI run."""


def group_of(nodeid: str) -> str:
    """The unit of work one xdist worker runs from start to end, from a test's node id (the
    scheduler sees nothing else)."""
    path = nodeid.split("::", 1)[0]
    folder, module = Path(path).parent.name, Path(path).name
    if folder in _SHARED_BY_THE_TIER:
        return folder
    if folder == "service" and module in SHARED_SERVICE_MODULES:
        return "service/shared"
    return path


def _folder(item: pytest.Item) -> str:
    return Path(str(item.fspath)).parent.name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {folder: i for i, folder in enumerate(_ORDER)}
    items.sort(key=lambda item: rank.get(_folder(item), len(_ORDER)))  # stable: within a tier
    for item in items:
        folder = _folder(item)
        tier = _MARKS.get(folder, folder)
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        uses_shared = folder == "service" and "service" in getattr(item, "fixturenames", ())
        if uses_shared and group_of(item.nodeid) != "service/shared":
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared `service`: add its module to "
                "SHARED_SERVICE_MODULES in tests/conftest.py (one xdist worker runs them all)"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling, with ``group_of`` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return TierScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    folder = _folder(item)
    if nextitem is None or _folder(nextitem) != folder:
        end_tier(folder)
    return result
