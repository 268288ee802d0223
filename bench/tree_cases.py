"""Tree packing against flat packing: train-step throughput, attention time and peak memory of
one rank (run in a fresh child process by run.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bench.memory import MIB, PeakRSS
from trainctl.service.cluster import free_port

MODELS: dict[str, dict[str, Any]] = {
    # The embedded default (2 layers, hidden 128, vocab 512), long sequences allowed.
    "embedded": {"model": {"max_seq_len": 4096}},
    # Wider: the MLP and the LM head dominate the per-token cost, as in real models.
    "wide": {
        "model": {
            "num_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_query_groups": 4,
            "ffn_hidden_size": 2048,
            "vocab_size": 16384,
            "max_seq_len": 4096,
        }
    },
}
BUDGET = 20480
"""Micro-batch token budget of both configs (``max_tokens_per_microbatch``): one GRPO group of
16 x (1024 + 1024) tokens fits as one trie (17,408 tokens)."""


def shape_batch(shape: str, vocab: int) -> list[list[int]]:
    """``grpo-G-P-R``: G responses of R tokens to one P-token prompt; ``turns``: a 512-token
    first turn, 4 second turns of 256, each with 2 third turns of 256 (8 sequences)."""
    rng = np.random.default_rng(0)

    def tok(n: int) -> list[int]:
        return rng.integers(1, vocab, n).tolist()

    if shape.startswith("grpo"):
        _, g, p, r = shape.split("-")
        prompt = tok(int(p))
        return [prompt + tok(int(r)) for _ in range(int(g))]
    first = tok(512)
    seconds = [first + tok(256) for _ in range(4)]
    return [s + tok(256) for s in seconds for _ in range(2)]


def tree_step_case(model: str, shape: str, packing: str, steps: int) -> dict[str, float]:
    """Median train-step time of ``shape`` on ``model`` packed ``packing``, the flat and the
    computed token counts, the forward core-attention time and its (query, key) pairs, and
    the peak RSS above the start of one step."""
    from trainctl.api import LossConfig, TokenSequence
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.attention import PackedCoreAttention
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    torch.set_num_threads(2)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    cfg = EngineConfig.from_dict({**MODELS[model], "max_tokens_per_microbatch": BUDGET})
    eng = EngineShard(cfg)
    seqs = [
        TokenSequence(
            tokens=np.asarray(t, np.int64),
            loss_mask=np.asarray([0] * 64 + [1] * (len(t) - 64), np.float32),
        )
        for t in shape_batch(shape, cfg.model.vocab_size)
    ]
    plan = plan_step(seqs, eng.cfg, loss=LossConfig(), packing=packing)
    mbs = plan.microbatches[0]
    attn_s = [0.0]
    forward = PackedCoreAttention.forward

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(self, *args, **kwargs)
        attn_s[0] += time.perf_counter() - t0
        return out

    eng.train_batch(mbs, plan.loss)  # warm-up
    times = []
    with PeakRSS() as m:
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.train_batch(mbs, plan.loss)
            times.append(time.perf_counter() - t0)
    PackedCoreAttention.forward = timed  # type: ignore[method-assign]
    with torch.no_grad():
        eng.eval_batch(mbs, plan.loss)
    PackedCoreAttention.forward = forward  # type: ignore[method-assign]
    pairs = 0
    for mb in mbs:
        if mb.tree is not None:
            from trainctl.workers.ops.tree_attention import Segments

            pairs += Segments.decode(torch.from_numpy(mb.tree.segments), mb.model_tokens).pairs
        else:
            pairs += sum(n * (n + 1) // 2 for n in np.diff(mb.cu_seqlens).tolist())
    dist.destroy_process_group()
    return {
        "step_s": statistics.median(times),
        "tokens": float(plan.num_tokens),
        "computed": float(plan.computed_tokens),
        "microbatches": float(len(mbs)),
        "attention_s": attn_s[0],
        "pairs": float(pairs),
        "peak_MiB": m.peak_above_start / MIB,
    }
