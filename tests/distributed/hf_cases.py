"""Rank functions for the Hugging Face import test (run on every rank of a pool)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from helpers.batches import to_host


def _engine_from_hf(directory: str, layout: dict[str, int]) -> Any:
    """This rank's shard of the engine started from a transformers checkpoint at ``layout``,
    as ``trainctl serve --init-hf`` starts one."""
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import EngineConfig, ModelConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    model = hf.model_config_from_hf(hf.read_config(Path(directory)), ModelConfig())
    return EngineShard(
        EngineConfig(
            model=model,
            layout=ParallelLayout(**layout),
            init_hf=directory,
            max_tokens_per_microbatch=max(256, model.max_seq_len),
        )
    )


def logprobs_from_hf(directory: str, layout: dict[str, int], batch: list[list[int]]) -> Any:
    """Build the engine from a Llama checkpoint and return its per-token log-probs."""
    from trainctl.api import LogProbsRequest
    from trainctl.workers.control.plan import plan_step

    eng = _engine_from_hf(directory, layout)
    req = LogProbsRequest(sequences=[{"tokens": t} for t in batch])
    plan = plan_step(list(req.sequences.without(*req.sequences.present)), eng.cfg)
    out = eng.logprobs(plan.microbatches[eng.coords.dp], entropy=False).per_sequence
    return {i: lp.tolist() for i, (lp, _) in out.items()}, dataclasses.asdict(eng.cfg.model)


def trained_export(
    directory: str, layout: dict[str, int], batch: list[dict[str, Any]], export_to: str
) -> dict[str, Any]:
    """From a transformers checkpoint at ``layout``: the eval loss, one train step, the eval
    loss again; then the export: every rank's owned shards gathered (over the world's group
    here; through Ray's object store in the service) and merged by rank 0
    (``weights.merge_owned``, as the rank actor's exporter merges them), which writes the
    family's checkpoint to ``export_to``."""
    import torch.distributed as dist

    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine import hf, weights
    from trainctl.workers.rank.export import Exporter

    eng = _engine_from_hf(directory, layout)
    mbs = plan_step(to_host(batch), eng.cfg, loss=LossConfig()).microbatches[eng.coords.dp]
    before = eng.eval_batch(mbs, LossConfig()).loss
    eng.train_batch(mbs, LossConfig())
    after = eng.eval_batch(mbs, LossConfig()).loss
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, Exporter(eng).canonical_shards())
    if dist.get_rank() == 0:
        hf.save(Path(export_to), weights.merge_owned(parts, eng.cfg.layout.tp), eng.cfg.model)
    dist.barrier()
    return {"last_stage": eng.is_last_stage, "before": before, "after": after}


def eval_from_hf(directory: str, batch: list[dict[str, Any]]) -> float:
    """The eval loss of a one-rank engine started from the checkpoint in ``directory``."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step

    eng = _engine_from_hf(directory, {})
    mbs = plan_step(to_host(batch), eng.cfg, loss=LossConfig()).microbatches[0]
    return float(eng.eval_batch(mbs, LossConfig()).loss)


def lora_from_hf(
    directory: str,
    adapter: dict[str, Any],
    warm: list[list[int]],
    batch: list[list[int]],
    export_to: str,
) -> dict[str, Any]:
    """On one rank: the Hugging Face checkpoint as a frozen base, adapter ``adapter`` created
    and trained one step on ``warm`` (so both factors are nonzero) and exported in PEFT's
    format to ``export_to``; then, on ``batch``, its per-token log-probs, one cross-entropy
    pass's loss and its full canonical adapter gradients."""
    from trainctl.api import LogProbsRequest
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine import hf, hf_adapter
    from trainctl.workers.engine.boundary import AdapterSpec
    from trainctl.workers.engine.config import EngineConfig, LoraConfig, ModelConfig
    from trainctl.workers.engine.shard import EngineShard

    model = hf.model_config_from_hf(hf.read_config(Path(directory)), ModelConfig())
    cfg = EngineConfig(
        model=model,
        init_hf=directory,
        max_tokens_per_microbatch=max(256, model.max_seq_len),
        lora=LoraConfig(max_adapters=2, max_rank=8),
    )
    eng = EngineShard(cfg)
    spec = AdapterSpec(**{**adapter, "targets": tuple(adapter["targets"])})
    eng.adapters.create(spec)
    eng.adapters.activate(spec.name)

    def plan(seqs: list[list[int]]) -> Any:
        req = LogProbsRequest(sequences=[{"tokens": t} for t in seqs])
        return plan_step(list(req.sequences.without(*req.sequences.present)), eng.cfg)

    eng.train_batch(plan(warm).microbatches[0], LossConfig())
    shards = eng.canonical_shards()
    hf_adapter.save_peft(Path(export_to), shards, model, spec)
    merged = hf_adapter.merged(shards, model, spec)
    hf.save(Path(export_to) / "merged", merged, hf_adapter.untie_if_head_adapted(model, spec))
    mbs = plan(batch).microbatches[0]
    lps = eng.logprobs(mbs).per_sequence
    loss = eng.train_pass(mbs, LossConfig()).loss
    grads = {k: v.numpy() for k, v in eng.canonical_shards(grads=True).items()}
    return {
        "logprobs": {i: lp.tolist() for i, (lp, _) in lps.items()},
        "loss": loss,
        "grads": grads,
    }
