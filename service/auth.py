"""Who may call which route: one dependency on the whole app, and deny by default.

Every route the app serves runs ``authorize`` first (``create_app`` installs it as an
app-wide dependency). The route's own declaration says how it is reached:

* ``BEARER`` (the default, so a route that says nothing needs the token):
  ``Authorization: Bearer <token>``, 401 without it, 403 if wrong;
* ``TINKER``: ``X-API-Key: tml-<token>``, as the ``tinker`` SDK sends it;
* ``OPEN``: no credentials (liveness, readiness, the SDK's bare ``dynamic_config``).

The decision reads the *matched route*, never the URL: a route prefix (Ray Serve's
``route_prefix``, a proxy's ``root_path``) changes the path but not the route, so it cannot
turn a check off. Tokens are compared in constant time and never logged or echoed.

With tenant keys (``--api-keys``, ``service/tenants.py``), a Tinker route also takes
``tml-<tenant key>``; the request then acts for that tenant (``tenant_of``) and sees only
its own. The service's token is the operator's and sees everything; the native API takes
the operator's token only.
"""

import enum
import hmac
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from trainctl.api.errors import ForbiddenError, UnauthorizedError
from trainctl.service.tenants import TenantKeys

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__trainctl_access__"


class Access(enum.Enum):
    BEARER = "bearer"
    TINKER = "tinker"
    OPEN = "open"


def access(kind: Access) -> Callable[[F], F]:
    """Declare how an endpoint is reached (put it under the route decorator)."""

    def mark(endpoint: F) -> F:
        setattr(endpoint, _ATTR, kind)
        return endpoint

    return mark


def access_of(route: Any) -> Access:
    """The route's declared access; ``BEARER`` when it declares none."""
    kind = getattr(getattr(route, "endpoint", None), _ATTR, Access.BEARER)
    return kind if isinstance(kind, Access) else Access.BEARER


def _matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def is_operator(request: Request) -> bool:
    """Whether ``request`` carries the service's token (``Authorization: Bearer``), or the
    service has none (whoever reaches it is the operator). For an open route that shows the
    operator more (``/metrics``' tenant names)."""
    token: str | None = request.app.state.api_token
    if token is None:
        return getattr(request.app.state, "api_keys", None) is None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and _matches(given.strip(), token)


def tenant_of(request: Request) -> str | None:
    """The tenant a request acts for (``authorize`` set it); None: the operator, or a
    service without tenant keys."""
    return getattr(request.state, "tenant", None)


def authorize(request: Request) -> None:
    """The app-wide dependency: check the matched route's credentials, and note the tenant
    the request acts for."""
    token: str | None = request.app.state.api_token
    keys: TenantKeys | None = getattr(request.app.state, "api_keys", None)
    request.state.tenant = None
    kind = access_of(request.scope.get("route"))
    if kind is Access.OPEN:
        return
    if kind is Access.TINKER:
        key = request.headers.get("x-api-key", "")
        if not key.startswith("tml-"):
            raise UnauthorizedError(
                "send X-API-Key: tml-<token> (the service's API token after 'tml-')"
            )
        given = key.removeprefix("tml-")
        if token is not None and _matches(given, token):
            return
        tenant = keys.tenant_of(given) if keys is not None else None
        if tenant is not None:
            request.state.tenant = tenant
            return
        if token is not None or keys is not None:  # unknown, or revoked: not authenticated
            raise UnauthorizedError("the API key is not valid")
        return
    if token is None and keys is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <token>'")
    if token is not None and _matches(given.strip(), token):
        return
    if keys is not None and keys.tenant_of(given.strip()) is not None:
        raise ForbiddenError(
            "a tenant key reaches the Tinker API (X-API-Key: tml-<key>); this route needs "
            "the service's own token"
        )
    raise UnauthorizedError("the bearer token is not valid")
