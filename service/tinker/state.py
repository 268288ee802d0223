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
  the key alone would apply a retried step twice.)

One gateway replica holds this state (the Serve deployment runs one); the controller keeps
what must outlive it (the weights, their step, checkpoints).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainctl.api import ConflictError, NotFoundError, TrainctlError

log = logging.getLogger(__name__)

Admit = Callable[[], Awaitable[Awaitable[Any]]]
"""Runs in the request's turn and returns what finishes it: the turn passes to the next
``seq_id`` once the controller has the request, not once it is done."""


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The id of a session's ``model_seq_id``-th model, as the SDK derives it on its side."""
    return f"{session_id}:train:{model_seq_id}"


def category(e: BaseException) -> str:
    """Tinker's error category: ``user`` for a request the client can fix (4xx)."""
    if isinstance(e, ValidationError):
        return "user"
    if isinstance(e, TrainctlError):
        return "user" if 400 <= e.status < 500 else "server"
    return "unknown"


def describe(e: BaseException) -> str:
    """The error's message, naming the field where there is one."""
    if isinstance(e, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
            for err in e.errors()
        )
    return e.message if isinstance(e, TrainctlError) else f"{type(e).__name__}: {e}"


@dataclass(eq=False)
class Future:
    id: str
    kind: str
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
    """A model handle: ``{session_id}:train:{model_seq_id}``. Every handle trains the one
    served model; each keeps its own ``seq_id`` order."""

    model_id: str
    session_id: str
    next_seq: int = 1
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    seen: dict[int, tuple[str, str]] = field(default_factory=dict)
    """``seq_id`` -> (payload fingerprint, future id)."""


@dataclass(eq=False)
class Session:
    session_id: str
    finished: str | None = None
    """The finish reason, once finished."""


class TinkerState:
    def __init__(self, *, order_timeout_s: float = 60.0, keep_finished: int = 4096) -> None:
        self.order_timeout_s = order_timeout_s
        self.keep_finished = keep_finished
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self.created: dict[tuple[str, int], tuple[str, str]] = {}
        """(session_id, model_seq_id) -> (fingerprint, future id) of the model's creation."""
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- sessions and models -------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = uuid.uuid4().hex[:16]
        self.sessions[session_id] = Session(session_id)
        return session_id

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise NotFoundError(f"session {session_id!r} does not exist (create_session first)")
        return s

    def add_model(self, session_id: str, model_seq_id: int, first_seq: int = 1) -> Model:
        """The handle ``{session_id}:train:{model_seq_id}``, made if new; its requests start at
        ``first_seq`` (1 after ``create_model``; 0 when its creation is a load, which is
        its own request 0)."""
        model_id = model_id_of(session_id, model_seq_id)
        m = self.models.get(model_id)
        if m is None:
            m = self.models[model_id] = Model(model_id, session_id, next_seq=first_seq)
        return m

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise NotFoundError(
                f"model {model_id!r} does not exist: create it with create_model (or "
                "create_training_client_from_state) in this server's lifetime"
            )
        return m

    # -- futures -------------------------------------------------------------------------------

    def new_future(self, kind: str) -> Future:
        f = Future(f"tf-{next(self._ids):06d}-{uuid.uuid4().hex[:8]}", kind)
        self.futures[f.id] = f
        while len(self.futures) > self.keep_finished:
            oldest = next(iter(self.futures.values()))
            if not oldest.done.is_set():
                break
            self.futures.popitem(last=False)
        return f

    def future(self, future_id: str) -> Future:
        f = self.futures.get(future_id)
        if f is None:
            raise NotFoundError(f"future {future_id!r} is unknown or has expired")
        return f

    def run(self, kind: str, work: Callable[[], Awaitable[Any]]) -> Future:
        """A future for ``work``, run now (no ordering: model creation and loads)."""
        f = self.new_future(kind)
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
        self, model: Model, seq_id: int, fingerprint: str, kind: str, admit: Admit
    ) -> Future:
        """The future of ``model``'s request ``seq_id``: admitted in ``seq_id`` order, once
        (a retry with the same payload gets the first future; another payload, a 409)."""
        if seq_id < model.next_seq and seq_id not in model.seen:
            raise ConflictError(
                f"seq_id {seq_id} of model {model.model_id} is behind the next expected "
                f"({model.next_seq}): seq_ids count up from 1 per model"
            )

        def make() -> Future:
            f = self.new_future(kind)
            self._spawn(self._in_turn(model, seq_id, f, admit))
            return f

        return self.once(model.seen, seq_id, fingerprint, make)

    async def _in_turn(self, model: Model, seq_id: int, f: Future, admit: Admit) -> None:
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
        try:
            finishing = await admit()
        except Exception as e:
            f.finish(error=e)
            finishing = None
        async with model.turn:
            model.next_seq = max(model.next_seq, seq_id + 1)
            model.turn.notify_all()
        if finishing is not None:
            await self._finish(f, lambda: finishing)

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
