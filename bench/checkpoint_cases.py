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
    from trainctl.api import CheckpointInfo
    from trainctl.workers.engine.checkpoint import files

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    eng = _engine(job["layout"], job["quick"])
    directory = Path(job["directory"])
    reshardable = job["format"] == "reshardable"
    dist.barrier()
    if job["save"]:
        _step(eng)
        dist.barrier()
    written, verify_s = None, 0.0
    t0 = time.perf_counter()
    with PeakRSS() as memory:
        if job["save"]:  # hashed as it is written, as the service saves
            state = eng.checkpoint.reshardable_state() if reshardable else eng.checkpoint.state()
            written = files.write(state, directory, rank, HEADER)
        else:  # proved first (this rank's share of the files), as the service loads
            info = CheckpointInfo.model_validate(job["info"])
            files.prove(directory, info, files.share(directory, info, rank, world), optimizer=True)
            verify_s = time.perf_counter() - t0
            if reshardable:
                staged = eng.checkpoint.stage_reshardable(files.reader(directory))
                eng.checkpoint.apply_reshardable(staged)
            else:
                eng.checkpoint.load(files.read(directory / files.name(rank), "bench"))
    seconds = time.perf_counter() - t0
    dist.barrier()
    out.put((rank, seconds, eng.num_parameters(), memory.peak_above_start, verify_s, written))
    dist.destroy_process_group()


HEADER = {"save_id": "bench", "step": 1, "layout": {}}
"""What every rank file of the bench's one save carries."""


def _world(layout: dict[str, int]) -> int:
    n = 1
    for v in layout.values():
        n *= v
    return n


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """The slowest rank's seconds (and of its proof of the files, for a load), the
    parameters of one rank, the most resident memory (bytes) a rank added while it saved or
    loaded, and the files a save wrote."""
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
    return {
        "seconds": max(g[1] for g in got), "parameters": max(g[2] for g in got),
        "bytes": max(g[3] for g in got), "verify_s": max(g[4] for g in got),
        "written": [g[5] for g in sorted(got, key=lambda g: g[0]) if g[5] is not None],
    }  # fmt: skip


def checkpoint_case(
    fmt: str, write: dict[str, int], reads: list[dict[str, int]], directory: str, quick: bool
) -> dict[str, Any]:
    """Save at ``write`` in format ``fmt``, then load at each of ``reads``: the size on disk,
    the save's and each load's seconds (the slowest rank's), each load's proof of the files
    (digests, header, finite values, moments) and resident memory (the most a rank added)."""
    from trainctl.api import CheckpointFile, CheckpointInfo

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    base = {"format": fmt, "directory": directory, "quick": quick}
    saved = _run({**base, "layout": write, "save": True})
    written = saved["written"]
    info = CheckpointInfo(
        checkpoint_id="bench", step=HEADER["step"], created_at=0.0, layout=HEADER["layout"],
        weights_digest="", size_bytes=sum(f.size_bytes for f in written),
        save_id=HEADER["save_id"], format=fmt,
        files={f.name: CheckpointFile(size_bytes=f.size_bytes, sha256=f.sha256,
                                      moments=f.moments) for f in written},
    )  # fmt: skip
    loads = [_run({**base, "layout": r, "save": False, "info": info.model_dump()}) for r in reads]
    return {
        "size_bytes": info.size_bytes, "save_s": saved["seconds"],
        "parameters": saved["parameters"], "load_s": [x["seconds"] for x in loads],
        "load_bytes": [x["bytes"] for x in loads], "verify_s": [x["verify_s"] for x in loads],
    }  # fmt: skip
