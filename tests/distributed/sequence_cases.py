"""Rank-side cases of ``test_sequence_losses.py`` (run in the pool's rank processes)."""

from __future__ import annotations

from typing import Any

from helpers.batches import numpy_shards, to_host


def logprobs_case(cfg: dict[str, Any], batch: list[dict[str, Any]], packing: str) -> dict:
    """Per-token log-probs by request index, from the ranks that report them."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg, loss=LossConfig(), packing=packing)
    out = eng.logprobs(plan.microbatches[eng.coords.dp]).per_sequence
    return {i: lp for i, (lp, _) in out.items()}


def gspo_native_and_weighted(
    cfg: dict[str, Any],
    batch: list[dict[str, Any]],
    weights: list[list[float]],
    clip: float,
    packing: str,
) -> dict[str, Any]:
    """The gradients of native ``gspo`` (a sum over tokens) and, from the same parameters, of
    cross-entropy with per-token ``weights`` and a sum: the second half of Tinker's
    ``forward_backward_custom`` (its first half, the loss's gradient with respect to the
    log-probs, is the caller's). Both as full-tensor shards (DP/CP replica 0)."""
    from trainctl.api.models import LossConfig, LossKind, Normalization
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    gspo = LossConfig(
        kind=LossKind.GSPO, normalization=Normalization.SUM, clip_low=clip, clip_high=clip
    )
    plan = plan_step(to_host(batch), eng.cfg, loss=gspo, packing=packing)
    mbs = plan.microbatches[eng.coords.dp]
    native_loss = eng.train_pass(mbs, gspo).loss
    native = numpy_shards(eng.canonical_shards(grads=True, owned=True))
    eng.optim.zero_grad()
    ce = LossConfig(normalization=Normalization.SUM)
    weighted = [
        {"tokens": s["tokens"], "loss_mask": s["loss_mask"], "weights": w}
        for s, w in zip(batch, weights, strict=True)
    ]
    plan = plan_step(to_host(weighted), eng.cfg, loss=ce, packing=packing)
    eng.train_pass(plan.microbatches[eng.coords.dp], ce)
    return {
        "coords": {"tp": eng.coords.tp},
        "is_last_stage": eng.is_last_stage,
        "native_loss": native_loss,
        "native": native,
        "weighted": numpy_shards(eng.canonical_shards(grads=True, owned=True)),
        "tree_microbatches": sum(mb.tree is not None for mb in mbs),
    }
