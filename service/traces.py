"""The gateway's reads of the timeline: its own spans and the controller's collection (the
controller's, every rank's and every engine's), on the gateway's clock; and the session
traces it keeps for Tinker's ``export_session_trace`` until they are fetched or expire."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from trainctl.service.controller_client import ControllerAPI
from trainctl.workers import spans


async def gather(
    controller: ControllerAPI, since: float, until: float
) -> tuple[list[spans.SpanRecord], int]:
    """Every process's spans overlapping ``[since, until]`` (the gateway's clock), each
    shifted by its clock's offset from the gateway's as measured now, and the count of spans
    their rings dropped so far."""
    sent = spans.now()
    remote_now = await controller.clock()
    offset = spans.clock_offset(remote_now, sent, spans.now())
    remote, dropped = await controller.timeline(since - offset, until - offset)
    found = spans.between(since, until) + [spans.shifted(s, offset) for s in remote]
    return found, dropped + spans.dropped()


EXPORT_TTL_S = 3600.0
"""How long an exported session trace stays downloadable (Tinker's signed URLs: an hour)."""
EXPORTS_PER_PARTY = 4
MAX_EXPORT_BYTES = 256 * 2**20
"""The exports each party (a tenant, or the operator) keeps at once, and the bytes of all
parties' together: past its own count a party's oldest goes; past the bytes, the oldest of the
party holding the most. One tenant exporting in a loop never pushes out another's."""


@dataclass(frozen=True)
class Export:
    body: bytes
    expires: float
    """``time.monotonic()`` past which it is gone."""


class TraceExports:
    """Session traces built for download, each under an unguessable token (its URL is the
    only credential, as a signed URL is). Owns the bodies, by party: at most
    ``EXPORTS_PER_PARTY`` a party and ``MAX_EXPORT_BYTES`` in all, each for ``ttl_s``."""

    def __init__(self, ttl_s: float = EXPORT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._by_party: dict[str, OrderedDict[str, Export]] = {}

    def add(self, body: bytes, party: str) -> str:
        """Keep ``body`` as ``party``'s; its token."""
        self._expire()
        token = secrets.token_urlsafe(24)
        mine = self._by_party.setdefault(party, OrderedDict())
        mine[token] = Export(body, time.monotonic() + self.ttl_s)
        while len(mine) > EXPORTS_PER_PARTY:
            mine.popitem(last=False)
        while self.nbytes > MAX_EXPORT_BYTES:
            largest = max(
                self._by_party.values(), key=lambda kept: sum(len(e.body) for e in kept.values())
            )
            largest.popitem(last=False)
        return token

    def get(self, token: str) -> bytes | None:
        self._expire()
        for kept in self._by_party.values():
            if (found := kept.get(token)) is not None:
                return found.body
        return None

    @property
    def nbytes(self) -> int:
        return sum(len(e.body) for kept in self._by_party.values() for e in kept.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for kept in self._by_party.values():
            for token in [t for t, e in kept.items() if e.expires < now]:
                del kept[token]
