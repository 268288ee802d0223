"""A gloo weight-transfer engine for vLLM's native weight-sync API.

vLLM's model workers take new weights through ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` and ``finish_weight_update`` (reached with
``collective_rpc``), each delegating to the weight-transfer engine that
``weight_transfer_config={"backend": ...}`` named when the engine was built. Every backend
vLLM 0.32 registers needs CUDA, so this one, registered as ``gloo``, makes the same sequence
run on a CPU engine, over the group of ``workers/sampler/collective.py``:

- ``init_transfer_engine``: joins the group of one generation (its ``Rendezvous`` and this
  worker's rank in it);
- ``start_weight_update``: forgets anything a broken update left;
- ``update_weights`` (``receive_weights``): every owner's buckets of the plan, assembled in
  memory; the model is not touched;
- ``finish_weight_update``: the received set, checked against the model's parameters, is
  loaded through vLLM's in-place reload (the model's own ``load_weights`` and whatever the
  platform does after loading), then the CPU's tied-embedding GEMM is prepared again.

So a send that breaks half-way raises in ``update_weights`` and leaves the model serving the
weights it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainctl.workers.sampler import collective
from trainctl.workers.sampler.stream import StreamPlan

BACKEND = "gloo"


@dataclass
class GlooInitInfo:
    rendezvous: dict[str, Any]
    """``collective.Rendezvous.to_dict()``."""
    rank: int
    """This worker's rank in the group (the sender is 0)."""


@dataclass
class GlooUpdateInfo:
    plan: dict[str, Any]
    """``StreamPlan.to_dict()``: every owner's buckets (JSON-able: lists, not tuples)."""
    version: str = ""
    """The shipment's id: the received set is kept under it (``keep``)."""
    keep: list[str] = field(default_factory=list)
    """The shipment ids of the versions to keep in host memory once this one is loaded (the
    pool's window, this one included): a broadcast cannot be replayed, so a swap back to a
    pinned version reloads from here."""


def _engine_class() -> type[Any]:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class GlooWeightTransferEngine(WeightTransferEngine[Any, Any]):  # our own info classes
        """Receives a version over gloo, then loads it whole (the module docstring). Owns its
        generation's group, the buckets of the update under way, and the versions kept in
        host memory for a swap back (``kept``: by shipment id, those the update's ``keep``
        names)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Any = None
            self.received: dict[str, torch.Tensor] = {}
            self.pending: GlooUpdateInfo | None = None
            self.kept: dict[str, dict[str, torch.Tensor]] = {}

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            rv = collective.Rendezvous(**init_info.rendezvous)
            if self.group is not None:  # a new generation: the old group's door closes
                self.group.close()
            self.group = collective.open_group(rv, init_info.rank)

        def start_weight_update(self) -> None:
            self.received = {}

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class synchronizes an accelerator after each update; a CPU has none.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer: init_weight_transfer_engine first")
            got = collective.receive(self.group.group, StreamPlan.from_dict(update_info.plan))
            self.received |= got
            self.pending = update_info

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            from trainctl.workers.sampler.vllm_backend.reload import (
                empty_parameters,
                refresh_cpu_embedding_gemms,
            )

            weights, self.received, info = self.received, {}, self.pending
            # The worker is not at hand here: vLLM's in-place reload, as its worker runs it.
            reload_weights(
                self.vllm_config, self.model, weights_iterator=iter(sorted(weights.items())),
                weights_path=None, is_checkpoint_format=True,
            )  # fmt: skip
            refresh_cpu_embedding_gemms(self.model)
            if empty := empty_parameters(self.model):
                raise RuntimeError(f"weights left empty after the update: {empty[:3]}")
            if info is not None:
                self.kept[info.version] = weights
                self.kept = {v: w for v, w in self.kept.items() if v in info.keep}

        def shutdown(self) -> None:
            self.group, self.received = None, {}

    return GlooWeightTransferEngine


def register() -> None:
    """Make ``gloo`` a backend of vLLM's ``WeightTransferEngineFactory`` (once a process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
