"""Rank pools live for the whole session: starting torch and megatron-core costs seconds per
process, so every test module shares one pool per world size."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rankpool import RankPool


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], RankPool]]:
    started: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in started:
            started[world_size] = RankPool(world_size)
        return started[world_size]

    yield get
    for pool in started.values():
        pool.close()


@pytest.fixture
def pool1(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(1)


@pytest.fixture
def pool2(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(2)
