"""The shard's checkpoint: its training state as a dict of tensors and plain
containers (what ``torch.load(weights_only=True)`` reads back), checked before it is loaded."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from trainctl.workers.engine import weights, zero
from trainctl.workers.engine.adapter_bank import AdapterBank
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
        only = state.get("adapter_only")
        if adapter is None and only is not None:
            raise ValueError(
                f"adapter: this checkpoint holds adapter {only!r} alone; load it with "
                f"adapter={only!r}"
            )
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
