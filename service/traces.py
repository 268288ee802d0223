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
MAX_EXPORTS = 16
MAX_EXPORT_BYTES = 256 * 2**20
"""The exports kept at once, and their bytes together: past either, the oldest goes."""


@dataclass(frozen=True)
class Export:
    body: bytes
    expires: float
    """``time.monotonic()`` past which it is gone."""


class TraceExports:
    """Session traces built for download, each under an unguessable token (its URL is the
    only credential, as a signed URL is). Owns the bodies, at most ``MAX_EXPORTS`` and
    ``MAX_EXPORT_BYTES`` of them, each for ``EXPORT_TTL_S``."""

    def __init__(self, ttl_s: float = EXPORT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._kept: OrderedDict[str, Export] = OrderedDict()

    def add(self, body: bytes) -> str:
        """Keep ``body``; its token."""
        self._expire()
        token = secrets.token_urlsafe(24)
        self._kept[token] = Export(body, time.monotonic() + self.ttl_s)
        while len(self._kept) > MAX_EXPORTS or self.nbytes > MAX_EXPORT_BYTES:
            self._kept.popitem(last=False)
        return token

    def get(self, token: str) -> bytes | None:
        self._expire()
        found = self._kept.get(token)
        return None if found is None else found.body

    @property
    def nbytes(self) -> int:
        return sum(len(e.body) for e in self._kept.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, e in self._kept.items() if e.expires < now]:
            del self._kept[token]
