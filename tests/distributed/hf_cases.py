"""Rank functions for the Hugging Face import test (run on every rank of a pool)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def logprobs_from_hf(directory: str, layout: dict[str, int], batch: list[list[int]]) -> Any:
    """Build the engine from a Llama checkpoint and return its per-token log-probs."""
    from trainctl.api import LogProbsRequest
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import EngineConfig, ModelConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    model = hf.model_config_from_hf(hf.read_config(Path(directory)), ModelConfig())
    cfg = EngineConfig(
        model=model,
        layout=ParallelLayout(**layout),
        init_hf=directory,
        max_tokens_per_microbatch=max(256, model.max_seq_len),
    )
    eng = EngineShard(cfg)
    req = LogProbsRequest(sequences=[{"tokens": t} for t in batch])
    plan = plan_step(list(req.sequences.without(*req.sequences.present)), eng.cfg)
    out = eng.logprobs(plan.microbatches[eng.coords.dp], entropy=False)
    return {i: lp.tolist() for i, (lp, _) in out.items()}, dataclasses.asdict(model)
