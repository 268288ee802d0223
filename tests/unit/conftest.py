from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from trainctl.service.app import create_app
from trainctl.service.cluster import free_port

from fakes import FakeController


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture
def http(fake: FakeController) -> Iterator[TestClient]:
    # As a context manager the app keeps one event loop, as under Serve: the operation
    # queue's worker task lives on it.
    with TestClient(create_app(fake)) as client:
        yield client


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a loopback port, as a real HTTP server; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
