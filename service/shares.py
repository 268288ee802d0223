"""Each tenant's fair share of every table a tenant can fill.

The gateway keeps tables that any caller can grow: Tinker sessions, model handles, finished
futures, sampling clients, requests parked for their ``seq_id`` turn, samples in flight, and
(through Tinker's LoRA models) the service's adapter slots. Each has a **bound** (a setting,
``Bounds``), and each **party** gets a share of it:

    share(table) = max(floor(table), bound(table) // parties)
    parties      = the tenants the keys file names + 1 (the operator's token)

so that with no floor in play the shares add up to the bound. A service without tenant keys
has one party, the operator, whose share is the whole bound. The floor (``FLOORS``) keeps a
share usable when the keys file names many tenants; the table can then hold up to
``parties x floor`` entries, still bounded since the keys file is.

A party over its share meets its own bound only: the table evicts the party's own oldest
entry where that loses nothing the party still uses, and refuses the call (429, or 409 for
adapter slots) where it would, naming the party's share. Never is another party's entry
evicted. Each eviction and refusal is counted per party (``trainctl_tenant_evictions``,
``trainctl_tenant_refusals`` on ``/metrics``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields

OPERATOR = "_operator"
"""The operator's party in counts and labels (a tenant's name never starts with '_')."""


def party(tenant: str | None) -> str:
    """The party a caller counts against: its tenant, or the operator (None)."""
    return OPERATOR if tenant is None else tenant


@dataclass(frozen=True)
class Bounds:
    """The whole-service bound of each table (the settings of the same names, less the
    ``tinker_`` prefix); each party's share is cut from it."""

    sessions: int = 1024
    """Tinker sessions (``--tinker-max-sessions``)."""
    models: int = 4096
    """Tinker model handles, over all of a party's sessions (``--tinker-max-models``)."""
    futures: int = 4096
    """Finished Tinker futures kept for ``retrieve_future`` (``--tinker-max-futures``)."""
    sampling_clients: int = 4096
    """Tinker sampling clients, and remembered sampler-weight paths
    (``--tinker-max-sampling-clients``)."""
    parked: int = 256
    """Tinker requests parked for their ``seq_id`` turn (``--tinker-max-parked``)."""
    parked_bytes: int = 256 << 20
    """Their body bytes (``--tinker-max-parked-mb``)."""
    samples: int = 256
    """Tinker samples in flight, waiting or running (``--sampler-max-queued``)."""
    operations: int = 64
    """Tinker requests in the controller's operation queue, waiting or running
    (``--max-queued-operations``); past its share a party's next waits for its own."""
    adapters: int = 0
    """LoRA adapter slots of Tinker models (``--max-adapters``; the controller's, which the
    adapter slots pass to ``Shares.of``)."""


FLOORS = Bounds(
    sessions=4, models=16, futures=64, sampling_clients=8, parked=4, parked_bytes=16 << 20,
    samples=4, operations=2, adapters=1,
)  # fmt: skip
"""The least share of each table, whatever the number of tenants (never above the bound)."""

TABLES = tuple(f.name for f in fields(Bounds))

SETTING = {
    "sessions": "--tinker-max-sessions",
    "models": "--tinker-max-models",
    "futures": "--tinker-max-futures",
    "sampling_clients": "--tinker-max-sampling-clients",
    "parked": "--tinker-max-parked",
    "parked_bytes": "--tinker-max-parked-mb",
    "samples": "--sampler-max-queued",
    "operations": "--max-queued-operations",
    "adapters": "--max-adapters",
}
"""The setting that bounds each table: what a refusal tells the operator to raise."""


class Shares:
    """The share rule and the per-party counts of what it evicted and refused. Owns nothing
    of the tables themselves: each table asks ``of`` for a party's share and reports here."""

    def __init__(self, bounds: Bounds | None = None, tenants: Callable[[], int] = lambda: 0):
        self.bounds = bounds or Bounds()
        self._tenants = tenants
        """How many tenants the keys file names now (it may change without a restart)."""
        self.evicted: Counter[tuple[str, str]] = Counter()
        """(party, table) -> entries of that party's evicted to make room for its own."""
        self.refused: Counter[tuple[str, str]] = Counter()
        """(party, table) -> calls refused for being over the party's share."""

    @property
    def parties(self) -> int:
        return self._tenants() + 1

    def of(self, table: str, bound: int | None = None) -> int:
        """Each party's share of ``table`` (of ``bound``, where the caller knows it better)."""
        bound = int(getattr(self.bounds, table)) if bound is None else bound
        floor = int(getattr(FLOORS, table))
        return max(min(bound, floor), bound // self.parties)

    def describe(self, table: str, bound: int | None = None) -> str:
        """How the share of ``table`` comes about, for a refusal's message."""
        bound = getattr(self.bounds, table) if bound is None else bound
        return (
            f"its share is {self.of(table, bound)} of {SETTING[table]} {bound} over "
            f"{self.parties} parties (the tenants and the operator)"
        )

    def evict(self, tenant: str | None, table: str, n: int = 1) -> None:
        self.evicted[party(tenant), table] += n

    def refuse(self, tenant: str | None, table: str) -> None:
        self.refused[party(tenant), table] += 1
