"""The rank actor: one Ray actor per global rank, hosting that rank's ``EngineShard``.

The controller creates the actors in a placement group, asks rank 0 for a rendezvous address,
initialises ``torch.distributed`` on all of them (gloo on CPU, NCCL with CUDA; every group with
a timeout, so a dead peer becomes an error instead of a hang), then builds the engines.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainctl.workers.batch import StepPlan
from trainctl.workers.config import EngineConfig

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def quiet_megatron() -> None:
    """megatron-core logs every parameter name and warns about absent CUDA extensions."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for pattern in (".*Apex.*", ".*Transformer Engine.*", ".*cuda_graph_scope.*", ".*TE.*"):
        warnings.filterwarnings("ignore", message=pattern)


class RankWorker:
    """Plain class; ``workers.controller`` wraps it with ``ray.remote``."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        import torch

        logging.basicConfig(level=os.environ.get("TRAINCTL_LOG_LEVEL", "INFO"))
        quiet_megatron()
        torch.set_num_threads(num_threads)
        self.rank = rank
        self.world_size = world_size
        self.engine: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Called on rank 0: an address and a free port for ``init_process_group``."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def init_process_group(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def build(self, cfg: dict[str, Any]) -> dict[str, Any]:
        from trainctl.workers.engine import EngineShard

        self.engine = EngineShard(EngineConfig.from_dict(cfg))
        c = self.engine.coords
        return {
            "rank": c.rank,
            "coords": {"dp": c.dp, "cp": c.cp, "tp": c.tp, "pp": c.pp},
            "parameters": self.engine.num_parameters(),
        }

    def train_batch(self, plan: StepPlan) -> Any:
        shard = plan.microbatches[self.engine.coords.dp]
        return self.engine.train_batch(shard, plan.loss)

    def eval_batch(self, plan: StepPlan) -> Any:
        shard = plan.microbatches[self.engine.coords.dp]
        return self.engine.eval_batch(shard, plan.loss)

    def weights_digest(self) -> str:
        return str(self.engine.weights_digest())

    def start_memory_profile(self, max_entries: int) -> None:
        self.engine.profiler.start(max_entries)

    def stop_memory_profile(self, directory: str) -> dict[str, Any]:
        path = self.engine.profiler.stop(Path(directory))
        c = self.engine.coords
        return {
            "name": path.name,
            "rank": c.rank,
            "size_bytes": path.stat().st_size,
            "coords": {"dp": c.dp, "cp": c.cp, "tp": c.tp, "pp": c.pp},
        }

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
