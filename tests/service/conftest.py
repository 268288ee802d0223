"""One real trainctl service per test session: `trainctl serve` in its own process session,
real Ray, real Serve, real HTTP. Teardown sends SIGTERM, as Kubernetes does, and checks that
the service drained and exited cleanly with nothing left running.

Every service starts as on a fresh machine: a new empty HOME (so no ``~/.ray``) and none of
Ray's ``RAY_AUTH_*`` variables; trainctl must make its own Ray token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.servicekit import SHARED_RING_SPANS, Service, running_service
from helpers.tiers import until_tier_ends


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The embedded default: dp=2, each process keeping ``SHARED_RING_SPANS`` spans for the
    timeline (a ring the tests fill)."""
    data = tmp_path_factory.mktemp("trainctl-data")
    flags = ("--trace-spans", str(SHARED_RING_SPANS))
    with until_tier_ends("service", running_service(data, *flags)) as svc:
        yield svc
