from __future__ import annotations

from collections.abc import Iterator

import pytest

from rankpool import RankPool


@pytest.fixture(scope="module")
def pool1() -> Iterator[RankPool]:
    pool = RankPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2() -> Iterator[RankPool]:
    pool = RankPool(2)
    yield pool
    pool.close()
