"""Tinker's sessions, model handles and futures, in the gateway (pure asyncio, no I/O).

* **Futures.** Every Tinker call answers a future id at once; ``retrieve_future`` long-polls
  it. A future ends with a result or an error with a category (``user``, ``server``,
  ``unknown``). Finished futures are kept up to ``keep_finished``, oldest dropped first.
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
* **Bounds.** Requests waiting for their turn are capped in count and bytes (429 past
  either); sessions not heard from for ``session_ttl_s`` expire with their model handles,
  and at most ``max_sessions`` are kept.

One gateway replica holds this state (the Serve deployment runs one); the controller keeps
what must outlive it (the weights, their step, checkpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainctl.api import (
    ConflictError,
    ErrorBody,
    ErrorType,
    NotFoundError,
    RateLimitedError,
    TrainctlError,
)
from trainctl.service.errors import public
from trainctl.service.tenants import scoped, visible

log = logging.getLogger(__name__)

DEDUP_WINDOW = 1024
"""seq_ids per model whose payload fingerprints are kept for deduplication."""
ADMIT_WAIT_S = 600.0
"""How long an accepted request waits for room in a full controller queue."""

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
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
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


@dataclass(eq=False)
class Session:
    session_id: str
    tenant: str | None = None
    finished: str | None = None
    """The finish reason, once finished."""
    last_seen: float = field(default_factory=time.monotonic)
    model_seqs: set[int] = field(default_factory=set)
    """The ``model_seq_id`` of every model handle made in this session."""


MAX_MODELS_PER_SESSION = 256
"""Model handles one session may make; a client that needs more starts another session."""


EPOCH_CHARS = 6
"""Hex characters of a session id that name the gateway's start (16.7 M starts apart)."""


