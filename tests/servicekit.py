"""A real trainctl service for the tiers that need one (service, sampler): `trainctl serve` in
its own process session, real Ray, real Serve, real HTTP. Teardown sends SIGTERM, as
Kubernetes does, and checks that the service drained and exited cleanly with nothing left
running.

Every service starts as on a fresh machine: a new empty HOME (so no ``~/.ray``) and none of
Ray's ``RAY_AUTH_*`` variables; trainctl must make its own Ray token.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainctl.service.local import LocalService

START_TIMEOUT_S = 300


Service = LocalService


def digest(value: str | None) -> str:
    """``value``, checked to be a real sha256 digest: two empty or missing digests must never
    compare equal by accident."""
    assert value is not None and re.fullmatch(r"[0-9a-f]{64}", value), repr(value)
    return value


RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def fresh_home(data_dir: Path) -> dict[str, str | None]:
    """The environment of a new user: an empty HOME beside ``data_dir``, no Ray auth vars."""
    home = data_dir.parent / f"{data_dir.name}-home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        **dict.fromkeys(RAY_AUTH_VARS),
    }


@contextlib.contextmanager
def running_service(
    data_dir: Path, *flags: str, env: dict[str, str | None] | None = None
) -> Iterator[Service]:
    """`trainctl serve FLAGS` until the block ends; then SIGTERM and a clean-exit check."""
    env = {**fresh_home(data_dir), **(env or {})}
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
