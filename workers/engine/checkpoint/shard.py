"""The shard's checkpoint: its training state as a dict of tensors and plain
containers (what ``torch.load(weights_only=True)`` reads back), checked before it is loaded.
Two formats: the per-rank one, which loads only into the layout that wrote it, and the
reshardable one (``reshard.py``), which loads into any layout of the same model."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from trainctl.workers.engine import weights, zero
from trainctl.workers.engine.adapter_bank import AdapterBank, Slot, renamed
from trainctl.workers.engine.boundary import AdapterSpec
from trainctl.workers.engine.checkpoint import reshard
from trainctl.workers.engine.optimizer import ShardOptimizer
from trainctl.workers.engine.parallel import ShardContext


class ShardCheckpoint:
    """Owns the format of this rank's training state on disk (weights, optimizer state, step,
    adapters, RNG, coordinates), and its check and load. It reads and writes the shard's model
    chunks, its ``ShardOptimizer`` and its adapters; it keeps nothing of its own."""

    def __init__(
        self, ctx: ShardContext, *, optim: ShardOptimizer, adapters: AdapterBank | None
    ) -> None:
        self.cfg, self.coords, self.dims, self.chunks = ctx.cfg, ctx.coords, ctx.dims, ctx.chunks
        self.optim, self.adapters = optim, adapters
        self.local_experts = self.cfg.model.num_experts // self.cfg.layout.ep

    def state(self, adapter: str | None = None) -> dict[str, Any]:
        """Everything this rank needs to resume: weights, optimizer state, step, RNG;
        ``adapter``: that adapter alone (its weights, AdamW state and step)."""
        if adapter is not None:
            return {
                "adapter_only": adapter,
                "adapters": self._bank().state(only=adapter),
                "coords": dataclasses.asdict(self.coords),
            }
        return {
            # A tied embedding is saved once, by the first stage; the last stage's copy is
            # restored from it on load.
            "chunks": [
                {
                    k: v
                    for k, v in c.module.state_dict().items()
                    if k not in weights.tied_copies(c.module)
                }
                for c in self.chunks
            ],
            "optimizer": (
                zero.state(self.optim.optimizer)
                if self.optim.zero
                else self.optim.optimizer.state_dict()
            ),
            "step": self.optim.step,
            # Every adapter's tensors, AdamW state and step (workers/engine/adapter_bank.py).
            "adapters": self.adapters.state() if self.adapters is not None else {},
            "rng": torch.get_rng_state(),
            "coords": dataclasses.asdict(self.coords),
        }

    def _bank(self) -> AdapterBank:
        if self.adapters is None:
            raise ValueError(
                "adapter: this service holds no adapters (start it with --max-adapters N)"
            )
        return self.adapters

    def check(
        self, state: dict[str, Any], adapter: str | None = None, into: str | None = None
    ) -> None:
        """Raise unless ``state`` loads here: this rank's coordinates, and every chunk's
        tensors with this shard's names and shapes (``adapter``: that adapter's, loaded as
        ``into``). Changes nothing."""
        if state.get("coords") != dataclasses.asdict(self.coords):
            raise ValueError(
                f"checkpoint shard of {state.get('coords')} loaded on rank {self.coords}: "
                "a checkpoint loads into the layout it was saved from"
            )
        _check_whole(state.get("adapter_only"), adapter)
        if adapter is not None:
            self._bank().check_one(adapter, state.get("adapters") or {}, into)
            return
        chunks = state.get("chunks")
        if not isinstance(chunks, list) or len(chunks) != len(self.chunks):
            raise ValueError(f"checkpoint shard: {len(self.chunks)} model chunk(s) expected")
        for c, sd in zip(self.chunks, chunks, strict=True):
            own = {
                k: v for k, v in c.module.state_dict().items()
                if k not in weights.tied_copies(c.module)
            }  # fmt: skip
            if not isinstance(sd, dict) or sd.keys() != own.keys():
                got = set(sd) if isinstance(sd, dict) else set()
                raise ValueError(
                    f"checkpoint shard: missing {sorted(own.keys() - got)[:5]}, "
                    f"unexpected {sorted(got - own.keys())[:5]}"
                )
            for k, v in own.items():
                shape = getattr(sd[k], "shape", None)
                if isinstance(v, torch.Tensor) and shape != v.shape:
                    raise ValueError(
                        f"checkpoint shard: {k} has shape {shape}, not {tuple(v.shape)}"
                    )

    def load(
        self,
        state: dict[str, Any],
        *,
        optimizer: bool = True,
        adapter: str | None = None,
        into: str | None = None,
    ) -> None:
        """Inverse of ``state`` (same layout: the coordinates must match). Without
        ``optimizer``, the weights and step only: the optimizer starts afresh on them.
        ``adapter``: that adapter alone (as ``into``), and nothing else changes."""
        self.check(state, adapter, into)
        if adapter is not None:
            self._bank().load_one(adapter, state["adapters"], into, optimizer=optimizer)
            return
        with torch.no_grad():
            for c, sd in zip(self.chunks, state["chunks"], strict=True):
                missing, unexpected = c.module.load_state_dict(sd, strict=False)
                bad = [k for k in missing if k not in weights.tied_copies(c.module)]
                if bad or unexpected:
                    raise ValueError(f"checkpoint shard: missing {bad}, unexpected {unexpected}")
            self._sync_tied_embedding()
        megatron_optimizer = self.optim.optimizer
        if not optimizer:
            zero.restart(megatron_optimizer)
        elif self.optim.zero:
            zero.load_state(megatron_optimizer, state["optimizer"])
        else:
            megatron_optimizer.load_state_dict(state["optimizer"])
        if self.adapters is not None:
            self.adapters.load_state(state.get("adapters") or {})
        self.optim.zero_grad()
        torch.set_rng_state(state["rng"])
        self.optim.step = int(state["step"])

    def _sync_tied_embedding(self) -> None:
        """Make the last stage's copy of tied embeddings equal to the first stage's (the copy
        is zeroed, then summed with the original over the embedding group)."""
        if not (self.cfg.model.tie_embeddings and self.dims.embd_group is not None):
            return
        tied = [
            p
            for c in self.chunks
            for n, p in c.module.named_parameters()
            if weights.is_tied_copy(p) or n == weights.EMBEDDING
        ]
        for p in tied:  # one on the first and on the last stage
            if weights.is_tied_copy(p):
                p.data.zero_()
            dist.all_reduce(p.data, group=self.dims.embd_group)

    # -- the reshardable format (reshard.py) ---------------------------------------------------

    def _params(
        self, *, tied: bool, lora: bool | None = None, as_replica0: bool = False
    ) -> list[reshard.Param]:
        """This rank's parameters for the reshardable format; ``lora``: only the adapter
        sites (True) or only the base (False); ``as_replica0``: every one counted as DP
        replica 0's (a survivor standing in for its lost replicas)."""
        from trainctl.workers.engine.lora import is_lora

        out = reshard.params_of(
            self.chunks, reshard.optimizer_slots(self.optim.optimizer),
            ep_rank=self.coords.ep, local_experts=self.local_experts,
            replica0=_every if as_replica0 else self.dims.holds_replica0, tied=tied,
        )  # fmt: skip
        return [p for p in out if lora is None or is_lora(p.canon) == lora]

    def _pieces(self, params: list[reshard.Param]) -> dict[str, Any]:
        return reshard.pieces(
            params, tp_rank=self.coords.tp, tp=self.cfg.layout.tp, zero=self.optim.zero
        )

    def _adapter_pieces(
        self, bank: AdapterBank, name: str, as_replica0: bool = False
    ) -> dict[str, Any]:
        """Adapter ``name``'s spec, step and pieces: made active for the read (its AdamW
        state is the optimizer's then), and the active one put back after."""
        was = bank.active
        bank.activate(name)
        out = {
            "spec": bank.slots[name].spec.to_dict(),
            "step": bank.slots[name].step,
            "pieces": self._pieces(self._params(tied=False, lora=True, as_replica0=as_replica0)),
        }
        bank.activate(was)
        return out

    def reshardable_state(
        self, adapter: str | None = None, *, as_replica0: bool = False
    ) -> dict[str, Any]:
        """This rank's pieces of the whole training state, every adapter's included, and the
        writer's scalars; ``adapter``: that adapter alone. ``as_replica0``: every piece this
        rank holds, as DP replica 0 would write it (recovery from live peers; under ZeRO-1 a
        rank holds only its own range of the optimizer state, so it stands in for no one)."""
        meta = {"step": self.optim.step, "layout": dataclasses.asdict(self.cfg.layout)}
        if adapter is not None:
            bank = self._bank()
            return {
                "format": reshard.FORMAT, "pieces": {},
                "adapters": {adapter: self._adapter_pieces(bank, adapter)},
                "meta": {**meta, "adapter_only": adapter},
            }  # fmt: skip
        names = list(self.adapters.slots) if self.adapters is not None else []
        base = self._params(tied=False, lora=False, as_replica0=as_replica0)
        return {
            "format": reshard.FORMAT,
            "pieces": self._pieces(base),
            "adapters": {n: self._adapter_pieces(self._bank(), n, as_replica0) for n in names},
            "meta": meta,
        }

    def stage_reshardable(
        self, saved: reshard.Reader, adapter: str | None = None, into: str | None = None
    ) -> Staged:
        """This rank's shard of everything in ``saved`` (``adapter``: that adapter's alone,
        as ``into``), cut for this layout and checked against the live shapes; changes
        nothing."""
        cut = {"tp_rank": self.coords.tp, "tp": self.cfg.layout.tp}
        _check_whole(saved.meta.get("adapter_only"), adapter)
        if saved.adapters and self.adapters is None:
            raise ValueError(
                f"checkpoint: it holds adapters {sorted(saved.adapters)}; start the service "
                "with --max-adapters N to load it"
            )
        chosen = saved.adapters
        if adapter is not None:
            if adapter not in saved.adapters:
                raise ValueError(
                    f"adapter: the checkpoint holds no adapter {adapter!r} "
                    f"(it holds {sorted(saved.adapters)})"
                )
            chosen = {into or adapter: saved.adapters[adapter]}
        sites = self._params(tied=True, lora=True)
        adapters = []
        for name, (spec, step, pieces) in chosen.items():
            s = renamed(spec, name)
            if adapter is not None:
                self._bank().check_fits(s)
            elif self.adapters is not None:
                self.adapters.check_rank(s)
            adapters.append((s, step, reshard.stage(pieces, sites, **cut)))
        if self.adapters is not None and len(adapters) > self.adapters.max_adapters:
            raise ValueError(
                f"checkpoint: it holds {len(adapters)} adapters, the limit (--max-adapters) "
                f"is {self.adapters.max_adapters}"
            )
        base = None
        if adapter is None:
            base = reshard.stage(saved.base, self._params(tied=True, lora=False), **cut)
        return Staged(int(saved.meta["step"]), base, adapters)

    def apply_reshardable(self, staged: Staged, *, optimizer: bool = True) -> None:
        """Inverse of ``reshardable_state``, staged by ``stage_reshardable``: local, no
        collective. A whole-state load replaces every adapter and, as no RNG state is
        restored, seeds torch's generator from the seed, the step and this rank; an adapter
        alone changes nothing else."""
        bank = self.adapters
        if staged.base is not None:
            if bank is not None:
                bank.load_state({})
            reshard.apply(staged.base, optimizer=optimizer)
        if bank is not None and staged.adapters:
            was = None if staged.base is not None else bank.active
            for spec, step, params in staged.adapters:
                tensors = {s.canon: s.value.to(s.tensor.dtype).clone() for s in params}
                bank.install(Slot(spec=spec, tensors=tensors, step=step))
                bank.activate(spec.name)
                reshard.apply(params, optimizer=optimizer)
            bank.activate(None if was in {s.name for s, _, _ in staged.adapters} else was)
        if staged.base is None:
            return
        self.optim.zero_grad()
        self.optim.step = staged.step
        torch.manual_seed(reshard.rng_seed(self.cfg.model.seed, staged.step, self.coords.rank))


def _every(_name: str) -> bool:
    return True


def _check_whole(only: str | None, adapter: str | None) -> None:
    """A checkpoint of one adapter alone (``only``) loads only as that adapter."""
    if adapter is None and only is not None:
        raise ValueError(
            f"adapter: this checkpoint holds adapter {only!r} alone; load it with adapter={only!r}"
        )


@dataclasses.dataclass
class Staged:
    """A reshardable checkpoint cut for this rank, waiting for ``apply_reshardable``: the
    step, the base's parameters (None: an adapter alone) and each adapter's spec, step and
    parameters."""

    step: int
    base: list[reshard.Staged] | None
    adapters: list[tuple[AdapterSpec, int, list[reshard.Staged]]]
