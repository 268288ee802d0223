"""Three tenants and an operator on one service: their keys, and raw Tinker calls as each."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

KEYS = {
    "alice": "alice-key-0a1b2c3d4e5f6a7b",
    "bob": "bob-key-9f8e7d6c5b4a3f2e",
    "carol": "carol-key-5566778899aabbcc",
}
OPERATOR = "operator-token-5f1e2d3c4b5a6978"
"""The service's own token: the operator's."""


def keys_text(keys: dict[str, str] = KEYS) -> str:
    return "# tenant key\n" + "".join(f"{t} {k}\n" for t, k in keys.items())


def headers(tenant: str | None) -> dict[str, str]:
    return {"X-API-Key": f"tml-{OPERATOR if tenant is None else KEYS[tenant]}"}


def post(url: str, route: str, body: Any, tenant: str | None, **kw: Any) -> httpx.Response:
    """``POST /api/v1/<route>`` as ``tenant`` (None: the operator)."""
    return httpx.post(f"{url}/api/v1/{route}", json=body, headers=headers(tenant), timeout=60,
                      **kw)  # fmt: skip


def settled(url: str, future: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """The finished future, as its tenant retrieves it (a protobuf result, a sample's, as
    ``{"protobuf": bytes}``)."""
    while True:
        r = post(url, "retrieve_future", {"request_id": future["request_id"]}, tenant)
        if r.headers.get("content-type") == "application/x-protobuf":
            return {"protobuf": r.content}
        body = r.json()
        if body.get("type") != "try_again":
            return body  # type: ignore[no-any-return]


def until(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Whether ``check()`` holds within ``timeout_s`` (asked every 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False
