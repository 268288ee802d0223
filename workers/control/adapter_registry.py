"""The controller's side of the LoRA adapters (docs/lora.md): which exist, each one's step and
split-step window, and the create/delete operations run on every rank in the queue's turn.

The adapters' tensors and AdamW state live on the ranks (``workers/engine/adapter_bank.py``); what
the controller keeps is what it answers without asking them: a ``ModelState`` per adapter (its
step, its ``forward_backward`` window), its spec, its size and when a call last named it. A
checkpoint load or a recovery re-reads the table from the ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trainctl.api import ConflictError, NotFoundError
from trainctl.api.adapters import AdapterInfo, AdapterList, CreateAdapterRequest
from trainctl.api.adapters import DeleteAdapterRequest as DeleteRequest
from trainctl.api.errors import field_error
from trainctl.workers.control.group import Group
from trainctl.workers.control.op_queue import Handle, Runner
from trainctl.workers.control.steps import ModelState
from trainctl.workers.engine import boundary
from trainctl.workers.engine.config import EngineConfig
from trainctl.workers.rank.worker import RankWorker


@dataclass
class Entry:
    spec: boundary.AdapterSpec
    state: ModelState = field(default_factory=ModelState)
    nbytes: int = 0
    last_used: float = field(default_factory=time.time)


class Adapters:
    """The controller's table of adapters. Owns each adapter's entry (spec, ``ModelState``, size,
    last use); the tensors are the ranks'."""

    def __init__(self, cfg: EngineConfig, group: Group) -> None:
        self.cfg, self.group = cfg, group
        self.entries: dict[str, Entry] = {}

    @property
    def enabled(self) -> bool:
        return self.cfg.lora.enabled

    def state(self, name: str) -> ModelState:
        """``name``'s step and window (a call names it: its last use is now)."""
        entry = self._entry(name)
        entry.last_used = time.time()
        return entry.state

    def open_windows(self) -> list[str]:
        """The adapters with ``forward_backward`` gradients waiting for their ``optim_step``."""
        return [name for name, e in self.entries.items() if e.state.window is not None]

    def _entry(self, name: str) -> Entry:
        if not self.enabled:
            raise field_error(
                "adapter", "this service holds no adapters (start it with --max-adapters N)"
            )
        if name not in self.entries:
            raise NotFoundError(
                f"adapter {name!r} does not exist (known: {sorted(self.entries)}); "
                "POST /v1/adapters creates one",
                details={"adapter": name},
            )
        return self.entries[name]

    # -- operations ------------------------------------------------------------------------------

    def create(self, req: CreateAdapterRequest) -> Runner:
        spec = boundary.AdapterSpec(
            name=req.name, rank=req.rank, alpha=req.alpha, dropout=req.dropout,
            targets=tuple(dict.fromkeys(req.targets)), seed=req.seed,
        )  # fmt: skip
        self._check_new(spec)  # refused now, not once queued

        async def run(h: Handle) -> AdapterInfo:
            self._check_new(spec)  # another create may have run in between
            h.set_phase("creating the adapter on every rank")
            await self.group.call(RankWorker.create_adapter, spec)
            infos = await self.group.call(RankWorker.adapter_infos)
            nbytes = next(i.nbytes for i in infos[0] if i.spec.name == spec.name)
            self.entries[spec.name] = Entry(spec=spec, nbytes=nbytes)
            return self._info(spec.name)

        return run

    def check_room(self, name: str, field: str = "adapter") -> None:
        """Refuse a service without adapters, or a new adapter ``name`` past --max-adapters
        (one that exists is replaced, and needs no room)."""
        lora = self.cfg.lora
        if not self.enabled:
            raise field_error(
                field, "this service holds no adapters (start it with --max-adapters N)"
            )
        if name not in self.entries and len(self.entries) >= lora.max_adapters:
            raise ConflictError(
                f"{len(self.entries)} adapters exist and this service holds at most "
                f"{lora.max_adapters} (--max-adapters): delete one first",
                details={"max_adapters": lora.max_adapters},
            )

    def _check_new(self, spec: boundary.AdapterSpec) -> None:
        if self.enabled and spec.name in self.entries:
            raise ConflictError(f"adapter {spec.name!r} exists already; delete it first")
        self.check_room(spec.name, "name")
        if spec.rank > self.cfg.lora.max_rank:
            raise field_error(
                "rank",
                f"{spec.rank} exceeds this service's --lora-max-rank ({self.cfg.lora.max_rank})",
            )

    def delete(self, req: DeleteRequest) -> Runner:
        self._entry(req.name)

        async def run(h: Handle) -> AdapterList:
            self._entry(req.name)
            await self.group.call(RankWorker.delete_adapter, req.name)
            del self.entries[req.name]
            return self.list()

        return run

    # -- the table -------------------------------------------------------------------------------

    def _info(self, name: str) -> AdapterInfo:
        e = self.entries[name]
        return AdapterInfo(
            name=name, rank=e.spec.rank, alpha=e.spec.alpha, dropout=e.spec.dropout,
            targets=list(e.spec.targets), step=e.state.step, bytes=e.nbytes,
            last_used=e.last_used,
        )  # fmt: skip

    def list(self) -> AdapterList:
        return AdapterList(
            adapters=[self._info(n) for n in self.entries],
            max_adapters=self.cfg.lora.max_adapters,
            max_rank=self.cfg.lora.max_rank,
        )

    async def reread(self, only: str | None = None) -> None:
        """After a checkpoint load or a recovery: the adapters the ranks now hold, their steps
        from the checkpoint, no window open. ``only``: that adapter was loaded alone; every
        other entry (its step, its open window) stays."""
        if not self.enabled:
            return
        infos = (await self.group.call(RankWorker.adapter_infos))[0]
        read = {
            i.spec.name: Entry(spec=i.spec, state=ModelState(step=i.step), nbytes=i.nbytes)
            for i in infos
        }
        if only is None:
            self.entries = read
        else:
            self.entries[only] = read[only]
