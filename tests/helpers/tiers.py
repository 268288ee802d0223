"""Session resources that end with their tier.

A tier's costly resources (the rank pools of ``distributed/``, the running services of
``sampler/`` and ``service/``) are session fixtures, so that every module of the tier shares
them. Left to the end of the session they would stay up beside every later tier: idle Ray
clusters, vLLM engines and rank processes slowed the unit tier about fourfold in a CI run. A
fixture hands its teardown to ``close_with_tier``; the root ``conftest.py`` calls
``end_tier`` once the run leaves the tier's folder (and the fixture's own teardown, at the end
of the session, then finds nothing left to do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_closers: dict[str, list[Callable[[], object]]] = {}


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


@contextlib.contextmanager
def until_tier_ends(tier: str, resource: contextlib.AbstractContextManager[T]) -> Iterator[T]:
    """``resource`` entered now and exited when ``tier`` ends (or when this block ends, if
    that comes first)."""
    stack = contextlib.ExitStack()
    value = stack.enter_context(resource)
    close_with_tier(tier, stack.close)
    try:
        yield value
    finally:
        stack.close()
