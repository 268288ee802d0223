from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from trainctl.service.app import create_app

from fakes import FakeController


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture
def http(fake: FakeController) -> TestClient:
    return TestClient(create_app(fake))
