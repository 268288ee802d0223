"""Many LoRA adapters on one frozen base: each adapter's weights, AdamW state and step kept
in a host-memory slot, and swapped into the model's LoRA sites before a call that names it.

One set of sites (``workers/engine/lora.py``) lives in the model, sized for the largest rank
allowed. The *active* adapter's tensors are in those sites and its AdamW state in the
optimizer; every other adapter waits in its slot. ``activate(name)`` stashes the active one
(a copy of its site tensors, its optimizer state and any open split-step window) and loads the
named one, so a step of one
adapter never touches another's weights, moments or step count, and the base never moves (it
has no gradient). ``activate(None)`` switches every site off: the base model alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine import lora, weights, zero
from trainctl.workers.engine.accumulation import Accumulation, grad_buffers
from trainctl.workers.engine.adapter_store import SpillStore, to_host
from trainctl.workers.engine.boundary import AdapterInfo, AdapterSpec


@dataclass
class Slot:
    spec: AdapterSpec
    tensors: dict[str, Tensor]
    """Canonical parameter name -> this rank's site tensor (host memory)."""
    optimizer: Any = None
    """This rank's optimizer state for the adapter; None: fresh (no step yet)."""
    step: int = 0
    last_used: float = field(default_factory=time.time)
    grads: list[Tensor] | None = None
    """Its split-step window while another adapter is active: the gradient buffers summed
    by its ``forward_backward`` parts, waiting for its ``optim_step``."""
    parts: int = 0
    nbytes: int = 0
    """Its factors' bytes on this rank."""
    path: Path | None = None
    """Set while it waits on disk (``adapter_store.py``): its tensors are not in memory."""


def _slot(spec: AdapterSpec, saved: dict[str, Any], *, optimizer: bool = True) -> Slot:
    """The slot of one adapter as a checkpoint shard holds it (``state``'s entry); without
    ``optimizer``, its AdamW state starts afresh."""
    tensors = dict(saved["tensors"])
    return Slot(
        spec=spec,
        tensors=tensors,
        optimizer=saved["optimizer"] if optimizer else None,
        step=int(saved["step"]),
        nbytes=_nbytes(tensors),
    )


def renamed(spec: dict[str, Any], name: str) -> AdapterSpec:
    return AdapterSpec.from_dict({**spec, "name": name})


