"""Session resources that end with their tier.

A tier's costly resources (the rank pools of ``distributed/``, the running services of
``sampler/`` and ``service/``) are session fixtures, so that every module of the tier shares
them. Left to the end of the session they would stay up beside every later tier: idle Ray
clusters, vLLM engines and rank processes slowed the unit tier about fourfold in a CI run. A
fixture hands its teardown to ``close_with_tier``; the root ``tests/conftest.py`` calls
``end_tier`` once the run leaves the tier's folder (and the fixture's own teardown, at the end
of the session, then finds nothing left to do).

A resource that only some of a tier's tests use can end sooner, after the last test that asks
for its fixture (``until_last_use``): an idle service still costs a fifth of a core (Ray's
and Serve's loops, gloo's polling threads), and the sampler tier kept up to three of them up
for minutes after their last use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_closers: dict[str, list[Callable[[], object]]] = {}
_last_use: dict[str, str] = {}
"""Fixture name -> node id of the last test (in run order) that uses it."""
_after_use: dict[str, list[Callable[[], object]]] = {}
"""Node id -> what to close once that test is done."""


def record_last_uses(items: list[Any]) -> None:
    """Note, for every fixture, the last of ``items`` (in run order) that uses it."""
    _last_use.clear()
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            _last_use[name] = item.nodeid


def end_uses(nodeid: str) -> None:
    """Close what waited for test ``nodeid``, the last user of its fixture."""
    for close in reversed(_after_use.pop(nodeid, [])):
        close()


def close_with_tier(tier: str, close: Callable[[], object]) -> None:
    _closers.setdefault(tier, []).append(close)


def end_tier(tier: str) -> None:
    """Close what ``tier`` registered, newest first; the first failure is raised after all
    have run (so that one failing teardown leaves nothing else running)."""
    errors: list[BaseException] = []
    for close in reversed(_closers.pop(tier, [])):
        try:
            close()
        except BaseException as e:  # re-raised below, after the others have run
            errors.append(e)
    if errors:
        raise errors[0]


def _entered(
    tier: str, resource: contextlib.AbstractContextManager[T]
) -> tuple[T, contextlib.ExitStack]:
    stack = contextlib.ExitStack()
    value = stack.enter_context(resource)
    close_with_tier(tier, stack.close)
    return value, stack


@contextlib.contextmanager
def until_tier_ends(tier: str, resource: contextlib.AbstractContextManager[T]) -> Iterator[T]:
    """``resource`` entered now and exited when ``tier`` ends (or when this block ends, if
    that comes first)."""
    value, stack = _entered(tier, resource)
    try:
        yield value
    finally:
        stack.close()


@contextlib.contextmanager
def until_last_use(
    fixture: str, tier: str, resource: contextlib.AbstractContextManager[T]
) -> Iterator[T]:
    """``until_tier_ends``, and exited sooner: once the last test that uses ``fixture`` is
    done (``record_last_uses`` and ``end_uses``, called by the root ``tests/conftest.py``)."""
    value, stack = _entered(tier, resource)
    last = _last_use.get(fixture)
    if last is not None:
        _after_use.setdefault(last, []).append(stack.close)
    try:
        yield value
    finally:
        stack.close()
