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
on SIGHUP and logs the result. A reload fails closed: the good lines are the keys (so a
removal takes effect even beside a typo), a bad line grants nothing, and a file that is gone,
unreadable, empty or comments only revokes every tenant's key (``TenantKeys``). At start a
file with a bad line, or with no key, is refused.
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


def read_keys(text: str, source: str = "api_keys") -> tuple[dict[str, str], list[str]]:
    """Key -> tenant from the file's good lines, and what is wrong with each other line (a
    bad line grants nothing: its key, if any, is not taken)."""
    keys: dict[str, str] = {}
    twice: set[str] = set()
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            problems.append(f"{source}: line {n}: want 'TENANT KEY', got {len(parts)} fields")
            continue
        tenant, key = parts
        if not TENANT_NAME.fullmatch(tenant):
            problems.append(
                f"{source}: line {n}: tenant {tenant[:40]!r} is not a name (letters, digits, "
                "'_', '-'; 32 at most; no '.')"
            )
        elif len(key) < MIN_KEY_CHARS:
            problems.append(f"{source}: line {n}: the key is shorter than {MIN_KEY_CHARS}")
        elif key in keys or key in twice:
            problems.append(f"{source}: line {n}: this key is given twice")
            keys.pop(key, None)  # no holder gets it: which one was meant is not known
            twice.add(key)
        else:
            keys[key] = tenant
    return keys, problems


def parse_keys(text: str, source: str = "api_keys") -> dict[str, str]:
    """Key -> tenant, strictly (at start): a ValueError naming the first bad line, or saying
    the file holds no key (a service whose tenants file grants nobody is a mistake)."""
    keys, problems = read_keys(text, source)
    if problems:
        raise ValueError(problems[0])
    if not keys:
        raise ValueError(f"{source}: no keys in the file")
    return keys


class TenantKeys:
    """The keys file, read again when it changes, failing closed. Owns the key -> tenant
    table and the count of each reload's outcome (``outcomes``):

    - ``applied``: every line parsed; the table is the file's;
    - ``partial``: the good lines are the table (a removal takes effect), each bad line is
      refused and logged;
    - ``revoked``: the file is gone, unreadable, empty or comments only: no key is valid
      until it holds keys again.
    """

    OUTCOMES = ("applied", "partial", "revoked")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._keys = parse_keys(self.path.read_text(), str(self.path))
        self._seen = self._signature()
        self._checked = time.monotonic()
        self.outcomes = dict.fromkeys(self.OUTCOMES, 0)

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
            keys, problems = read_keys(self.path.read_text(), str(self.path))
        except OSError as e:
            keys, problems = {}, [f"{self.path}: {e.strerror or e}"]
        self._keys = keys
        if not keys:
            outcome = "revoked"
            why = "; ".join(problems) or f"{self.path}: no keys in the file"
            log.error("api keys: every tenant's key revoked (%s)", why)
        elif problems:
            outcome = "partial"
            log.error("api keys reloaded: %d tenant(s); %d bad line(s) grant nothing: %s",
                      len(self.tenants), len(problems), "; ".join(problems))  # fmt: skip
        else:
            outcome = "applied"
            log.info("api keys reloaded: %d tenant(s)", len(self.tenants))
        self.outcomes[outcome] += 1

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