def _nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterBank:
    """This rank's adapters. Every rank holds the same names and runs the same calls. Owns the slots
    (each adapter's weights and AdamW state), the active adapter and the spill store."""

    def __init__(
        self,
        *,
        sites: list[lora.Site],
        params: dict[str, Tensor],
        optimizer: Any,
        zero_optimizer: bool,
        max_adapters: int,
        max_rank: int,
        tp_rank: int,
        tp: int,
        window: Accumulation | None = None,
        store: SpillStore | None = None,
    ) -> None:
        self.sites = sites
        self.params = params  # canonical name -> live site parameter
        self.optimizer = optimizer
        self.zero = zero_optimizer
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.tp_rank, self.tp = tp_rank, tp
        self.window = window
        self.store = store or SpillStore("", 0)
        self.slots: dict[str, Slot] = {}
        self.active: str | None = None

    # -- the adapters' table ------------------------------------------------------------------

    def check_new(self, spec: AdapterSpec) -> None:
        """Raise ValueError naming the field unless ``spec`` can be created here."""
        if spec.name in self.slots:
            raise ValueError(f"adapter {spec.name!r} exists already")
        if len(self.slots) >= self.max_adapters:
            raise ValueError(
                f"{len(self.slots)} adapters exist, the limit (--max-adapters) is "
                f"{self.max_adapters}: delete one first"
            )
        self.check_rank(spec)

    def check_rank(self, spec: AdapterSpec) -> None:
        if not 1 <= spec.rank <= self.max_rank:
            raise ValueError(
                f"rank: {spec.rank} is outside [1, {self.max_rank}] (the service's --lora-max-rank)"
            )

    def create(self, spec: AdapterSpec) -> None:
        self.check_new(spec)
        tensors = {}
        for canon, p in self.params.items():
            rule = weights.shard_rule(canon)
            full_shape = rule.full_shape(p.shape, self.tp)
            if canon.endswith(".lora_a"):
                full = lora.init_a(canon, full_shape, seed=spec.seed, rank=spec.rank)
            else:
                full = torch.zeros(full_shape)
            tensors[canon] = rule.shard(full, self.tp_rank, self.tp).to(p.dtype).clone()
        self.slots[spec.name] = Slot(spec=spec, tensors=tensors, nbytes=_nbytes(tensors))
        self.store.spill(self.slots, self.active)

    def delete(self, name: str) -> None:
        self._slot(name)
        if self.active == name:
            self._stash(switching=True)  # its open window goes with it
            self._switch_off()
        self.store.drop(self.slots.pop(name))

    def infos(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(spec=s.spec, step=s.step, nbytes=s.nbytes, last_used=s.last_used)
            for s in self.slots.values()
        ]

    def _slot(self, name: str) -> Slot:
        if name not in self.slots:
            raise KeyError(f"adapter {name!r} does not exist (known: {sorted(self.slots)})")
        return self.slots[name]

    # -- swapping -----------------------------------------------------------------------------

    @torch.no_grad()
    def activate(self, name: str | None) -> None:
        """Make ``name`` the adapter the model computes with (None: the base alone)."""
        if name is not None:
            slot = self._slot(name)
            slot.last_used = time.time()
        if name == self.active:
            return
        self._stash(switching=True)
        if name is None:
            self._switch_off()
            self.store.spill(self.slots, None)
            return
        self.store.load(slot)
        for n, p in self.params.items():
            p.copy_(slot.tensors[n])
        if slot.grads is not None and self.window is not None:
            for g, saved in zip(grad_buffers(self.window.chunks), slot.grads, strict=True):
                g.copy_(saved)
            self.window.parts, slot.grads, slot.parts = slot.parts, None, 0
        if slot.optimizer is None:
            zero.restart(self.optimizer)
        elif self.zero:
            zero.load_state(self.optimizer, slot.optimizer)
        else:
            self.optimizer.load_state_dict(slot.optimizer)
        spec = slot.spec
        lora.set_active(
            self.sites,
            lora.ActiveAdapter(
                scaling=spec.alpha / spec.rank,
                dropout=spec.dropout,
                groups=frozenset(spec.targets),
            ),
        )
        self.active = name
        self.store.spill(self.slots, name)

    def _stash(self, *, switching: bool = False) -> None:
        """Copy the active adapter into its slot; ``switching``: also move its open window
        there (the gradient buffers are then zero for the next adapter)."""
        if self.active is None:
            return
        slot = self.slots[self.active]
        if switching and self.window is not None and self.window.parts:
            buffers = grad_buffers(self.window.chunks)
            slot.grads, slot.parts = to_host(buffers), self.window.parts
            for g in buffers:
                g.zero_()
            self.window.clear()
        # Off the device: an idle adapter waits in host memory (or on disk).
        slot.tensors = to_host(dict(self.params))
        slot.optimizer = to_host(
            zero.state(self.optimizer) if self.zero else self.optimizer.state_dict()
        )

    def _switch_off(self) -> None:
        lora.set_active(self.sites, lora.ActiveAdapter())
        self.active = None

    def stepped(self) -> int:
        """Count an optimizer step of the active adapter; its new step."""
        if self.active is None:
            raise RuntimeError("an optimizer step with no adapter active")
        slot = self.slots[self.active]
        slot.step += 1
        return slot.step

    # -- checkpoints --------------------------------------------------------------------------

    def state(self, only: str | None = None) -> dict[str, Any]:
        """Every adapter (``only``: that one), the active one stashed first, for a checkpoint
        shard."""
        self._stash()
        out = {}
        for name in [self._slot(only).spec.name] if only is not None else list(self.slots):
            s = self.slots[name]
            held = self.store.read(s)  # a spilled adapter is read from its file
            out[name] = {
                "spec": s.spec.to_dict(),
                "tensors": held["tensors"],
                "optimizer": held["optimizer"],
                "step": s.step,
            }
        return out

    def check_fits(self, spec: AdapterSpec) -> None:
        """Raise ValueError unless an adapter of ``spec`` can be put in (a new one, or one that
        replaces the adapter of its name)."""
        if spec.name not in self.slots:
            self.check_new(spec)
        else:
            self.check_rank(spec)

    def check_one(self, name: str, saved: dict[str, Any], into: str | None = None) -> None:
        """Raise ValueError unless adapter ``name`` of a checkpoint shard loads here alone (as
        ``into``, default its own name): it is in ``saved``, its rank is allowed, its tensors
        have the sites' shapes, and it is not one too many. Changes nothing."""
        if name not in saved:
            raise ValueError(
                f"adapter: the checkpoint holds no adapter {name!r} (it holds {sorted(saved)})"
            )
        self.check_fits(renamed(saved[name]["spec"], into or name))
        tensors = saved[name]["tensors"]
        for canon, p in self.params.items():
            if getattr(tensors.get(canon), "shape", None) != p.shape:
                raise ValueError(f"adapter {name!r}: {canon} does not fit this rank's sites")

    def load_one(
        self, name: str, saved: dict[str, Any], into: str | None = None, *, optimizer: bool = True
    ) -> None:
        """Put adapter ``name`` back as ``saved`` holds it (weights, AdamW state unless not
        ``optimizer``, step), as ``into`` (default its own name), creating it if need be;
        every other adapter stays as it is. The target's open split-step window is dropped."""
        s = saved[name]
        self.install(_slot(renamed(s["spec"], into or name), s, optimizer=optimizer))

    def install(self, slot: Slot) -> None:
        """Put ``slot`` in as its adapter, replacing one of that name (its live sites and open
        split-step window too, if it is active: it is switched off); every other adapter stays
        as it is."""
        name = slot.spec.name
        if self.active == name:  # its live sites and window are replaced: no stash
            if self.window is not None and self.window.parts:
                for g in grad_buffers(self.window.chunks):
                    g.zero_()
                self.window.clear()
            self._switch_off()
        if name in self.slots:
            self.store.drop(self.slots.pop(name))
        slot.nbytes = _nbytes(slot.tensors)
        self.slots[name] = slot
        self.store.spill(self.slots, self.active)

    def load_state(self, saved: dict[str, Any]) -> None:
        self._switch_off()
        for slot in self.slots.values():
            self.store.drop(slot)
        self.slots = {}
        for name, s in saved.items():
            self.slots[name] = _slot(AdapterSpec.from_dict(s["spec"]), s)
        self.store.spill(self.slots, None)

    def digest(self, name: str) -> str:
        """sha256 of one adapter's tensors on this rank (name order); the active one's are
        the live sites (no copy)."""
        slot = self._slot(name)
        tensors = self.params if name == self.active else self.store.read(slot)["tensors"]
        return weights.digest(sorted(tensors.items()))


