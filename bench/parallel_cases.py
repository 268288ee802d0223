"""Measured workloads that need several ranks of one layout (run in a fresh child process by
run.py, each rank a spawned process of its own)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch
import torch.distributed as dist

from bench.cases import one_sequence_peak
from trainctl.service.cluster import free_port

SP_MODEL = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_query_groups": 8,
    "ffn_hidden_size": 1024,
}
"""Hidden states wide against the per-rank MLP (ffn / tp = hidden): what sequence parallelism
splits (norms, residuals, the linears' saved inputs) is a large part of the activations."""


def _sp_rank(rank: int, port: int, sequence_parallel: str, tokens: int, out: Any) -> None:
    from trainctl.workers.engine.config import EngineConfig, ModelConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = EngineConfig(
        model=ModelConfig(**SP_MODEL, max_seq_len=tokens),  # type: ignore[arg-type]
        layout=ParallelLayout(tp=2),
        sequence_parallel=sequence_parallel,  # type: ignore[arg-type]
        max_tokens_per_microbatch=tokens,
    )
    out.put((rank, one_sequence_peak(EngineShard(cfg), tokens)))
    dist.destroy_process_group()


def sp_activation_case(sequence_parallel: str, tokens: int) -> dict[str, float]:
    """tp=2: each rank's peak RSS above the start of one forward/backward of one
    ``tokens``-long sequence (after a warm-up step), the larger of the two, and the time."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_sp_rank, args=(r, port, sequence_parallel, tokens, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    res = [r for _, r in sorted(out.get(timeout=1200) for _ in procs)]
    for p in procs:
        p.join()
    return {
        "peak_MiB": max(r["peak_MiB"] for r in res),
        "time_s": max(r["time_s"] for r in res),
        "loss": res[0]["loss"],
    }
