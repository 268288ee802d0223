"""Test tiers by folder: unit (fast, no Ray), distributed (gloo ranks), service (real Ray,
Serve and HTTP), sampler (the service with vLLM sampler engines), gpu (skipped without CUDA).
Each test gets its folder's marker, and a tier's session resources end when the run leaves
its folder (``helpers/tiers.py``).

``scripts/test`` runs the tests on two pytest-xdist workers. A group of tests that shares state
runs on one worker, in one piece (``group_of``): a tier whose session fixtures all its modules
share (the rank pools of ``distributed/``), the sampler tier's two groups (each the users of
its own session services: ``SAMPLER_GROUPS``), the modules that use the service tier's one
shared ``service``, and each other module with its module fixtures. The longest groups are
handed out first, so that the many small unit modules fill the end; ``helpers/clock.py``
prints where each group ran and for how long."""

from __future__ import annotations

from inspect import isgeneratorfunction
from pathlib import Path
from typing import Any

import pytest

# Installs megatron_jit's hook before any test module imports megatron-core, so this process
# runs megatron's fused functions as the ranks do (eagerly, without CUDA).
import trainctl.workers.engine  # noqa: F401

from helpers.clock import GroupClock
from helpers.tiers import end_tier, end_uses, record_last_uses

_TIERS = ("unit", "distributed", "service", "sampler", "gpu")
_MARKS = {"deploy": "unit"}  # chart tests: fast, offline, no Ray
_SHARED_BY_THE_TIER = ("distributed",)
"""Tiers whose session fixtures (the rank pools) every module shares: one group each."""
SAMPLER_GROUPS = {
    "test_engine.py": "sampler/lora",
    "test_lora_sampling.py": "sampler/lora",
    "test_sampler_robustness.py": "sampler/lora",
    "test_tenant_shares.py": "sampler/lora",
}
"""The sampler tier in two groups, so that the two workers run them side by side: each of its
session services (``tests/sampler/conftest.py``) is used by the modules of one group only
(collection fails otherwise: a second group would start it again). Modules not listed are in
the group ``sampler``."""
SHARED_SERVICE_MODULES = ("test_service.py", "test_fuzz.py", "test_hostile_matrix.py")
"""The service tier's modules that use its one session ``service``
(``tests/service/conftest.py``); collection fails if another module uses it unlisted."""
_ORDER = ("distributed", "service", "sampler", "gpu", "deploy", "unit")
"""Folders in the order their groups are handed out, after ``_LONGEST_FIRST``: the unit tier's
small modules last, to fill the end."""
_LONGEST_FIRST = (
    "distributed",
    "tests/service/test_families.py",
    "sampler",
    "sampler/lora",
    "tests/service/test_layouts.py",
    "service/shared",
    "tests/service/test_multinode.py",
    "tests/service/test_reliability.py",
    "tests/service/test_kill_and_full_disk.py",
    "tests/service/test_tinker_sdk.py",
)
"""The groups that take minutes, longest first (each worker takes the next group when it runs
dry), so that the run ends on small groups. The figures are the CI run's "time by scheduling
group" table (``helpers/clock.py``); in the run that measured them the sampler tier, handed out
after the whole service tier, ran its 7 minutes alone at the end."""


def group_of(nodeid: str) -> str:
    """The unit of work one xdist worker runs from start to end, from a test's node id (the
    scheduler sees nothing else)."""
    path = nodeid.split("::", 1)[0]
    folder, module = Path(path).parent.name, Path(path).name
    if folder in _SHARED_BY_THE_TIER:
        return folder
    if folder == "sampler":
        return SAMPLER_GROUPS.get(module, "sampler")
    if folder == "service" and module in SHARED_SERVICE_MODULES:
        return "service/shared"
    return path


_IN_GROUP_ORDER = {
    "sampler/lora": (
        "test_engine.py",
        "test_lora_sampling.py",  # `lora_sampled`: these two, then it closes
        "test_sampler_robustness.py",
    ),
    "sampler": (
        "test_rl_loop.py",  # `sampled` (and `qwen3_manual`, within test_sampler.py)
        "test_sampler.py",
        "test_tinker_sampling.py",
    ),
}
"""Module order inside a group whose modules share session services: each service's users
run together, so that it closes after its last one (``helpers/tiers.until_last_use``)
instead of idling beside the next service's tests. Modules not listed run after these."""


def _hand_out_rank(nodeid: str) -> tuple[int, int, int]:
    group = group_of(nodeid)
    order = _IN_GROUP_ORDER.get(group, ())
    module = Path(nodeid.split("::", 1)[0]).name
    inside = order.index(module) if module in order else len(order)
    if group in _LONGEST_FIRST:
        return (0, _LONGEST_FIRST.index(group), inside)
    folder = Path(nodeid.split("::", 1)[0]).parent.name
    return (1, _ORDER.index(folder) if folder in _ORDER else len(_ORDER), inside)


def _folder(item: pytest.Item) -> str:
    return Path(str(item.fspath)).parent.name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _hand_out_rank(item.nodeid))  # stable: in-group order stays
    record_last_uses(items)  # after the sort: run order (-k and -m deselect before this)
    services: dict[str, str] = {}
    for item in items:
        folder = _folder(item)
        tier = _MARKS.get(folder, folder)
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        _one_group_per_session_service(item, services)
        uses_shared = folder == "service" and "service" in getattr(item, "fixturenames", ())
        if uses_shared and group_of(item.nodeid) != "service/shared":
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared `service`: add its module to "
                "SHARED_SERVICE_MODULES in tests/conftest.py (one xdist worker runs them all)"
            )


def _one_group_per_session_service(item: pytest.Item, seen: dict[str, str]) -> None:
    """A session fixture of the sampler tier (a running service) is used by one scheduling
    group only: a group on the other worker would start a second copy of it."""
    if _folder(item) != "sampler":
        return
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in info.name2fixturedefs.items() if info else ():
        if not any(
            d.scope == "session" and "sampler" in str(d.baseid) and isgeneratorfunction(d.func)
            for d in defs
        ):  # a session resource of the tier: set up, and torn down (a service)
            continue
        group = group_of(item.nodeid)
        first = seen.setdefault(name, group)
        if first != group:
            raise pytest.UsageError(
                f"{item.nodeid} ({group}) uses the session service `{name}` of {first}: move "
                "its module to that group in SAMPLER_GROUPS (tests/conftest.py)"
            )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the process that reports: xdist's controller
        config.pluginmanager.register(GroupClock(group_of), "trainctl-group-clock")


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
    end_uses(item.nodeid)  # a fixture whose last user this was (helpers/tiers.py)
    if nextitem is None or group_of(nextitem.nodeid) != group_of(item.nodeid):
        end_tier(_folder(item))  # a tier's shared resources serve one group: end with it
    return result