class ShardAdapters:
    """The shard's adapter calls, over its ``AdapterBank`` (None on a service that trains the full
    model): each says what is wrong when the service holds no adapters. Owns nothing but the bank.
    """

    def __init__(self, bank: AdapterBank | None) -> None:
        self.bank = bank

    def check_trainable(self) -> None:
        """Refuse a training call on a frozen base with no adapter active."""
        if self.bank is not None and self.bank.active is None:
            raise ValueError(
                "adapter: this service trains LoRA adapters on a frozen base; name an adapter "
                "to train (the base model is for forward passes only)"
            )

    def _bank(self) -> AdapterBank:
        if self.bank is None:
            raise ValueError(
                "adapter: this service holds no adapters (start it with --max-adapters N)"
            )
        return self.bank

    def create(self, spec: AdapterSpec) -> None:
        self._bank().create(spec)

    def delete(self, name: str) -> None:
        self._bank().delete(name)

    def activate(self, name: str | None) -> None:
        """Compute with adapter ``name`` from now on (None: the base alone)."""
        if name is None and self.bank is None:
            return
        self._bank().activate(name)

    def infos(self) -> list[AdapterInfo]:
        return self._bank().infos() if self.bank is not None else []

    def digest(self, name: str) -> str:
        return self._bank().digest(name)

    def spec(self, name: str) -> AdapterSpec:
        """How adapter ``name`` was made (its rank, alpha and targets)."""
        return self._bank().slots[name].spec
