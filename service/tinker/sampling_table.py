"""The gateway's table of Tinker sampling clients: each client's pinned weights (the step,
the adapter, an expiry from ``ttl_seconds``), and the step of every sampler-weights path this
start of the gateway issued. Bounded per party (``service/shares.py``): a party past its
share of ``sampling_clients`` forgets its own least recently used client (or its own oldest
path), never another party's; the evictions are counted. The routes that fill and read it:
``sampling_sessions.py``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainctl.api import GoneError, NotFoundError
from trainctl.service.shares import Shares, party
from trainctl.service.tenants import visible


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    base_model: str
    model_path: str | None
    step: int
    """The optimizer step of the weights this session samples (its adapter's, with one)."""
    adapter: str | None = None
    """The LoRA adapter it samples with; None: the base model."""
    inflight: bool = False
    """Tinker's ``inflight`` kind: this step or any newer one (the samplers follow training
    with ``--sampler-sync after_step``); a snapshot samples exactly ``step``."""
    expiry: Expiry | None = None
    """When the weights were saved with ``ttl_seconds``: when they stop being served."""
    tenant: str | None = None
    """Whose sampling client it is (None: the operator's, or a service without tenants)."""


@dataclass(frozen=True)
class Expiry:
    """Weights saved with Tinker's ``ttl_seconds``: servable until ``at`` (``time.time()``)."""

    at: float
    ttl_seconds: int

    @classmethod
    def after(cls, ttl_seconds: int | None) -> Expiry | None:
        return None if ttl_seconds is None else cls(time.time() + ttl_seconds, ttl_seconds)

    def check(self, what: str) -> None:
        """A 410 once the time is up."""
        if time.time() > self.at:
            raise GoneError(
                f"{what} were saved with ttl_seconds={self.ttl_seconds}, which have passed: "
                "they are no longer served; save the weights again for a new sampling client",
                details={"ttl_seconds": self.ttl_seconds, "expired": True},
            )


@dataclass(frozen=True)
class PinnedWeights:
    """What a ``save_weights_for_sampler`` path holds: its adapter (None: a full model), its
    step, and its expiry."""

    adapter: str | None
    step: int
    expiry: Expiry | None = None
    tenant: str | None = None
    """Whose path it is."""


class SamplingSessions:
    """Sampling sessions, and the step of every sampler-weights path this gateway issued."""

    def __init__(
        self,
        evicted: dict[str, int],
        shares: Shares | None = None,
        issued_before: Callable[[str], bool] = lambda _: False,
        finished: Callable[[str], str | None] = lambda _: None,
    ) -> None:
        self.shares, self.evicted = shares or Shares(), evicted
        self.issued_before = issued_before
        """Whether a Tinker session id came from an earlier start of the gateway."""
        self.finished = finished
        """A Tinker session's finish reason (None: it has not finished)."""
        self.evicted.setdefault("tinker_sampling_sessions", 0)
        self.sessions: OrderedDict[str, SamplingSession] = OrderedDict()
        """Every party's clients, least recently used first."""
        self.sampler_paths: OrderedDict[str, PinnedWeights] = OrderedDict()
        """Each ``save_weights_for_sampler`` path this start of the gateway issued."""

    def _make_room(self, table: OrderedDict[str, Any], tenant: str | None) -> None:
        """Drop ``tenant``'s own least recent entries of ``table`` past its share."""
        mine = [k for k, v in table.items() if v.tenant == tenant]
        for key in mine[: max(0, len(mine) - self.shares.of("sampling_clients"))]:
            del table[key]
            if table is self.sessions:
                self.evicted["tinker_sampling_sessions"] += 1
            self.shares.evict(tenant, "sampling_clients")

    def add(self, s: SamplingSession) -> SamplingSession:
        self.sessions[s.sampling_session_id] = s
        self.sessions.move_to_end(s.sampling_session_id)
        self._make_room(self.sessions, s.tenant)
        return s

    def forget_session(self, session_id: str) -> None:
        """Drop every sampling client of the Tinker session ``session_id`` (it ended)."""
        for k in [k for k in self.sessions if k.startswith(f"{session_id}:")]:
            del self.sessions[k]

    def forget_path(self, path: str) -> None:
        """A sampler-weights path that was deleted: it samples nothing any more."""
        self.sampler_paths.pop(path, None)

    def count(self, tenant: str | None) -> int:
        return sum(1 for s in self.sessions.values() if party(s.tenant) == party(tenant))

    def get(self, sampling_session_id: str, tenant: str | None) -> SamplingSession:
        """The sampling session, if the caller ``tenant`` may see it (404 otherwise)."""
        s = self.sessions.get(sampling_session_id)
        if s is not None and not visible(s.tenant, tenant):
            s = None
        session_id = sampling_session_id.split(":", 1)[0]
        reason = self.finished(session_id) if s is None else None
        if reason is not None:
            raise GoneError(
                f"sampling session {sampling_session_id!r} belongs to session {session_id}, "
                f"which finished ({reason}): its sampling clients were released; create one "
                "in a new session",
                details={"sampling_session_id": sampling_session_id, "finished": reason},
            )
        if s is None and self.issued_before(session_id):
            raise GoneError(
                f"sampling session {sampling_session_id!r} was made before the service "
                "restarted: a restart forgets sampling clients and empties the samplers' "
                "window of weight versions, so the weights it sampled are no longer served; "
                "create a sampling client again",
                details={"sampling_session_id": sampling_session_id, "restarted": True},
            )
        if s is None:
            raise NotFoundError(
                f"sampling session {sampling_session_id!r} is unknown or has expired: create "
                "a sampling client again"
            )
        if s.expiry is not None:
            s.expiry.check(f"the weights of step {s.step} this sampling client samples")
        self.sessions.move_to_end(sampling_session_id)  # used: the last its party drops
        return s

    def pinned(self, path: str, tenant: str | None) -> PinnedWeights:
        """The weights a ``save_weights_for_sampler`` path holds: 404 if this start of the
        gateway never issued it (or issued it to another tenant), 410 once its
        ``ttl_seconds`` passed."""
        pinned = self.sampler_paths.get(path)
        if pinned is None or not visible(pinned.tenant, tenant):
            raise NotFoundError(
                f"model_path: {path!r} was not saved through this gateway since it started "
                "(save_weights_for_sampler)"
            )
        if pinned.expiry is not None:
            pinned.expiry.check(f"the weights of {path!r}")
        return pinned

    def remember_path(self, path: str, weights: PinnedWeights) -> None:
        self.sampler_paths[path] = weights
        self.sampler_paths.move_to_end(path)
        self._make_room(self.sampler_paths, weights.tenant)
