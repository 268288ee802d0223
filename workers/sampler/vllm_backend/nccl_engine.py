"""vLLM's own ``nccl`` weight-transfer engine, keeping what it received: the GPU engines' end
of the ``nccl`` wire (``workers/sampler/wires.py``).

vLLM's ``NCCLWeightTransferEngine`` receives a version in packed buffers from the trainer's
rank 0 and loads each buffer as it arrives; it keeps nothing. A broadcast cannot be replayed,
so this subclass, registered as ``trainctl_nccl``, copies each tensor to host memory as it is
loaded, and after ``finish_weight_update`` keeps the set under the shipment's id, as the
``gloo`` engine keeps what it received: a swap back to a pinned version reloads it
(``reload.reload_kept``). Its wire is vLLM's, untouched; the update adds only the
shipment's id and the window to keep.

Written for GPUs and tested for its control flow only (``tests/unit/test_nccl_wire.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import torch

BACKEND = "trainctl_nccl"


def _engine_class() -> type[Any]:
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    @dataclass
    class KeptUpdateInfo(NCCLWeightTransferUpdateInfo):
        version: str = ""
        """The shipment's id: the received set is kept under it."""
        keep: list[str] = field(default_factory=list)
        """The shipment ids to keep once this one is loaded (the pool's window)."""

    class KeepingNcclEngine(NCCLWeightTransferEngine):
        """vLLM's NCCL engine that also keeps each version it received in host memory.
        Owns the tensors of the update under way and the versions kept (``kept``: by
        shipment id, those the update's ``keep`` names)."""

        update_info_cls = KeptUpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.received: dict[str, torch.Tensor] = {}
            self.pending: Any = None
            self.kept: dict[str, dict[str, torch.Tensor]] = {}

        def start_weight_update(self) -> None:
            self.received = {}
            super().start_weight_update()

        def receive_weights(self, update_info: Any) -> None:
            model, received = self.model, self.received
            load: Any = model.load_weights

            def load_and_keep(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
                weights = list(weights)
                for name, t in weights:  # views of vLLM's buffer: copied before it is reused
                    received[name] = t.to("cpu", copy=True)
                return load(weights)

            # what vLLM's receive uses of the model, and all it uses
            self.model = cast(Any, SimpleNamespace(load_weights=load_and_keep))
            try:
                super().receive_weights(update_info)
            finally:
                self.model = model
            self.pending = update_info

        def finish_weight_update(self) -> None:
            super().finish_weight_update()
            info, weights, self.received = self.pending, self.received, {}
            if info is not None and info.version:
                self.kept[info.version] = weights
                self.kept = {v: w for v, w in self.kept.items() if v in info.keep}

    return KeepingNcclEngine


def register() -> None:
    """Make ``trainctl_nccl`` a backend of vLLM's ``WeightTransferEngineFactory`` (once a
    process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
