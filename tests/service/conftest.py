"""One real trainctl service per test session: `trainctl serve` in its own process session,
real Ray, real Serve, real HTTP. Teardown sends SIGTERM, as Kubernetes does, and checks that
the service drained and exited cleanly with nothing left running."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainctl.service.local import LocalService

START_TIMEOUT_S = 300


Service = LocalService


@contextlib.contextmanager
def running_service(
    data_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[Service]:
    """`trainctl serve FLAGS` until the block ends; then SIGTERM and a clean-exit check."""
    svc = LocalService(data_dir, *flags, start_timeout_s=START_TIMEOUT_S, env=env)
    try:
        svc.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield svc
    rc = svc.stop()
    assert rc == 0, f"trainctl serve exited with {rc}:\n{svc.log()}"
    assert not svc.leftovers, f"processes left after shutdown: {svc.leftovers}"
    assert "drained in-flight work" in svc.log()


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default: dp=2."""
    with running_service(tmp_path_factory.mktemp("trainctl-data")) as svc:
        yield svc
