"""What the collective transport says to the engines' weight-transfer backend: the payloads of
vLLM's weight-sync sequence (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``), one *wire* per backend. The control flow is the
same for every wire (``CollectiveTransport`` in the controller, the engine's ``_receive``); only
who sends and what the payloads hold differ:

- ``gloo`` (CPU engines; ``vllm_backend/gloo_engine.py``): every owner sends its own buckets
  (``collective.py``); the update names the plan, and each engine keeps the window's versions
  it received in host memory.
- ``nccl`` (GPU engines; vLLM's own ``NCCLWeightTransferEngine``, keeping what it received:
  ``vllm_backend/nccl_engine.py``): one sender, trainer rank 0,
  to which the other owners relay their buckets (``relay.py``); the update lists every
  tensor's name, dtype and shape in the order the sender broadcasts them, in vLLM's packed
  buffers of ``bucket_bytes``. vLLM's engine loads each buffer as it arrives (a send broken
  half-way breaks the engine, which the pool recreates).

Either way each engine keeps the window's versions it received in host memory, to swap back
to: a broadcast cannot be replayed.

Plain values only: the controller and the engine both use this module, and neither the
controller nor a test of the payloads needs torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from trainctl.workers.sampler.stream import StreamPlan


class Wire(Protocol):
    name: ClassVar[str]
    """The wire's name (``--sampler-collective-backend``): the vLLM weight-transfer backend
    whose protocol the engines speak."""
    whole_first: ClassVar[bool]
    """Whether an engine receives every byte before it touches the model (a broken send
    leaves the old weights serving), or loads as the bytes arrive (a broken send breaks it)."""

    def senders(self, plan: StreamPlan) -> int:
        """How many of the group's first ranks send (the engines come after them)."""
        ...

    def init_payload(self, rendezvous: dict[str, Any], rank: int) -> dict[str, Any]:
        """``init_weight_transfer_engine``'s argument for the engine at ``rank``."""
        ...

    def update_payload(self, plan: StreamPlan, version: str, keep: list[str]) -> dict[str, Any]:
        """``update_weights``'s argument for the version shipped as ``version``; ``keep``: the
        versions the engine keeps once it is loaded (the window's)."""
        ...


@dataclass(frozen=True)
class GlooWire:
    name: ClassVar[str] = "gloo"
    whole_first: ClassVar[bool] = True

    def senders(self, plan: StreamPlan) -> int:
        return len(plan.owners)

    def init_payload(self, rendezvous: dict[str, Any], rank: int) -> dict[str, Any]:
        return {"rendezvous": rendezvous, "rank": rank}

    def update_payload(self, plan: StreamPlan, version: str, keep: list[str]) -> dict[str, Any]:
        return {"plan": plan.to_dict(), "version": version, "keep": keep}


PACKED_BUFFERS = 2
"""vLLM's packed broadcast's buffers in flight: one filled while the other is on its way."""


@dataclass(frozen=True)
class NcclWire:
    name: ClassVar[str] = "nccl"
    whole_first: ClassVar[bool] = False

    def senders(self, plan: StreamPlan) -> int:
        return 1

    def init_payload(self, rendezvous: dict[str, Any], rank: int) -> dict[str, Any]:
        """vLLM's ``NCCLWeightTransferInitInfo``: its store at the sender, this engine's rank
        (one model worker an engine: the offset is the rank), packed buffers of a bucket."""
        return {
            "master_address": rendezvous["host"],
            "master_port": rendezvous["port"],
            "rank_offset": rank,
            "world_size": rendezvous["world_size"],
            "packed": True,
            "packed_buffer_size_bytes": rendezvous["bucket_bytes"],
            "packed_num_buffers": PACKED_BUFFERS,
        }

    def update_payload(self, plan: StreamPlan, version: str, keep: list[str]) -> dict[str, Any]:
        """vLLM's ``NCCLWeightTransferUpdateInfo`` (every tensor in the relay's order), with
        the version's id and the window to keep."""
        schema = plan.schema
        names = [n for done in plan.completion() for n in done]
        return {
            "names": names,
            "dtype_names": [schema[n][1].removeprefix("torch.") for n in names],
            "shapes": [list(schema[n][0]) for n in names],
            "version": version,
            "keep": keep,
        }


WIRES: dict[str, Wire] = {w.name: w for w in (GlooWire(), NcclWire())}


def wire_of(rendezvous: dict[str, Any]) -> Wire:
    """The wire a group was formed for (``collective.Rendezvous.backend``)."""
    return WIRES[rendezvous.get("backend", GlooWire.name)]
