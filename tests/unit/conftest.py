from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from trainctl.service.app import create_app

from helpers.fakes import FakeController


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture
def http(fake: FakeController) -> Iterator[TestClient]:
    # As a context manager the app keeps one event loop, as under Serve: the operation
    # queue's worker task lives on it.
    with TestClient(create_app(fake)) as client:
        yield client
