"""Tinker's sessions, model handles and futures, in the gateway (pure asyncio, no I/O).

* **Futures.** Every Tinker call answers a future id at once; ``retrieve_future`` long-polls
  it. A future ends with a result or an error with a category (``user``, ``server``,
  ``unknown``). Finished futures are kept up to each party's share, its oldest dropped first.
* **Ordering.** Per model, requests run in ``seq_id`` order: a request is *admitted* (handed
  to the controller's queue, which runs in arrival order) only after the one before it. A
  request whose predecessor does not arrive within ``order_timeout_s`` fails, saying which
  ``seq_id`` it waited for.
* **Deduplication** on ``(model_id, seq_id)``: the same payload again returns the first
  future; another payload is a 409. (The SDK's outer retry sends a new idempotency key, so
  the key alone would apply a retried step twice.) A model remembers its last
  ``DEDUP_WINDOW`` seq_ids.
* **Refusals pass the turn.** A request refused after its ``seq_id`` is known (a bad field,
  a full queue that never frees) fails its own future and lets the next ``seq_id`` run;
  a controller queue that is full (429) is waited out, since the future was accepted.
* **Fair shares.** Every table here is bounded per party (each tenant, and the operator),
  by the rule of ``service/shares.py``: sessions, model handles, finished futures, requests
  parked for their turn (count and bytes), samples in flight, and the requests a party has
  in the controller's operation queue (past its share they wait for its own to finish). A
  party over its share evicts its own entries where that loses nothing it still uses (a
  session silent for ``SILENT_S``, a finished future) and is refused otherwise (429, 409 for
  model handles), never another party's. Sessions not heard from for ``session_ttl_s``
  expire with their model handles.
* **Releases.** A session that finishes, expires or is evicted hands its model handles to
  ``on_release`` (the routes free their adapter slots and sampling clients there).

One gateway replica holds this state (the Serve deployment runs one); the controller keeps
what must outlive it (the weights, their step, checkpoints).

One concern, at its length: the ``seq_id`` order of Tinker calls and the tables it needs
(sessions, handles, futures, parked requests), in one place because a party's share of one
table is freed by releases in the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainctl.api import (
    ConflictError,
    ErrorBody,
    ErrorType,
    GoneError,
    NotFoundError,
    RateLimitedError,
    TrainctlError,
)
from trainctl.api.errors import validation_problem
from trainctl.service.errors import public
from trainctl.service.shares import Shares, party
from trainctl.service.tenants import scoped, visible
from trainctl.workers import spans

log = logging.getLogger(__name__)

DEDUP_WINDOW = 1024
"""seq_ids per model whose payload fingerprints are kept for deduplication."""
ADMIT_WAIT_S = 600.0
"""How long an accepted request waits for room in a full controller queue."""
SILENT_S = 30.0
"""A session silent this long (three of the SDK's 10 s heartbeats missed) may be evicted to
make room for a new session of its own party; a party whose sessions are all livelier is
refused instead."""
FAR_AHEAD_WAIT_S = 5.0
"""How long a request parks when its ``seq_id`` is further ahead of its model's next than its
party may park requests: the gap cannot be a pipelined client's, so it holds its place in
the waiting room only briefly."""

Admit = Callable[[], Awaitable[Awaitable[Any]]]
"""Runs in the request's turn and returns what finishes it: the turn passes to the next
``seq_id`` once the controller has the request, not once it is done."""


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The id of a session's ``model_seq_id``-th model, as the SDK derives it on its side."""
    return f"{session_id}:train:{model_seq_id}"


def native_name(model_id: str, tenant: str | None) -> str:
    """A Tinker model's native name (``:`` is not allowed in names), in its tenant's space:
    the adapter it trains, if it is a LoRA model, and the owner of the checkpoint and export
    names it saves. Another tenant's model can never be named from here."""
    return scoped(tenant, model_id.replace(":", "-"))


def category(e: BaseException) -> str:
    """Tinker's error category: ``user`` for a request the client can fix (4xx)."""
    if isinstance(e, ValidationError):
        return "user"
    if isinstance(e, TrainctlError):  # 429 is the server's state, not the user's mistake
        return "user" if 400 <= e.status < 500 and e.status != 429 else "server"
    return "unknown"


def describe(e: BaseException) -> str:
    """The error's message, naming the field where there is one."""
    if isinstance(e, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {validation_problem(err)}"
            for err in e.errors()
        )
    if isinstance(e, TrainctlError) and e.status < 500:
        return e.message
    body = e.body() if isinstance(e, TrainctlError) else None
    body = body or ErrorBody(type=ErrorType.INTERNAL, message=f"{type(e).__name__}: {e}")
    shown = public(body)  # a server error: no paths, addresses or remote tracebacks
    return f"{shown.message} (error_id {shown.details['error_id']})"


@dataclass(eq=False)
class Future:
    id: str
    kind: str
    tenant: str | None = None
    """Whose request it answers (None: the operator's, or a service without tenants)."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None
    error: tuple[str, str] | None = None
    """``(message, category)`` when failed."""

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            self.error = (describe(error), category(error))
        else:
            self.result = result
        self.done.set()


@dataclass(eq=False)
class Model:
    """A model handle: ``{session_id}:train:{model_seq_id}``. A full-weight handle trains the
    one served model, a LoRA handle its own adapter; each keeps its own ``seq_id`` order."""

    model_id: str
    session_id: str
    next_seq: int = 1
    adapter: str | None = None
    """A LoRA model's native adapter; None: the full model."""
    tenant: str | None = None
    """Its session's tenant."""

    @property
    def native(self) -> str:
        """Its native name, in its tenant's space: its adapter (a LoRA model) and the owner
        of the checkpoints and exports it saves."""
        return native_name(self.model_id, self.tenant)

    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    seen: dict[int, tuple[str, str]] = field(default_factory=dict)
    """``seq_id`` -> (payload fingerprint, future id)."""


def whose(tenant: str | None) -> str:
    """The party ``tenant`` names, in words."""
    return "the operator" if tenant is None else f"tenant {tenant!r}"


def over_share(
    shares: Shares, tenant: str | None, table: str, holds: str, fix: str
) -> RateLimitedError:
    """The 429 of a party over its share of ``table``, counted."""
    shares.refuse(tenant, table)
    return RateLimitedError(
        f"{whose(tenant)} {holds}, its whole share: {shares.describe(table)}; {fix}",
        details={"table": table, "share": shares.of(table), "tenant": tenant},
        retry_after_s=2.0,
    )


@dataclass(eq=False)
class Session:
    session_id: str
    tenant: str | None = None
    finished: str | None = None
    """The finish reason, once finished."""
    last_seen: float = field(default_factory=time.monotonic)
    model_seqs: set[int] = field(default_factory=set)
    """The ``model_seq_id`` of every model handle made in this session."""
    started: float = field(default_factory=time.time)
    """When it was created (Unix seconds): its trace export starts there."""
    traces: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """The traces of its calls (``export_session_trace``), the newest ``TRACES_PER_SESSION``."""

    def traced(self) -> None:
        """Note the trace of the call being served (the gateway's span of it) as this
        session's: its spans on every process are the session's trace export."""
        trace_id = spans.trace_id_of(spans.traceparent())
        if trace_id is None:
            return
        self.traces[trace_id] = None
        self.traces.move_to_end(trace_id)
        while len(self.traces) > TRACES_PER_SESSION:
            self.traces.popitem(last=False)


TRACES_PER_SESSION = 512
"""The traces a session's export can hold: its newest calls' (about 100 KB a session; the
rings keep recent spans only, 20,000 a process by default, so older calls' are gone anyway)."""


MAX_MODELS_PER_SESSION = 256
"""Model handles one session may make; a client that needs more starts another session."""


EPOCH_CHARS = 6
"""Hex characters of a session id that name the gateway's start (16.7 M starts apart)."""


class TinkerState:
    def __init__(
        self,
        *,
        order_timeout_s: float = 60.0,
        session_ttl_s: float = 3600.0,
        shares: Shares | None = None,
    ) -> None:
        self.order_timeout_s = order_timeout_s
        self.session_ttl_s = session_ttl_s
        self.shares = shares or Shares()
        self.silent_s = SILENT_S
        self.evicted = {"tinker_sessions": 0, "tinker_futures": 0, "tinker_dedup": 0}
        """Entries dropped from each bounded table (the gateway's /metrics shows them)."""
        self.parked: Counter[str] = Counter()
        self.parked_bytes: Counter[str] = Counter()
        """Per party: requests (and their body bytes) parked for their seq_id turn."""
        self.sampling: Counter[str] = Counter()
        """Per party: samples in flight (their futures not yet done)."""
        self.admitted: Counter[str] = Counter()
        """Per party: requests handed to the controller's queue and not yet finished."""
        self._operations = asyncio.Condition()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.futures: dict[str, Future] = {}
        self._futures_of: dict[str, OrderedDict[str, None]] = {}
        """Per party: its futures' ids, oldest first (the order its share drops them in)."""
        self.created: dict[tuple[str, int], tuple[str, str]] = {}
        """(session_id, model_seq_id) -> (fingerprint, future id) of the model's creation."""
        self.on_release: Callable[[Session, list[Model]], None] = lambda s, models: None
        """Called with a session that finished or left the table, and its model handles."""
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.epoch = uuid.uuid4().hex[:EPOCH_CHARS]
        """This start of the gateway: the first characters of every session id it issues."""

    @property
    def waiting(self) -> int:
        """Requests parked for their seq_id turn, every party's."""
        return sum(self.parked.values())

    @property
    def waiting_bytes(self) -> int:
        return sum(self.parked_bytes.values())

    # -- sessions and models -------------------------------------------------------------------

    def create_session(self, tenant: str | None) -> str:
        """A new session of ``tenant``'s. Past the party's share, its own longest silent
        session goes (a finished one first), if silent for ``silent_s``; else a 429."""
        self.expire_sessions()
        mine = [s for s in self.sessions.values() if s.tenant == tenant]
        if len(mine) >= self.shares.of("sessions"):
            oldest = min(mine, key=lambda s: (s.finished is None, s.last_seen))
            if oldest.finished is None and time.monotonic() - oldest.last_seen < self.silent_s:
                raise over_share(
                    self.shares, tenant, "sessions", f"holds {len(mine)} Tinker sessions",
                    f"none has been silent for {self.silent_s:g} s: close a ServiceClient "
                    "(its session finishes) or wait for one to fall silent",
                )  # fmt: skip
            self._drop_session(oldest)
            self.shares.evict(tenant, "sessions")
        session_id = self.epoch + uuid.uuid4().hex[: 16 - EPOCH_CHARS]
        self.sessions[session_id] = Session(session_id, tenant)
        return session_id

    def issued_before_this_start(self, session_id: str) -> bool:
        """Whether ``session_id`` has the shape of one this gateway issues but another start
        of it issued (a restart forgets every session and empties the samplers' window)."""
        return (
            len(session_id) == 16
            and all(c in "0123456789abcdef" for c in session_id)
            and not session_id.startswith(self.epoch)
        )

    def session(self, session_id: str, tenant: str | None, finished: bool = False) -> Session:
        """``session_id``, if the caller ``tenant`` may see it (a 404 otherwise); a finished
        one is a 410 unless ``finished`` (the routes that read a session's end)."""
        s = self.sessions.get(session_id)
        if s is None or not visible(s.tenant, tenant):
            raise NotFoundError(
                f"session {session_id!r} does not exist, expired, or was evicted to make room "
                "for a newer session of its tenant's (create_session first)"
            )
        if s.finished is not None and not finished:
            raise GoneError(
                f"session {session_id!r} finished ({s.finished}): its models and sampling "
                "clients were released; start a new session (a saved state loads there)",
                details={"session_id": session_id, "finished": s.finished},
            )
        s.last_seen = time.monotonic()
        s.traced()
        return s

    def traced(self, session_id: str) -> None:
        """Note the call being served as ``session_id``'s (a sample on one of its sampling
        clients); nothing if the session is gone."""
        s = self.sessions.get(session_id)
        if s is not None:
            s.traced()

    def finish(self, s: Session, reason: str) -> None:
        """End ``s`` (the first reason wins): its models are released, and a call on them
        is a 410 from now on."""
        if s.finished is None:
            s.finished = reason
            self.on_release(s, self._models_of(s))

    def finish_reason(self, session_id: str) -> str | None:
        """Why ``session_id`` finished (None: it has not, or is not in the table)."""
        s = self.sessions.get(session_id)
        return None if s is None else s.finished

    def _models_of(self, s: Session) -> list[Model]:
        return [m for m in self.models.values() if m.session_id == s.session_id]

    def live_adapters(self, tenant: str | None) -> set[str]:
        """The adapters the live models of ``tenant``'s party train (their sessions have
        not ended)."""
        return {
            m.adapter for m in self.models.values()
            if m.adapter is not None and party(m.tenant) == party(tenant)
            and (s := self.sessions.get(m.session_id)) is not None and s.finished is None
        }  # fmt: skip

    def expire_sessions(self) -> None:
        """Drop the sessions not heard from for ``session_ttl_s``, with their models."""
        cutoff = time.monotonic() - self.session_ttl_s
        for s in [s for s in self.sessions.values() if s.last_seen < cutoff]:
            log.info("tinker session %s expired (silent for %.0f s)", s.session_id,
                     self.session_ttl_s)  # fmt: skip
            self._drop_session(s)

    def _drop_session(self, s: Session) -> None:
        del self.sessions[s.session_id]
        self.evicted["tinker_sessions"] += 1
        models = self._models_of(s)
        for m in models:
            del self.models[m.model_id]
        for key in [k for k in self.created if k[0] == s.session_id]:
            del self.created[key]
        if s.finished is None:  # a finished session released its models already
            self.on_release(s, models)

    def reserve_model(self, session_id: str, model_seq_id: int, tenant: str | None) -> None:
        """Count ``model_seq_id`` against its session's ``MAX_MODELS_PER_SESSION``; a 409
        past it (handles are never evicted while their session lives: a client holds them)."""
        s = self.session(session_id, tenant)
        self._count_model(s, model_seq_id)

    def _count_model(self, s: Session, model_seq_id: int) -> None:
        session_id = s.session_id
        if model_seq_id in s.model_seqs:
            return
        if len(s.model_seqs) >= MAX_MODELS_PER_SESSION:
            raise ConflictError(
                f"session {session_id} already holds {MAX_MODELS_PER_SESSION} model handles, "
                "the most one session may make: start another session",
                details={"limit": MAX_MODELS_PER_SESSION},
            )
        held = sum(len(x.model_seqs) for x in self.sessions.values() if x.tenant == s.tenant)
        if held >= self.shares.of("models"):
            self.shares.refuse(s.tenant, "models")
            raise ConflictError(
                f"{whose(s.tenant)} holds {held} Tinker model handles, its whole share: "
                f"{self.shares.describe('models')}; finish a session (ServiceClient.close) "
                "to release its models",
                details={"table": "models", "share": self.shares.of("models")},
            )
        s.model_seqs.add(model_seq_id)

    def add_model(
        self, session_id: str, model_seq_id: int, first_seq: int = 1, adapter: str | None = None
    ) -> Model:
        """The handle ``{session_id}:train:{model_seq_id}``, made if new; its requests start at
        ``first_seq`` (1 after ``create_model``; 0 when its creation is a load, which is
        its own request 0)."""
        session = self.sessions.get(session_id)
        if session is None or session.finished is not None:  # it ended while the model was made
            raise GoneError(
                f"session {session_id!r} ended while its model {model_seq_id} was being made; "
                "start a new session"
            )
        self._count_model(session, model_seq_id)
        model_id = model_id_of(session_id, model_seq_id)
        m = self.models.get(model_id)
        if m is None:
            m = Model(model_id, session_id, next_seq=first_seq, tenant=session.tenant)
            self.models[model_id] = m
        m.adapter = adapter
        return m

    def find_model(self, model_id: object, tenant: str | None) -> Model | None:
        """The handle ``model_id``, if it exists and the caller ``tenant`` may see it."""
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        return m if m is not None and visible(m.tenant, tenant) else None

    def model(self, model_id: str, tenant: str | None) -> Model:
        """The handle ``model_id`` (a 404 unless the caller ``tenant`` may see it)."""
        m = self.find_model(model_id, tenant)
        if m is None:
            raise NotFoundError(
                f"model {model_id!r} does not exist: create it with create_model (or "
                "create_training_client_from_state) in this server's lifetime; a session "
                "silent for long expires with its models"
            )
        self.session(m.session_id, tenant)  # a call on a model keeps its session alive
        return m

    # -- futures -------------------------------------------------------------------------------

    def new_future(self, kind: str, tenant: str | None) -> Future:
        """A new future of ``tenant``'s; past the party's share, its own oldest finished
        futures are forgotten (one still running never is: other bounds hold those)."""
        f = Future(f"tf-{next(self._ids):06d}-{uuid.uuid4().hex[:8]}", kind, tenant)
        self.futures[f.id] = f
        mine = self._futures_of.setdefault(party(tenant), OrderedDict())
        mine[f.id] = None
        while len(mine) > self.shares.of("futures"):
            oldest = self.futures[next(iter(mine))]
            if not oldest.done.is_set():
                break
            mine.popitem(last=False)
            del self.futures[oldest.id]
            self.evicted["tinker_futures"] += 1
            self.shares.evict(tenant, "futures")
        return f

    def future(self, future_id: str, tenant: str | None) -> Future:
        f = self.futures.get(future_id)
        if f is None or not visible(f.tenant, tenant):
            raise NotFoundError(f"future {future_id!r} is unknown or has expired")
        return f

    def run(self, kind: str, work: Callable[[], Awaitable[Any]], tenant: str | None) -> Future:
        """A future of ``tenant``'s for ``work``, run now (no ordering: model creation)."""
        f = self.new_future(kind, tenant)
        self._spawn(self._finish(f, work))
        return f

    def failed(self, kind: str, error: Exception, tenant: str | None) -> Future:
        """A future of ``tenant``'s that has failed with ``error`` already."""
        f = self.new_future(kind, tenant)
        f.finish(error=error)
        return f

    def sample(self, work: Callable[[], Awaitable[Any]], tenant: str | None) -> Future:
        """``run`` for a sample, counted against the party's share of samples in flight (a
        429 past it, before any future exists)."""
        p = party(tenant)
        if self.sampling[p] >= self.shares.of("samples"):
            raise over_share(
                self.shares, tenant, "samples", f"has {self.sampling[p]} samples in flight",
                "retry once some have finished",
            )  # fmt: skip
        self.sampling[p] += 1

        async def counted() -> Any:
            try:
                return await work()
            finally:
                self.sampling[p] -= 1

        return self.run("sample", counted, tenant)

    def once(
        self,
        registry: dict[Any, tuple[str, str]],
        key: Any,
        fingerprint: str,
        make: Callable[[], Future],
    ) -> Future:
        """The future registered under ``key`` for the same payload, else ``make()``'s."""
        seen = registry.get(key)
        if seen is not None:
            if seen[0] != fingerprint:
                raise ConflictError(
                    f"{key} was already sent with a different payload; nothing was applied",
                    details={"future": seen[1]},
                )
            if seen[1] in self.futures:
                log.info("tinker retry of %s: future %s", key, seen[1])
                return self.futures[seen[1]]
        f = make()
        registry[key] = (fingerprint, f.id)
        return f

    def submit(
        self,
        model: Model,
        seq_id: int,
        fingerprint: str,
        kind: str,
        admit: Admit,
        nbytes: int = 0,
    ) -> Future:
        """The future of ``model``'s request ``seq_id``: admitted in ``seq_id`` order, once
        (a retry with the same payload gets the first future; another payload, a 409).
        ``nbytes``: what the request holds while it waits for its turn (bounded)."""
        if seq_id < model.next_seq and seq_id not in model.seen:
            raise ConflictError(
                f"seq_id {seq_id} of model {model.model_id} is behind the next expected "
                f"({model.next_seq}): seq_ids count up from 1 per model"
            )

        def make() -> Future:
            p = party(model.tenant)
            share_bytes = self.shares.of("parked_bytes")
            if seq_id > model.next_seq and self.parked_bytes[p] + nbytes > share_bytes:
                raise over_share(
                    self.shares, model.tenant, "parked_bytes",
                    f"has {self.parked_bytes[p]} bytes parked for their seq_id turn (this "
                    f"request adds {nbytes})",
                    "send each model's requests in seq_id order, or retry after Retry-After",
                )  # fmt: skip
            if seq_id > model.next_seq and self.parked[p] >= self.shares.of("parked"):
                raise over_share(
                    self.shares, model.tenant, "parked",
                    f"has {self.parked[p]} requests parked for their seq_id turn",
                    "send each model's requests in seq_id order, or retry after Retry-After",
                )  # fmt: skip
            f = self.new_future(kind, model.tenant)
            parks = seq_id > model.next_seq
            if parks:  # counted now: the next request sees it, whenever the task runs
                self.parked[p] += 1
                self.parked_bytes[p] += nbytes
            self._spawn(self._in_turn(model, seq_id, f, admit, nbytes if parks else None))
            return f

        f = self.once(model.seen, seq_id, fingerprint, make)
        while len(model.seen) > DEDUP_WINDOW:
            del model.seen[min(model.seen)]
            self.evicted["tinker_dedup"] += 1
        return f

    def refuse(self, model: Model, seq_id: int, fingerprint: str, error: Exception) -> None:
        """A request refused before it could be queued: its ``seq_id`` turn passes on, so
        the model's later requests do not wait for it."""

        async def fail() -> Awaitable[Any]:
            raise error

        # Behind, a duplicate or no room: then the turn is not this request's to pass.
        with contextlib.suppress(TrainctlError):
            self.submit(model, seq_id, fingerprint, "refused", fail)

    async def _in_turn(
        self, model: Model, seq_id: int, f: Future, admit: Admit, parked: int | None
    ) -> None:
        """``parked``: the bytes of a request counted as parked (None: it was not)."""
        p = party(model.tenant)
        timeout = self.order_timeout_s
        if seq_id - model.next_seq > self.shares.of("parked"):  # no pipeline is that deep
            timeout = min(timeout, FAR_AHEAD_WAIT_S)
        try:
            async with model.turn:
                await asyncio.wait_for(
                    model.turn.wait_for(lambda: model.next_seq >= seq_id), timeout
                )
        except asyncio.TimeoutError:
            f.finish(
                error=ConflictError(
                    f"seq_id {seq_id} of model {model.model_id} waited {timeout:g} s "
                    f"for seq_id {model.next_seq}, which never arrived; requests of a model run "
                    "in seq_id order"
                )
            )
            return
        finally:
            if parked is not None:
                self.parked[p] -= 1
                self.parked_bytes[p] -= parked
        try:
            finishing = await self._admit_in_share(p, admit)
        except Exception as e:
            f.finish(error=e)
            finishing = None
        async with model.turn:
            model.next_seq = max(model.next_seq, seq_id + 1)
            model.turn.notify_all()
        if finishing is not None:
            try:
                await self._finish(f, lambda: finishing)
            finally:
                await self._operation_done(p)

    async def _admit_in_share(self, p: str, admit: Admit) -> Awaitable[Any]:
        """``admit()`` once the party ``p`` has fewer than its share of operations in the
        controller's queue (its own finishing make room): one tenant's burst cannot fill the
        queue that every tenant's steps go through. The wait holds the model's turn, as a
        full queue does."""
        async with self._operations:
            await self._operations.wait_for(lambda: self.admitted[p] < self.shares.of("operations"))
            self.admitted[p] += 1
        try:
            return await self._admit(admit)
        except BaseException:
            await self._operation_done(p)
            raise

    async def _operation_done(self, p: str) -> None:
        async with self._operations:
            self.admitted[p] -= 1
            self._operations.notify_all()

    @staticmethod
    async def _admit(admit: Admit) -> Awaitable[Any]:
        """``admit()``, waiting out a full controller queue: the future was accepted, so a
        429 from the queue is the server's backlog, not the request's failure."""
        deadline = time.monotonic() + ADMIT_WAIT_S
        while True:
            try:
                return await admit()
            except RateLimitedError as e:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(e.retry_after_s or 1.0)

    async def _finish(self, f: Future, work: Callable[[], Awaitable[Any]]) -> None:
        try:
            f.finish(await work())
        except Exception as e:
            if not isinstance(e, TrainctlError) or e.status >= 500:
                log.warning("tinker %s %s failed: %s", f.kind, f.id, e)
            f.finish(error=e)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
