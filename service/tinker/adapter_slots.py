"""Each party's LoRA adapter slots on a ``--max-adapters`` service, and their release.

A Tinker LoRA model trains an adapter of its own, named in its tenant's space
(``<tenant>.<session>-train-<n>``, ``state.native_name``). Each party (a tenant, or the
operator's token) may hold its share of ``--max-adapters`` (``service/shares.py``); a model
past it is refused with a 409 naming the party's quota and the adapters it holds.

A slot is freed when its model's session finishes (``ServiceClient.close`` posts
``sessions/{id}/finish``), expires or is evicted: the adapter is deleted through the
controller's queue, after the model's own requests already queued. What the model saved
(``save_state``, ``save_weights_for_sampler``) stays on disk and loads again. An adapter of a
Tinker model that no live handle names any more (a gateway restart forgets its sessions; a
release that failed) is freed the next time its party needs the room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from trainctl.api import (
    ConflictError,
    DeleteAdapterRequest,
    NotFoundError,
    NotReadyError,
    OperationKind,
    RateLimitedError,
)
from trainctl.api.operations import fingerprint
from trainctl.service.controller_client import ControllerAPI
from trainctl.service.shares import party
from trainctl.service.tenants import scoped
from trainctl.service.tinker.state import Model, TinkerState, whose

log = logging.getLogger(__name__)

_TINKER_ADAPTER = re.compile(r"[0-9a-f]{16}-train-\d+")
"""A Tinker model's adapter, without its tenant's prefix."""
RELEASE_TRIES = 30
"""How often a release is tried while the controller's queue is full or not ready."""


def is_tinker_adapter(name: str, tenant: str | None) -> bool:
    """Whether ``name`` is the adapter of a Tinker model of ``tenant``'s (None: the
    operator's, whose adapters carry no prefix)."""
    prefix = scoped(tenant, "")
    return name.startswith(prefix) and _TINKER_ADAPTER.fullmatch(name[len(prefix) :]) is not None


class AdapterSlots:
    """Owns the adapter quota of each party and the release of slots; the adapters
    themselves are the controller's."""

    def __init__(self, controller: Callable[[], ControllerAPI], state: TinkerState) -> None:
        self._controller, self.state = controller, state
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: dict[str, set[str]] = {}
        """Per party: adapters a queued load will create (not on the controller yet)."""
        self.releasing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def room(self, tenant: str | None) -> AsyncIterator[None]:
        """Hold ``tenant``'s slots while one of its models takes one: a 409 now if the party
        holds its quota (the adapters on the controller and those a queued load will create,
        after freeing the ones no live model trains); two creations of one party cannot both
        take the last slot."""
        p = party(tenant)
        lock = self._locks.setdefault(p, asyncio.Lock())
        async with lock:
            self.state.expire_sessions()  # an hour silent: its models' slots are free
            bound, held = await self._held(tenant)
            share = self.state.shares.of("adapters", bound)
            live = self.state.live_adapters(tenant)
            pending = self._pending.setdefault(p, set())
            pending &= live  # a load whose session ended creates nothing that counts
            if len(held | pending) >= share:
                for name in sorted(held - live):
                    log.info("freeing adapter %s: no live Tinker model trains it", name)
                    await self._delete(name)
                _, held = await self._held(tenant)
            taken = sorted(held | pending)
            if len(taken) >= share:
                self.state.shares.refuse(tenant, "adapters")
                raise ConflictError(
                    f"{whose(tenant)} holds {len(taken)} LoRA adapters ({', '.join(taken)}), "
                    f"its whole quota: {self.state.shares.describe('adapters', bound)}; finish a "
                    "session (ServiceClient.close) to free its models' adapters",
                    details={"table": "adapters", "share": share, "held": taken},
                )
            yield

    def pending_until(self, tenant: str | None, name: str, done: asyncio.Event) -> None:
        """Count ``name`` as taken until ``done`` (the future of the load that creates it)."""
        mine = self._pending.setdefault(party(tenant), set())
        mine.add(name)

        async def settle() -> None:
            await done.wait()
            mine.discard(name)

        self._spawn(settle())

    @property
    def controller(self) -> ControllerAPI:
        return self._controller()

    async def _held(self, tenant: str | None) -> tuple[int, set[str]]:
        """``--max-adapters``, and the adapters of ``tenant``'s Tinker models, in one
        listing."""
        listing = await self.controller.list_adapters()
        mine = {a.name for a in listing.adapters if is_tinker_adapter(a.name, tenant)}
        return listing.max_adapters, mine

    def release(self, models: list[Model]) -> None:
        """Free the adapters of ``models`` (their session ended), in the background."""
        for m in models:
            if m.adapter is not None:
                self._spawn(self._release(m.adapter))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)

    async def _release(self, name: str) -> None:
        for _ in range(RELEASE_TRIES):
            try:
                await self._delete(name)
                log.info("adapter %s freed: its Tinker session ended", name)
                return
            except (RateLimitedError, NotReadyError) as e:
                await asyncio.sleep(e.retry_after_s or 1.0)
            except Exception:
                log.exception("adapter %s not freed; its party frees it when it needs room", name)
                return
        log.warning("adapter %s not freed (the queue stayed full); freed when needed", name)

    async def _delete(self, name: str) -> None:
        req = DeleteAdapterRequest(name=name)
        with contextlib.suppress(NotFoundError):  # gone already: the slot is free
            await self.controller.run(OperationKind.DELETE_ADAPTER, req, None, fingerprint(req))
