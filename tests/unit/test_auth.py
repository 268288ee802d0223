"""Auth is decided by the matched route, on every route, whatever prefix the app is under.

The route list drives the test: a new route is covered without editing it, and one that
declares no access needs the bearer token.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from trainctl.service.app import create_app
from trainctl.service.auth import Access

from helpers.fakes import FakeController
from helpers.servicekit import served_routes

TOKEN = "s3cret-token"
OPEN_PATHS = {
    "/v1/health", "/v1/ready", "/api/v1/client/dynamic_config", "/api/v1/healthz", "/metrics",
    "/api/v1/trace_exports/x",  # its unguessable token is the credential (a signed URL)
}  # fmt: skip


def _routes(app: object) -> list[tuple[str, str, Access]]:
    return [(m, re.sub(r"\{[^}]+\}", "x", p), a) for m, p, a in served_routes(app)]


@pytest.fixture(params=["", "/trainctl"], ids=["no-prefix", "route-prefix"])
def prefixed(request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, str]]:
    """The app under no prefix and under Serve's ``route_prefix`` (kept in the path)."""
    app = create_app(FakeController(), api_token=TOKEN, fault_injection=True)
    with TestClient(app, root_path=request.param) as client:
        yield client, request.param


def test_open_routes_are_exactly_the_declared_ones() -> None:
    app = create_app(FakeController(), api_token=TOKEN, fault_injection=True)
    declared = {p for _, p, a in _routes(app) if a is Access.OPEN}
    assert declared == OPEN_PATHS


def test_every_route_refuses_a_missing_or_wrong_credential(
    prefixed: tuple[TestClient, str],
) -> None:
    http, prefix = prefixed
    routes = _routes(http.app)
    assert len(routes) > 30  # the native and the Tinker routes
    for method, path, kind in routes:
        if kind is Access.OPEN:
            continue
        bare = http.request(method, prefix + path)
        assert bare.status_code == 401, (method, prefix + path, bare.status_code, bare.text)
        wrong = (
            {"x-api-key": "tml-not-it"} if kind is Access.TINKER
            else {"authorization": "Bearer not-it"}
        )  # fmt: skip
        denied = http.request(method, prefix + path, headers=wrong)
        assert denied.status_code == 401, (method, prefix + path, denied.text)
        assert TOKEN not in denied.text


def test_the_reviewed_bypass_under_a_route_prefix_is_closed(
    prefixed: tuple[TestClient, str],
) -> None:
    """The review's probes: info, the checkpoint list and a save answered 200 without a token
    under ``route_prefix: /trainctl``."""
    http, prefix = prefixed
    for method, path in [("GET", "/v1/info"), ("GET", "/v1/checkpoints"),
                         ("POST", "/v1/checkpoints")]:  # fmt: skip
        assert http.request(method, prefix + path).status_code == 401
    ok = http.get(prefix + "/v1/info", headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200, ok.text
    assert http.get(prefix + "/v1/health").status_code == 200
    tinker = http.post(
        prefix + "/api/v1/create_session", json={}, headers={"x-api-key": f"tml-{TOKEN}"}
    )
    assert tinker.status_code == 200, tinker.text


def test_without_a_token_native_routes_are_open_and_tinker_still_wants_its_key() -> None:
    with TestClient(create_app(FakeController())) as http:
        assert http.get("/v1/info").status_code == 200
        assert http.post("/api/v1/create_session", json={}).status_code == 401
        ok = http.post("/api/v1/create_session", json={}, headers={"x-api-key": "tml-any"})
        assert ok.status_code == 200


def test_metrics_and_docs_can_be_closed() -> None:
    app = create_app(FakeController(), api_token=TOKEN, open_metrics=False, open_docs=False)
    with TestClient(app) as http:
        assert "/metrics" not in {p for _, p, a in _routes(app) if a is Access.OPEN}
        assert http.get("/metrics").status_code == 401
        assert http.get("/openapi.json").status_code == 401
        assert http.get("/docs").status_code == 404
        bearer = {"authorization": f"Bearer {TOKEN}"}
        assert http.get("/metrics", headers=bearer).status_code == 200
        assert http.get("/openapi.json", headers=bearer).json()["paths"]
    with TestClient(create_app(FakeController(), api_token=TOKEN)) as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/openapi.json").status_code == 200
