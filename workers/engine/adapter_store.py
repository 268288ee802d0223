"""Where idle adapters wait: host memory, then disk.

The active adapter lives in the model's LoRA sites (on the device). A switch copies it to host
memory (its slot). With ``max_in_memory`` set, the least recently used idle slots beyond that
many are written to ``directory`` (one file per adapter and rank, written whole and renamed,
read back with ``torch.load(weights_only=True)``) and dropped from memory; activating one reads
it back. The round trip is bit-exact: the same tensors, the same AdamW state, the same waiting
gradients.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_FIELDS = ("tensors", "optimizer", "grads")


def to_host(obj: Any) -> Any:
    """A copy of ``obj`` (tensors in dicts and lists) with every tensor in host memory."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_host(v) for v in obj)
    return obj


class SpillStore:
    """Idle adapters written to disk. Owns the spill directory and the limit of adapters kept
    in host memory."""

    def __init__(self, directory: str, max_in_memory: int) -> None:
        self.directory = Path(directory) if directory else None
        self.max_in_memory = max_in_memory if self.directory is not None else 0
        if self.directory is not None and self.directory.is_dir():
            # A previous process's spilled adapters: its state comes back from a checkpoint.
            for stale in self.directory.glob("*.pt*"):
                stale.unlink(missing_ok=True)

    @classmethod
    def for_rank(cls, lora: Any, rank: int) -> SpillStore:
        """The store of global rank ``rank`` under a ``LoraConfig``'s offload folder."""
        folder = f"{lora.offload_dir}/rank-{rank:05d}" if lora.offload_dir else ""
        return cls(folder, lora.max_in_memory)

    def _path(self, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{name}.pt"

    def spill(self, slots: dict[str, Any], active: str | None) -> None:
        """Write the least recently used idle slots beyond ``max_in_memory`` to disk."""
        if not self.max_in_memory:
            return
        idle = sorted(
            (s for n, s in slots.items() if n != active and s.path is None),
            key=lambda s: s.last_used,
        )
        for slot in idle[: max(0, len(idle) - self.max_in_memory)]:
            path = self._path(slot.spec.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".pt.partial")
            torch.save({f: getattr(slot, f) for f in _FIELDS}, tmp)
            os.replace(tmp, path)
            for f in _FIELDS:
                setattr(slot, f, None)
            slot.path = path

    def read(self, slot: Any) -> dict[str, Any]:
        """The slot's tensors, AdamW state and waiting gradients, from memory or disk."""
        if slot.path is None:
            return {f: getattr(slot, f) for f in _FIELDS}
        state: dict[str, Any] = torch.load(slot.path, map_location="cpu", weights_only=True)
        return state

    def load(self, slot: Any) -> None:
        """Bring a spilled slot back into memory (its file removed)."""
        if slot.path is None:
            return
        for f, v in self.read(slot).items():
            setattr(slot, f, v)
        self.drop(slot)

    def drop(self, slot: Any) -> None:
        if slot.path is not None:
            slot.path.unlink(missing_ok=True)
            slot.path = None
