"""The checkpoint formats measured: each layout's ranks are spawned processes of their own
(gloo), which build the engine, take one step and save, or load what another layout saved
(run in a fresh child process by run.py)."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.memory import PeakRSS
from trainctl.service.cluster import free_port

MODEL = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "ffn_hidden_size": 2048,
    "vocab_size": 32768,
    "max_seq_len": 256,
}
"""About 58M parameters: checkpoints of a few hundred MB, seconds to write."""


def _engine(layout: dict[str, int], quick: bool) -> Any:
    from trainctl.workers.engine.config import EngineConfig

    model = {**MODEL, "num_layers": 2, "vocab_size": 8192} if quick else MODEL
    from trainctl.workers.engine.shard import EngineShard

    return EngineShard(EngineConfig.from_dict({"layout": layout, "model": model}))


def _step(eng: Any) -> None:
    import numpy as np

    from trainctl.api import TokenSequence
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step

    rng = np.random.default_rng(0)
    batch = [
        TokenSequence(
            tokens=rng.integers(1, 8000, 200).astype(np.int64), loss_mask=np.ones(200, np.float32)
        )
        for _ in range(4)
    ]
    plan = plan_step(batch, eng.cfg, loss=LossConfig())
    eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())


def _rank(
    rank: int, world: int, port: int, job: dict[str, Any], out: Any
) -> None:  # pragma: no cover - a spawned process
    from trainctl.workers.engine.reshard import Reader

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    eng = _engine(job["layout"], job["quick"])
    directory = Path(job["directory"])
    path = directory / f"rank-{rank:05d}.pt"
    reshardable = job["format"] == "reshardable"
    dist.barrier()
    if job["save"]:
        _step(eng)
        dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as memory:
        if job["save"]:
            state = eng.checkpoint.reshardable_state() if reshardable else eng.checkpoint.state()
            torch.save(state, path)
        elif reshardable:
            staged = eng.checkpoint.stage_reshardable(Reader.open(directory))
            eng.checkpoint.apply_reshardable(staged)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            eng.checkpoint.load(state)
    seconds = time.perf_counter() - t0
    dist.barrier()
    out.put((rank, seconds, eng.num_parameters(), memory.peak_above_start))
    dist.destroy_process_group()


def _world(layout: dict[str, int]) -> int:
    n = 1
    for v in layout.values():
        n *= v
    return n


def _run(job: dict[str, Any]) -> tuple[float, int, int]:
    """The slowest rank's seconds, the parameters of one rank, and the most resident memory
    (bytes) a rank added while it saved or loaded."""
    world = _world(job["layout"])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return max(g[1] for g in got), max(g[2] for g in got), max(g[3] for g in got)


def checkpoint_case(
    fmt: str, write: dict[str, int], reads: list[dict[str, int]], directory: str, quick: bool
) -> dict[str, Any]:
    """Save at ``write`` in format ``fmt``, then load at each of ``reads``: the size on disk,
    the save's and each load's seconds (the slowest rank's) and each load's resident memory
    (the most a rank added)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    base = {"format": fmt, "directory": directory, "quick": quick}
    save_s, params, _ = _run({**base, "layout": write, "save": True})
    size = sum(f.stat().st_size for f in d.glob("rank-*.pt"))
    loads = [_run({**base, "layout": r, "save": False}) for r in reads]
    return {
        "size_bytes": size, "save_s": save_s, "parameters": params,
        "load_s": [s for s, _, _ in loads], "load_bytes": [b for _, _, b in loads],
    }  # fmt: skip