class TinkerState:
    def __init__(
        self,
        *,
        order_timeout_s: float = 60.0,
        keep_finished: int = 4096,
        max_waiting: int = 256,
        max_waiting_bytes: int = 256 << 20,
        session_ttl_s: float = 3600.0,
        max_sessions: int = 1024,
    ) -> None:
        self.order_timeout_s = order_timeout_s
        self.keep_finished = keep_finished
        self.max_waiting, self.max_waiting_bytes = max_waiting, max_waiting_bytes
        self.session_ttl_s, self.max_sessions = session_ttl_s, max_sessions
        self.evicted = {"tinker_sessions": 0, "tinker_futures": 0, "tinker_dedup": 0}
        """Entries dropped from each bounded table (the gateway's /metrics shows them)."""
        self.waiting = 0
        self.waiting_bytes = 0
        """Requests (and their body bytes) waiting for their seq_id turn."""
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self.created: dict[tuple[str, int], tuple[str, str]] = {}
        """(session_id, model_seq_id) -> (fingerprint, future id) of the model's creation."""
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.epoch = uuid.uuid4().hex[:EPOCH_CHARS]
        """This start of the gateway: the first characters of every session id it issues."""

    # -- sessions and models -------------------------------------------------------------------

    def create_session(self, tenant: str | None) -> str:
        self.expire_sessions()
        while len(self.sessions) >= self.max_sessions:  # the longest silent goes first
            self._drop_session(min(self.sessions.values(), key=lambda s: s.last_seen))
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

    def session(self, session_id: str, tenant: str | None) -> Session:
        """``session_id``, if the caller ``tenant`` may see it (a 404 otherwise)."""
        s = self.sessions.get(session_id)
        if s is None or not visible(s.tenant, tenant):
            raise NotFoundError(
                f"session {session_id!r} does not exist or expired (create_session first)"
            )
        s.last_seen = time.monotonic()
        return s

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
        for model_id in [m for m, h in self.models.items() if h.session_id == s.session_id]:
            del self.models[model_id]
        for key in [k for k in self.created if k[0] == s.session_id]:
            del self.created[key]

    def reserve_model(self, session_id: str, model_seq_id: int, tenant: str | None) -> None:
        """Count ``model_seq_id`` against its session's ``MAX_MODELS_PER_SESSION``; a 409
        past it (handles are never evicted while their session lives: a client holds them)."""
        s = self.session(session_id, tenant)
        self._count_model(s, model_seq_id)

    def _count_model(self, s: Session, model_seq_id: int) -> None:
        session_id = s.session_id
        if model_seq_id not in s.model_seqs and len(s.model_seqs) >= MAX_MODELS_PER_SESSION:
            raise ConflictError(
                f"session {session_id} already holds {MAX_MODELS_PER_SESSION} model handles, "
                "the most one session may make: start another session",
                details={"limit": MAX_MODELS_PER_SESSION},
            )
        s.model_seqs.add(model_seq_id)

    def add_model(
        self, session_id: str, model_seq_id: int, first_seq: int = 1, adapter: str | None = None
    ) -> Model:
        """The handle ``{session_id}:train:{model_seq_id}``, made if new; its requests start at
        ``first_seq`` (1 after ``create_model``; 0 when its creation is a load, which is
        its own request 0)."""
        if session_id in self.sessions:  # the routes check the session first
            self._count_model(self.sessions[session_id], model_seq_id)
        model_id = model_id_of(session_id, model_seq_id)
        m = self.models.get(model_id)
        if m is None:
            session = self.sessions.get(session_id)
            tenant = session.tenant if session is not None else None
            m = Model(model_id, session_id, next_seq=first_seq, tenant=tenant)
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
        f = Future(f"tf-{next(self._ids):06d}-{uuid.uuid4().hex[:8]}", kind, tenant)
        self.futures[f.id] = f
        while len(self.futures) > self.keep_finished:
            oldest = next(iter(self.futures.values()))
            if not oldest.done.is_set():
                break
            self.futures.popitem(last=False)
            self.evicted["tinker_futures"] += 1
        return f

    def future(self, future_id: str, tenant: str | None) -> Future:
        f = self.futures.get(future_id)
        if f is None or not visible(f.tenant, tenant):
            raise NotFoundError(f"future {future_id!r} is unknown or has expired")
        return f

    def run(self, kind: str, work: Callable[[], Awaitable[Any]], tenant: str | None) -> Future:
        """A future of ``tenant``'s for ``work``, run now (no ordering: model creation,
        samples)."""
        f = self.new_future(kind, tenant)
        self._spawn(self._finish(f, work))
        return f

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
            if seq_id > model.next_seq and (
                self.waiting >= self.max_waiting
                or self.waiting_bytes + nbytes > self.max_waiting_bytes
            ):
                err = RateLimitedError(
                    f"{self.waiting} requests ({self.waiting_bytes} bytes) already wait for "
                    f"their seq_id turn (limits {self.max_waiting}, {self.max_waiting_bytes} "
                    "bytes); retry after the Retry-After seconds"
                )
                err.retry_after_s = 2.0
                raise err
            f = self.new_future(kind, model.tenant)
            self._spawn(self._in_turn(model, seq_id, f, admit, nbytes))
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
        self, model: Model, seq_id: int, f: Future, admit: Admit, nbytes: int = 0
    ) -> None:
        waits = seq_id > model.next_seq
        if waits:
            self.waiting, self.waiting_bytes = self.waiting + 1, self.waiting_bytes + nbytes
        try:
            async with model.turn:
                await asyncio.wait_for(
                    model.turn.wait_for(lambda: model.next_seq >= seq_id), self.order_timeout_s
                )
        except asyncio.TimeoutError:
            f.finish(
                error=ConflictError(
                    f"seq_id {seq_id} of model {model.model_id} waited {self.order_timeout_s:g} s "
                    f"for seq_id {model.next_seq}, which never arrived; requests of a model run "
                    "in seq_id order"
                )
            )
            return
        finally:
            if waits:
                self.waiting, self.waiting_bytes = self.waiting - 1, self.waiting_bytes - nbytes
        try:
            finishing = await self._admit(admit)
        except Exception as e:
            f.finish(error=e)
            finishing = None
        async with model.turn:
            model.next_seq = max(model.next_seq, seq_id + 1)
            model.turn.notify_all()
        if finishing is not None:
            await self._finish(f, lambda: finishing)

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
