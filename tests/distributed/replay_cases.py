"""Routing replay, run on every rank of a pool (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from helpers.batches import numpy_shards, to_host


def random_routes(batch: list[dict[str, Any]], *, layers: int, experts: int, top_k: int,
                  seed: int = 7) -> list[np.ndarray]:  # fmt: skip
    """Per sequence ``[tokens, layers, top_k]``: distinct experts drawn at random for each
    (token id, position), so sequences that share a prefix share its routes (as a sampler's
    would, having computed the prefix once)."""
    rng = np.random.default_rng(seed)
    vocab = 1 + max(max(s["tokens"]) for s in batch)
    longest = max(len(s["tokens"]) for s in batch)
    table = np.argsort(rng.random((vocab, longest, layers, experts)), axis=3)[..., :top_k]
    return [table[s["tokens"], np.arange(len(s["tokens"]))] for s in batch]


def _with_routes(seqs: list[Any], routes: list[np.ndarray] | None) -> list[Any]:
    from trainctl.api import TokenSequence

    if routes is None:
        return seqs
    return [
        TokenSequence(**{**s._cols, "routed_experts": r}) for s, r in zip(seqs, routes, strict=True)
    ]


def replay_case(
    cfg: dict[str, Any],
    batch: list[dict[str, Any]],
    routes: list[np.ndarray],
    packing: str = "flat",
) -> dict[str, Any]:
    """With ``routes`` replayed: the routes the trainer reports and the log-probs, the loss and
    gradients of one cross-entropy step, the router's gradient norm, the parameters after the
    step; then the reported routes again, with and without replay. Also the router's own routes
    before the step. Route pieces come back as ``LogProbsPart``s for ``merge_routes``."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    dp = eng.coords.dp

    def mbs(replay: bool) -> Any:
        seqs = _with_routes(to_host(batch), routes if replay else None)
        return plan_step(seqs, eng.cfg, loss=LossConfig(), packing=packing).microbatches[dp]

    out: dict[str, Any] = {
        "coords": {"tp": eng.coords.tp, "pp": eng.coords.pp},
        "is_last_stage": eng.is_last_stage,
    }
    out["own_before"] = eng.logprobs(mbs(False), routes=True)
    out["replayed_before"] = eng.logprobs(mbs(True), routes=True)
    out["loss"] = eng.train_pass(mbs(True), LossConfig()).loss
    out["grads"] = numpy_shards(eng.canonical_shards(grads=True, owned=True))
    out["router_grad_norm"] = float(
        sum(
            float(p.main_grad.double().pow(2).sum())
            for c in eng.chunks
            for n, p in c.module.named_parameters()
            if n.endswith("router.weight")
        )
    )
    out["grad_norm"] = eng.optim.update_local()
    eng.optim.publish()
    out["params"] = numpy_shards(eng.canonical_shards(owned=True))
    out["replayed_after"] = eng.logprobs(mbs(True), routes=True)
    out["own_after"] = eng.logprobs(mbs(False), routes=True)
    return out
