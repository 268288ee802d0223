"""Functions the rank pool runs on every rank (importable by spawned processes)."""

from __future__ import annotations

import io
from typing import Any

from helpers.batches import numpy_shards, ragged_batch, to_host
from helpers.layouts import LOSSES


def _count_expert_grads(eng: Any) -> tuple[dict[str, int], list[Any]]:
    """Count, per local expert parameter, the full-shape gradients autograd delivers to it. An
    expert that returned None instead leaves ``param.grad`` None when DDP's hook runs, which
    megatron refuses (or hangs on) once gradient reduction overlaps the backward."""
    fired: dict[str, int] = {}
    handles = []
    for c in eng.chunks:
        for n, p in c.module.named_parameters():
            if ".local_experts." in n and p.requires_grad:  # frozen under LoRA
                fired[n] = 0

                def hook(p: Any, n: str = n) -> None:
                    fired[n] += p.grad is not None and p.grad.shape == p.shape

                handles.append(p.register_post_accumulate_grad_hook(hook))
    return fired, handles


def force_routing(eng: Any, offsets: list[float]) -> None:
    """Add ``offsets`` to every router's logits (e.g. -1e4 to starve some experts)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    bias = torch.tensor(offsets)
    for chunk in eng.chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                gating = m.gating
                m.gating = lambda x, g=gating: g(x) + bias  # type: ignore[method-assign]


def step_and_collect(
    cfg: dict[str, Any],
    batch: list[dict[str, Any]],
    losses: tuple[Any, ...] = LOSSES[:1],
    route_offsets: list[float] | None = None,
    packing: str = "flat",
    adapter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """For every loss: eval loss, train loss, gradients and grad norm; then one optimizer step
    with the last loss and the parameters after it - gradients and parameters as full-tensor
    shards by canonical name (DP/CP replica 0 only). ``adapter``: first create that LoRA
    adapter and train it one step on another batch (so both its factors are nonzero); the
    gradients are then the adapter's."""
    from trainctl.api.models import LossConfig, LossKind, Normalization
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    if route_offsets is not None:
        force_routing(eng, route_offsets)
    if adapter is not None:
        _warm_adapter(eng, adapter, packing)
    out: dict[str, Any] = {
        "coords": {
            "tp": eng.coords.tp,
            "pp": eng.coords.pp,
            "dp": eng.coords.dp,
            "cp": eng.coords.cp,
            "ep": eng.coords.ep,
        },
        "is_last_stage": eng.is_last_stage,
        "per_loss": {},
    }
    # Tokens reaching the first local layer's input norm, per micro-batch of the first eval
    # pass: all of this rank's CP shard, or 1 / tp of it under sequence parallelism.
    norm = eng.chunks[0].module.decoder.layers[0].input_layernorm
    seen: list[int] = []
    hook = norm.register_forward_pre_hook(lambda _, args: seen.append(int(args[0].shape[0])))
    for i, (kind, norm, options) in enumerate(losses):
        spec = LossConfig(kind=LossKind(kind), normalization=Normalization(norm), **options)
        plan = plan_step(to_host(batch), eng.cfg, loss=spec, packing=packing)
        mbs = plan.microbatches[eng.coords.dp]
        ev = eng.eval_batch(mbs, spec)
        if i == 0:
            hook.remove()
            out["norm_rows"] = seen
            out["microbatch_tokens"] = [mb.model_tokens for mb in mbs]
            out["tree_microbatches"] = sum(mb.tree is not None for mb in mbs)
            out["computed_tokens"] = plan.computed_tokens
            out["flat_tokens"] = plan.num_tokens
        fired, handles = _count_expert_grads(eng)
        r: dict[str, Any] = {
            "eval_loss": ev.loss,
            "eval_metrics": ev.metrics,
            "loss": eng.train_pass(mbs, spec).loss,
        }
        for h in handles:
            h.remove()
        r["shard_grads"] = numpy_shards(eng.canonical_shards(grads=True, owned=True))
        # Every local expert weight got a gradient in this backward, with the weight's shape.
        r["expert_grads_missing"] = [
            n
            for c in eng.chunks
            for n, p in c.module.named_parameters()
            if n in fired and (not fired[n] or p.main_grad is None or p.main_grad.shape != p.shape)
        ]
        r["expert_modules"] = sorted(
            {
                type(m).__name__
                for c in eng.chunks
                for m in c.modules()
                if hasattr(m, "local_experts")
            }
        )
        r["local_expert_grad_norm"] = float(
            sum(
                float(p.main_grad.double().pow(2).sum())
                for c in eng.chunks
                for n, p in c.module.named_parameters()
                if ".local_experts." in n and p.requires_grad
            )
        )
        if i + 1 < len(losses):
            r["grad_norm"] = eng.optim.grad_norm()
            eng.optim.zero_grad()
        else:
            r["grad_norm"] = eng.optim.update_local()
            eng.optim.publish()
            out["shard_params"] = numpy_shards(eng.canonical_shards(owned=True))
            out["dummies"] = plan.num_dummies
            out["real_microbatches"] = sum(not mb.is_dummy for mb in mbs)
        out["per_loss"][kind] = r
    return out


