"""Rank functions for the split step and the RL metrics (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from helpers.batches import numpy_shards, ragged_batch, to_host


def split_step_case(
    cfg: dict[str, Any], parts: list[list[dict[str, Any]]], loss: tuple[Any, ...]
) -> dict[str, Any]:
    """The split step: one ``forward_backward`` part per batch in ``parts`` (the second one
    run twice, the first time rolled back as if another rank had failed it), then the
    window's one reduction and an AdamW step. Returns the gradients after the reduction, the
    grad norm, the parameters after the step and the parts' losses."""
    from trainctl.api.models import LossConfig, LossKind, Normalization
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    kind, norm, options = loss
    spec = LossConfig(kind=LossKind(kind), normalization=Normalization(norm), **options)
    eng = EngineShard(EngineConfig.from_dict(cfg))
    plans = [plan_step(to_host(b), eng.cfg, loss=spec, deferred_normalizer=True) for b in parts]
    part_losses, token_losses = [], []
    for i, plan in enumerate(plans):
        mbs = plan.microbatches[eng.coords.dp]
        if i == 1:
            eng.forward_backward(mbs, spec)
            eng.rollback_part()  # as if a peer failed this part: the sum is as before it
        part = eng.forward_backward(mbs, spec)
        part_losses.append(part.report.loss)
        token_losses.append({i: tl.tolist() for i, (_, tl) in part.per_sequence.items()})
    divisor = {
        "token_mean": sum(p.loss_normalizer for p in plans),
        "seq_mean_token_mean": sum(p.num_loss_sequences for p in plans),
        "sum": 1.0,
    }[norm]
    norm_value = eng.finish_window(divisor)
    grads = numpy_shards(eng.canonical_shards(grads=True, owned=True))
    eng.apply()
    eng.optim.publish()
    return {
        "coords": {"tp": eng.coords.tp},
        "is_last_stage": eng.is_last_stage,
        "part_losses": part_losses,
        "token_losses": token_losses,
        "grads": grads,
        "grad_norm": norm_value,
        "params": numpy_shards(eng.canonical_shards(owned=True)),
    }


def rollback_twice_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """Part A, then part B undone twice (by the failing rank, then by the controller's
    call to every rank): the window still holds A, bit for bit."""
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.accumulation import grad_buffers
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    a, b = (plan_step(to_host(ragged_batch(s)), eng.cfg, deferred_normalizer=True) for s in (1, 2))
    eng.forward_backward(a.microbatches[eng.coords.dp], a.loss)
    after_a = [g.clone() for g in grad_buffers(eng.chunks)]
    eng.forward_backward(b.microbatches[eng.coords.dp], b.loss)
    eng.rollback_part()
    eng.rollback_part()
    same = all(bool((g == s).all()) for g, s in zip(grad_buffers(eng.chunks), after_a, strict=True))
    return {"same": same, "parts": eng.window.parts, "nonzero": any(bool(s.any()) for s in after_a)}


def policy_metrics_case(cfg: dict[str, Any], batch: list[dict[str, Any]]) -> dict[str, Any]:
    """The RL metrics of one PPO eval pass, and the per-token log-probs and entropies of the
    same weights (reporting ranks) for a single-process reference."""
    from trainctl.api.models import LossConfig, LossKind
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    spec = LossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    plan = plan_step(to_host(batch), eng.cfg, loss=spec, packing="flat")
    mbs = plan.microbatches[eng.coords.dp]
    metrics = eng.eval_batch(mbs, spec).metrics
    lps = eng.logprobs(
        plan_step(to_host(batch), eng.cfg).microbatches[eng.coords.dp], entropy=True
    ).per_sequence
    return {
        "is_last_stage": eng.is_last_stage,
        "metrics": metrics,
        "logprobs": {i: lp for i, (lp, _) in lps.items()},
        "entropy": {i: e for i, (_, e) in lps.items()},
    }
