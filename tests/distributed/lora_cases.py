"""Rank functions of the multi-adapter tests (run on every rank of a pool)."""

from __future__ import annotations

from typing import Any

from helpers.batches import ragged_batch, to_host

ADAPTERS = {
    "a": {"name": "a", "rank": 4, "alpha": 8.0, "targets": ("attn", "mlp", "unembed"), "seed": 1},
    "b": {"name": "b", "rank": 8, "alpha": 8.0, "targets": ("attn",), "seed": 2},
    "c": {"name": "c", "rank": 2, "alpha": 4.0, "targets": ("mlp", "unembed"), "seed": 3},
}
SEED_OFFSET = {"a": 0, "b": 10, "c": 20}
"""Each adapter trains on its own sequence of batches."""


def train_adapters(cfg: dict[str, Any], order: str, delete_after: str = "") -> dict[str, Any]:
    """Create the adapters named in ``order`` and step them in that order (``"abab"``: a, b,
    a, b), each on its own sequence of batches. Returns each adapter's losses and grad norms,
    its digest on this rank, the base's digest before and after, and the steps the adapters
    report. ``delete_after``: delete that adapter at the end and train ``a`` once more."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.boundary import AdapterSpec
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    base = eng.weights_digest()
    for name in dict.fromkeys(order):
        eng.adapters.create(AdapterSpec(**ADAPTERS[name]))
    seen = dict.fromkeys(ADAPTERS, 0)
    out: dict[str, Any] = {"losses": {}, "digests": {}}
    for name in order:
        eng.adapters.activate(name)
        seed = SEED_OFFSET[name] + seen[name]
        seen[name] += 1
        plan = plan_step(to_host(ragged_batch(seed)), eng.cfg, loss=LossConfig())
        r = eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())
        out["losses"].setdefault(name, []).append((r.loss, r.grad_norm))
    for name in dict.fromkeys(order):
        out["digests"][name] = eng.adapters.digest(name)
    out["steps"] = {i.spec.name: i.step for i in eng.adapters.infos()}
    out["base"] = (base, eng.weights_digest())
    out["on_disk"] = sorted(
        s.spec.name
        for s in eng.adapters.bank.slots.values()
        if s.path is not None and s.path.is_file()
    )
    if delete_after:
        eng.adapters.delete(delete_after)
        out["after_delete"] = eng.adapters.digest("a")
        out["left"] = sorted(i.spec.name for i in eng.adapters.infos())
    return out


def split_steps(cfg: dict[str, Any], order: str) -> dict[str, Any]:
    """Tinker's split step for two adapters whose calls interleave: ``order`` is a string of
    ``a``/``b`` (a ``forward_backward`` part of that adapter) and ``A``/``B`` (its
    ``optim_step``). Returns each adapter's grad norms and final digest."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.boundary import AdapterSpec
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    for name in sorted({c.lower() for c in order}):
        eng.adapters.create(AdapterSpec(**ADAPTERS[name]))
    seen = dict.fromkeys(ADAPTERS, 0)
    norms: dict[str, list[float]] = {name: [] for name in ADAPTERS}
    for c in order:
        name = c.lower()
        eng.adapters.activate(name)
        if c.islower():
            plan = plan_step(
                to_host(ragged_batch(SEED_OFFSET[name] + seen[name])),
                eng.cfg, loss=LossConfig(), deferred_normalizer=True,
            )  # fmt: skip
            seen[name] += 1
            eng.forward_backward(plan.microbatches[eng.coords.dp], LossConfig())
        else:
            norms[name].append(eng.finish_window(100.0))
            eng.apply()
            eng.optim.publish()
    names = sorted({c.lower() for c in order})
    on_disk = sorted(s.spec.name for s in eng.adapters.bank.slots.values() if s.path is not None)
    return {
        "norms": norms,
        "digests": {n: eng.adapters.digest(n) for n in names},
        "on_disk": on_disk,
    }
