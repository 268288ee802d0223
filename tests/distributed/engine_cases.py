"""Functions the rank pool runs on every rank (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import numpy as np


def ragged_batch(seed: int = 0, vocab: int = 512) -> list[dict[str, Any]]:
    """Ragged sequences with prompt masks, one weighted, one without any target."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((37, 5, 64, 19, 2, 41, 12, 30)):
        tokens = rng.integers(0, vocab, n).tolist()
        prompt = int(rng.integers(1, max(2, n // 2)))
        mask = [0] * prompt + [1] * (n - prompt)
        seq: dict[str, Any] = {"tokens": tokens, "loss_mask": mask}
        if i == 3:
            seq["weights"] = rng.uniform(0.5, 2.0, n).tolist()
        if i == 4:
            seq["loss_mask"] = [0] * n
        out.append(seq)
    return out


def to_host(batch: list[dict[str, Any]]) -> list[Any]:
    from trainctl.workers.batch import HostSequence

    return [
        HostSequence(
            tokens=np.asarray(s["tokens"], np.int64),
            loss_mask=np.asarray(s["loss_mask"], np.float32),
            weights=None if "weights" not in s else np.asarray(s["weights"], np.float32),
        )
        for s in batch
    ]


def step_and_collect(cfg: dict[str, Any], batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Eval, forward/backward, gradients, one optimizer step, parameters - as numpy."""
    from trainctl.workers.config import EngineConfig
    from trainctl.workers.engine import EngineShard
    from trainctl.workers.plan import plan_step

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg)
    mbs = plan.microbatches[eng.coords.dp]
    eval_loss = eng.eval_batch(mbs, plan.loss).loss
    loss = eng.forward_backward(mbs, plan.loss)
    grads = {
        name: p.main_grad.detach().clone().numpy()
        for name, p in eng.chunks[0].module.named_parameters()
    }
    shard_grads = eng.canonical_shards(grads=True)
    grad_norm = eng.optimizer_step()
    replica0 = eng.coords.dp == 0 and eng.coords.cp == 0
    return {
        "coords": {
            "tp": eng.coords.tp,
            "pp": eng.coords.pp,
            "dp": eng.coords.dp,
            "cp": eng.coords.cp,
        },
        "shard_grads": {k: v.numpy() for k, v in shard_grads.items()} if replica0 else {},
        "shard_params": (
            {k: v.numpy() for k, v in eng.canonical_shards().items()} if replica0 else {}
        ),
        "is_last_stage": eng.is_last_stage,
        "eval_loss": eval_loss,
        "loss": loss,
        "grad_norm": grad_norm,
        "grads": grads,
        "params": {k: v.numpy() for k, v in eng.named_parameters().items()},
        "dummies": plan.num_dummies,
        "real_microbatches": sum(not mb.is_dummy for mb in mbs),
    }


def full_tensors(results: list[dict[str, Any]], key: str) -> dict[str, np.ndarray]:
    """Merge the DP-replica-0 shards of every rank into full canonical tensors."""
    import torch

    from trainctl.workers.weights import shard_rule

    by_name: dict[str, dict[int, np.ndarray]] = {}
    for r in results:
        for name, shard in r[key].items():
            by_name.setdefault(name, {})[r["coords"]["tp"]] = shard
    out = {}
    for name, shards in by_name.items():
        ordered = [torch.from_numpy(shards[k]) for k in sorted(shards)]
        out[name] = shard_rule(name).unshard(ordered).numpy()
    return out
