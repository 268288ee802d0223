"""Rank-pool cases about what a rank holds (importable by spawned processes): the dtypes and
sizes a step runs with under each precision and ZeRO-1 setting, a checkpoint's round trip
through disk (``test_precision.py``), and a step's memory profile
(``test_memory_profile.py``)."""

from __future__ import annotations

from typing import Any

from engine_cases import through_disk
from helpers.batches import ragged_batch, to_host


def train_steps_case(cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    """``steps`` train steps on ragged batches (seeds 0, 1, 2, 0, ...): each step's loss and
    grad norm, the dtypes the step ran with (parameters, main gradients, the optimizer's master
    weights), and how many optimizer-state elements this rank holds."""
    import torch

    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    losses, norms = [], []
    for step in range(steps):
        plan = plan_step(to_host(ragged_batch(step % 3)), eng.cfg, loss=LossConfig())
        r = eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())
        losses.append(r.loss)
        norms.append(r.grad_norm)
    masters = [p for g in eng.optim.optimizer.param_groups for p in g["params"]]
    states = [
        t
        for o in getattr(eng.optim.optimizer, "chained_optimizers", [eng.optim.optimizer])
        for s in o.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    return {
        "is_last_stage": eng.is_last_stage,
        "losses": losses,
        "grad_norms": norms,
        "param_dtypes": sorted({str(p.dtype) for _, p in eng._parameters()}),
        "main_grad_dtypes": sorted({str(p.main_grad.dtype) for _, p in eng._parameters()}),
        "master_dtypes": sorted({str(p.dtype) for p in masters}),
        "master_numel": sum(p.numel() for p in masters),
        "adam_state_numel": sum(t.numel() for t in states),
        "num_parameters": eng.num_parameters(),
    }


def checkpoint_restore_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train a step, take this rank's checkpoint (as written to disk), train two more; load it
    and train the same two again. Returns both pairs of (loss, grad norm) and the weights'
    digests after each pair."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))

    def step(seed: int) -> tuple[float, float | None]:
        plan = plan_step(to_host(ragged_batch(seed)), eng.cfg, loss=LossConfig())
        r = eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())
        return r.loss, r.grad_norm

    step(0)
    saved = through_disk(eng.checkpoint.state())
    digest_saved = eng.weights_digest()
    first = [step(1), step(2)]
    digest_first = eng.weights_digest()
    eng.checkpoint.load(saved)
    digest_loaded = eng.weights_digest()
    again = [step(1), step(2)]
    return {
        "first": first,
        "again": again,
        "digests": [digest_saved, digest_first, digest_loaded, eng.weights_digest()],
    }


def profile_step(
    cfg: dict[str, Any], batch: list[dict[str, Any]], directory: str, alloc_mb: int
) -> dict[str, Any]:
    """Record one train step on every rank (plus a known allocation) and write the file."""
    import json
    from pathlib import Path

    import torch

    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg)
    eng.profiler.start(max_entries=10_000)
    marker = torch.ones(alloc_mb * (1 << 20) // 4)  # a known allocation inside the window
    eng.train_batch(plan.microbatches[eng.coords.dp], plan.loss)
    del marker
    path = eng.profiler.stop(Path(directory))
    events = json.loads(path.read_text())["traceEvents"]
    allocs = [
        e["args"]["Bytes"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Bytes", 0) > 0
    ]
    return {
        "name": path.name,
        "size": path.stat().st_size,
        "rank": eng.coords.rank,
        "coords": [eng.coords.pp, eng.coords.dp, eng.coords.cp, eng.coords.tp],
        "num_allocs": len(allocs),
        "max_alloc": max(allocs, default=0),
    }