def _warm_adapter(eng: Any, adapter: dict[str, Any], packing: str) -> None:
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.boundary import AdapterSpec

    spec = AdapterSpec(**{**adapter, "targets": tuple(adapter["targets"])})
    eng.adapters.create(spec)
    eng.adapters.activate(spec.name)
    plan = plan_step(to_host(ragged_batch(1)), eng.cfg, loss=LossConfig(), packing=packing)
    eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())


def tied_embedding_case(cfg: dict[str, Any], batch: list[dict[str, Any]]) -> dict[str, Any]:
    """One train step of a tied-embedding model; then its checkpoint, saved and loaded over a
    corrupted last-stage copy. Returns this rank's tied tensor after the step and after the
    load, the embedding-like names its checkpoint holds, and its parameter count."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine import weights
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg, loss=LossConfig())
    eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())

    def tied() -> list[Any]:
        return [
            p
            for c in eng.chunks
            for n, p in c.module.named_parameters()
            if n in (weights.EMBEDDING, "output_layer.weight")
        ]

    after_step = [p.detach().clone().numpy() for p in tied()]
    state = through_disk(eng.checkpoint.state())  # as written to disk: no shared storage
    with_names = [
        k
        for sd in state["chunks"]
        for k in sd
        if k.endswith(("embeddings.weight", "output_layer.weight"))
    ]
    for p in tied():
        p.data.add_(1.0)  # the load must restore it, the copy from the first stage
    eng.checkpoint.load(state)
    return {
        "pp": eng.coords.pp,
        "after_step": after_step,
        "after_load": [p.detach().clone().numpy() for p in tied()],
        "checkpoint_names": with_names,
        "num_parameters": eng.num_parameters(),
        "grad_norm_names": [n for n, _ in eng._parameters()],
    }


def logprobs_and_grads(
    cfg: dict[str, Any], batch: list[dict[str, Any]], packing: str = "flat"
) -> dict[str, Any]:
    """Per-token log-probs and entropies (by request index, from the reporting ranks) and the
    gradients of one cross-entropy backward, as full-tensor shards."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg, loss=LossConfig(), packing=packing)
    mbs = plan.microbatches[eng.coords.dp]
    out = eng.logprobs(mbs, entropy=True).per_sequence
    eng.train_pass(mbs, LossConfig())
    return {
        "coords": {"tp": eng.coords.tp},
        "logprobs": {i: lp for i, (lp, _) in out.items()},
        "entropy": {i: ent for i, (_, ent) in out.items()},
        "grads": numpy_shards(eng.canonical_shards(grads=True, owned=True)),
    }


def recompute_case(cfg: dict[str, Any], batch: list[dict[str, Any]]) -> dict[str, Any]:
    """One cross-entropy forward/backward: the loss, the gradients, and how many times the
    dense MLPs, their SwiGLUs and the layers' RMSNorms ran forward (recomputation runs them
    again in backward)."""
    from megatron.core.transformer.mlp import MLP

    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    plan = plan_step(to_host(batch), eng.cfg, loss=LossConfig())
    mbs = plan.microbatches[eng.coords.dp]
    from trainctl.workers.engine.mlp import SwiGLU

    calls = {"mlp": 0, "norm": 0, "swiglu": 0}

    def count(kind: str) -> Any:
        return lambda *_: calls.__setitem__(kind, calls[kind] + 1)

    for c in eng.chunks:
        for name, m in c.named_modules():
            if isinstance(m, MLP):
                m.register_forward_hook(count("mlp"))
            elif isinstance(m, SwiGLU):
                m.register_forward_hook(count("swiglu"))
            elif name.endswith(("input_layernorm", "pre_mlp_layernorm")):
                m.register_forward_hook(count("norm"))
    loss = eng.train_pass(mbs, LossConfig()).loss
    return {
        "coords": {"tp": eng.coords.tp},
        "loss": loss,
        "grads": numpy_shards(eng.canonical_shards(grads=True, owned=True)),
        "mlp_forwards": calls["mlp"],
        "norm_forwards": calls["norm"],
        "swiglu_forwards": calls["swiglu"],
        "microbatches": len(mbs),
        "local_layers": sum(len(c.module.decoder.layers) for c in eng.chunks),
    }


def through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` saved and read back as the ranks do: ``torch.load(weights_only=True)``,
    which unpickles tensors and plain containers only."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
