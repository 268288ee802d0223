"""Tenants: who a key belongs to, and the names each tenant's things get.

``--api-keys FILE`` gives one line per key, ``TENANT KEY`` (``#`` starts a comment):

    alice  3f9c1e...   # at least 16 characters
    bob    77aa02...

A tenant reaches the Tinker API with ``X-API-Key: tml-<KEY>``. Everything a tenant makes
is named inside its own space: the adapter of a Tinker LoRA model, the owner of the
checkpoints and exports it saves, its sessions, models, futures and sampling clients. A name
of a tenant's space is ``<tenant>.<name>``; no name another tenant can give resolves to
one, so another tenant's model, adapter, checkpoint or sampling path is a 404, not a 403
(the key holder learns nothing of what others hold). The service's token (``--api-token``)
is the operator's: it sees and changes everything, and it alone reaches the native API.

The file is read again when it changes (looked at once a second at most), so a Kubernetes
Secret update or an edit takes effect without a restart; ``trainctl serve`` also checks it
on SIGHUP and logs the result. A file that no longer parses keeps the keys read before, and
the error is logged.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
"""A tenant's name: no '.', which separates it from the names in its space."""
MIN_KEY_CHARS = 16
RECHECK_S = 1.0


def scoped(tenant: str | None, name: str) -> str:
    """``name`` in ``tenant``'s space (None: the operator's, unchanged)."""
    return name if tenant is None else f"{tenant}.{name}"


def visible(tenant: str | None, to: str | None) -> bool:
    """Whether something of ``tenant`` is visible to the caller ``to`` (None: the operator,
    who sees everything)."""
    return to is None or tenant == to


def parse_keys(text: str, source: str = "api_keys") -> dict[str, str]:
    """Key -> tenant from the file's text; a ValueError naming the line for anything else."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}: line {n}: want 'TENANT KEY', got {len(parts)} fields")
        tenant, key = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(
                f"{source}: line {n}: tenant {tenant[:40]!r} is not a name (letters, digits, "
                "'_', '-'; 32 at most; no '.')"
            )
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"{source}: line {n}: the key is shorter than {MIN_KEY_CHARS}")
        if key in keys:
            raise ValueError(f"{source}: line {n}: this key is given twice")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{source}: no keys in the file")
    return keys


class TenantKeys:
    """The keys file, read again when it changes. Owns the key -> tenant table."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._keys = parse_keys(self.path.read_text(), str(self.path))
        self._seen = self._signature()
        self._checked = time.monotonic()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        signature = self._signature()
        if signature == self._seen:
            return
        self._seen = signature
        try:
            self._keys = parse_keys(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as e:
            log.error("api keys not reloaded, the keys read before stay: %s", e)
            return
        log.info("api keys reloaded: %d tenant(s)", len(set(self._keys.values())))

    @property
    def tenants(self) -> set[str]:
        return set(self._keys.values())

    def tenant_of(self, key: str) -> str | None:
        """The tenant of ``key``, or None; every key is compared, in constant time."""
        self.reload_if_changed()
        found = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found
