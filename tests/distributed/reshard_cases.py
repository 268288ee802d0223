"""Rank-pool cases for the reshardable checkpoint (importable by spawned processes): train
some steps, optionally after loading a checkpoint written at another layout, optionally
saving one; ``test_reshard.py`` compares the runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers.batches import numpy_shards, ragged_batch, to_host


def resharded_run(
    cfg: dict[str, Any],
    directory: str,
    seeds: list[int],
    opts: dict[str, Any],
) -> dict[str, Any]:
    """Build the shard; ``load``: the checkpoint in ``directory`` (written at any layout);
    ``adapter``: create it and train it (a LoRA service), unless loaded; one train step per
    seed; ``save``: write this rank's file there. Returns each step's loss and grad norm, an
    eval loss after, the step count, and the parameters (the adapter's, with one) as
    canonical shards. ``opts``: ``load``, ``save``, ``optimizer`` (default true), ``adapter``,
    ``only`` (save and load that adapter alone), ``into`` (load it as that name); the rank
    pool passes positional arguments only."""
    import torch

    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.boundary import AdapterSpec
    from trainctl.workers.engine.checkpoint import files
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.lora import is_lora
    from trainctl.workers.engine.shard import EngineShard

    load, save, adapter = opts.get("load", False), opts.get("save", False), opts.get("adapter")
    optimizer = opts.get("optimizer", True)
    eng = EngineShard(EngineConfig.from_dict(cfg))
    only = opts.get("only")  # the adapter saved and loaded alone; loaded as ``into``
    into = opts.get("into") or only
    if load:
        saved = files.reader(Path(directory))
        staged = eng.checkpoint.stage_reshardable(saved, only, into)
        eng.checkpoint.apply_reshardable(staged, optimizer=optimizer)
    elif adapter is not None:
        eng.adapters.create(AdapterSpec(**{**adapter, "targets": tuple(adapter["targets"])}))
    if adapter is not None:
        eng.adapters.activate(into if load and only else adapter["name"])
    losses, norms = [], []
    for seed in seeds:
        plan = plan_step(to_host(ragged_batch(seed)), eng.cfg, loss=LossConfig())
        r = eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())
        losses.append(r.loss)
        norms.append(r.grad_norm)
    plan = plan_step(to_host(ragged_batch(7)), eng.cfg, loss=LossConfig())
    eval_loss = eng.eval_batch(plan.microbatches[eng.coords.dp], LossConfig()).loss
    if save:
        path = Path(directory) / f"rank-{eng.coords.rank:05d}.pt"
        torch.save(eng.checkpoint.reshardable_state(only), path)
    params = eng.canonical_shards(owned=True)
    if adapter is not None:
        params = {n: t for n, t in params.items() if is_lora(n)}
    return {
        "coords": {"tp": eng.coords.tp},
        "is_last_stage": eng.is_last_stage,
        "losses": losses,
        "grad_norms": norms,
        "eval_loss": eval_loss,
        "step": eng.optim.step,
        "shard_params": numpy_shards(params),
    }
