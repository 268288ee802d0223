"""The window of weight versions the samplers serve.

Every sync publishes a version: one step's weights of the base, or of one adapter, as a
``Shipment``. The window keeps the newest ``size`` published versions of each (the base, and
each adapter by name), so that a client pinned to a step (Tinker's ``snapshot`` sampling
clients; ``POST /v1/sample`` with ``step``) keeps sampling exactly those weights while
training moves on. A step that has left the window is a 410 naming it and the oldest still
served, never other weights.

A step names one version only within one line of training. A checkpoint load or a recovery
starts another line (its steps may repeat the old ones with other weights), so it empties the
window of what it reloads (``restart``); so does publishing a step older than the newest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainctl.api import ConflictError, NotFoundError, NotReadyError
from trainctl.api.errors import GoneError
from trainctl.workers.sampler.transport import Shipment

Key = str | None
"""Whose versions: an adapter's name, or None for the base model."""


def _whose(key: Key) -> str:
    return "the base model" if key is None else f"adapter {key!r}"


@dataclass
class VersionWindow:
    """Owns the published versions: each key's newest ``size`` shipments, by step."""

    size: int
    versions: dict[Key, dict[int, Shipment]] = field(default_factory=dict)

    def publish(self, shipment: Shipment, new_line: bool = False) -> list[Shipment]:
        """Add ``shipment`` as its key's newest version; returns the versions it pushed out
        of the window: all of them with ``new_line`` (a checkpoint load or a recovery), or if
        its step is older than the newest."""
        kept = self.versions.setdefault(shipment.adapter, {})
        dropped = []
        if kept and (new_line or shipment.version < max(kept)):
            dropped = list(kept.values())
            kept.clear()
        old = kept.pop(shipment.version, None)  # a step synced again: its newer copy
        dropped += [old] if old is not None and old is not shipment else []
        kept[shipment.version] = shipment
        while len(kept) > self.size:
            dropped.append(kept.pop(min(kept)))
        return dropped

    def withdraw(self, shipment: Shipment, previous: Shipment | None) -> None:
        """Take back a version no engine would load, restoring what it replaced."""
        kept = self.versions.get(shipment.adapter, {})
        if kept.get(shipment.version) is shipment:
            del kept[shipment.version]
        if previous is not None and previous.version not in kept:
            kept[previous.version] = previous

    def restart(self, key: Key) -> None:
        """Forget every version of ``key`` (a checkpoint load, a deleted adapter)."""
        self.versions.pop(key, None)

    def steps(self, key: Key) -> list[int]:
        return sorted(self.versions.get(key, {}))

    def newest(self, key: Key) -> Shipment | None:
        kept = self.versions.get(key)
        return kept[max(kept)] if kept else None

    def get(self, key: Key, step: int | None) -> Shipment:
        """The version of ``key`` at ``step`` (None: the newest): 410 past the window, 409
        for a step not synced yet, 404 for one never published in between."""
        kept = self.versions.get(key)
        if not kept:
            if key is None:
                raise NotReadyError(
                    "the samplers have no weights yet: POST /v1/weights/sync (or take a step "
                    "with sync after_step)"
                )
            raise NotFoundError(
                f"adapter: the samplers serve no adapter {key!r} (it is synced when created, "
                'after its steps, or with POST /v1/weights/sync {"adapter": ...})',
                details={"field": "adapter"},
            )
        if step is None:
            return kept[max(kept)]
        if step in kept:
            return kept[step]
        served = sorted(kept)
        details = {"field": "step", "step": step, "served": served, "window": self.size}
        if step > served[-1]:
            raise ConflictError(
                f"step: the samplers serve {_whose(key)} up to step {served[-1]}; step {step} "
                "is not synced yet",
                details=details,
            )
        if step < served[0]:
            raise GoneError(
                f"step: the weights of step {step} of {_whose(key)} have left the samplers' "
                f"window (--sampler-versions {self.size}); the oldest served is step "
                f"{served[0]}, the newest {served[-1]}",
                details=details,
            )
        raise NotFoundError(
            f"step: step {step} of {_whose(key)} was never synced to the samplers; they serve "
            f"steps {served}",
            details=details,
        )

    def nbytes(self) -> int:
        """The bytes the window holds in the transport (host memory, for the object store)."""
        return sum(s.nbytes for kept in self.versions.values() for s in kept.values())
