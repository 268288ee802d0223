"""What one train step costs, read off the dispatcher: bytes the backward writes, host reads of
tensors inside forward/backward, dispatched ops of the gradient norm, and the update of fused
AdamW against foreach. Functions the rank pool runs on every rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

LAYER = {
    # One layer whose widths are all under 512 (q/k/v together 384, the MLP's gate and up
    # 384), so at 512 tokens a [512, 512] score matrix would be the only op output with two
    # dimensions >= 512.
    "num_layers": 1, "hidden_size": 192, "ffn_hidden_size": 192, "num_attention_heads": 4,
    "num_query_groups": 2, "vocab_size": 500, "max_seq_len": 512,
}  # fmt: skip


def _tokens(lengths: list[int], vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, vocab, n).tolist()} for n in lengths]


def _plan(eng: Any, lengths: list[int]) -> list[Any]:
    from trainctl.api.models import LossConfig
    from trainctl.workers.control.plan import plan_step

    from helpers.batches import to_host

    batch = _tokens(lengths, eng.cfg.model.vocab_size)
    for s in batch:
        s["loss_mask"] = [1] * len(s["tokens"])
    plan = plan_step(to_host(batch), eng.cfg, loss=LossConfig(), packing="flat")
    return plan.microbatches[eng.coords.dp]  # type: ignore[no-any-return]


def layer_traffic(lengths: list[int]) -> dict[str, Any]:
    """One layer's forward + backward over a packed micro-batch of ``lengths`` (fp32, CPU):
    the bytes the backward's ops write, the op outputs with two dimensions >= the longest
    sequence, and the K/V head copies (``repeat_interleave`` calls)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainctl.api.models import LossConfig
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    cfg = {"model": LAYER, "precision": "fp32", "max_tokens_per_microbatch": sum(lengths)}
    eng = EngineShard(EngineConfig.from_dict(cfg))
    mbs = _plan(eng, lengths)
    assert len(mbs) == 1
    longest = max(lengths)
    seen: dict[str, Any] = {"backward_bytes": 0, "big": [], "copies": 0}

    class Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            out = func(*args, **(kw or {}))
            outs = out if isinstance(out, tuple | list) else [out]
            for t in outs:
                if not isinstance(t, torch.Tensor):
                    continue
                if torch._C._current_graph_task_id() != -1:  # inside backward
                    seen["backward_bytes"] += t.numel() * t.element_size()
                if sum(d >= longest for d in t.shape) >= 2:
                    seen["big"].append((str(func), tuple(t.shape)))
            return out

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            if getattr(func, "__name__", "") == "repeat_interleave":
                seen["copies"] += 1
            return func(*args, **(kw or {}))

    eng.train_pass(mbs, LossConfig())  # warm: lazily made state stays out of the count
    eng.optim.zero_grad()
    with Copies(), Bytes():
        eng.train_pass(mbs, LossConfig())
    eng.close()
    return {**seen, "tokens": sum(lengths)}


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextmanager
def _host_reads(into: list[str]) -> Iterator[None]:
    """Record every read of a tensor's value by the host (``.item()``, ``.tolist()``, ``int(t)``,
    ``if t``, ``.cpu()``, ...) made inside the block, with where it came from."""
    import traceback

    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            if getattr(func, "__name__", "") in HOST_READS:
                frame = traceback.extract_stack(limit=3)[0]
                into.append(f"{func.__name__} at {frame.filename}:{frame.lineno}")
            return func(*args, **(kw or {}))

    with Reads():
        yield


def host_reads_in_step(cfg: dict[str, Any], lengths: list[int]) -> list[str]:
    """The host reads of tensors inside megatron's forward/backward schedule of one train pass
    (the model, attention, the head and the loss, every micro-batch)."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.engine import schedule
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    eng = EngineShard(EngineConfig.from_dict(cfg))
    mbs = _plan(eng, lengths)
    reads: list[str] = []
    real = schedule.get_forward_backward_func

    def counted() -> Any:
        fn = real()

        def run(**kw: Any) -> Any:
            with _host_reads(reads):
                return fn(**kw)

        return run

    schedule.get_forward_backward_func = counted  # type: ignore[assignment]
    try:
        eng.train_pass(mbs, LossConfig())
    finally:
        schedule.get_forward_backward_func = real  # type: ignore[assignment]
        eng.close()
    return reads


def norm_ops(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ops dispatched by ``grad_norm`` once its plan is built, and its value against the fp64
    norm of the full gradient (every rank's shards, merged by the caller)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainctl.api.models import LossConfig
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    from helpers.batches import numpy_shards

    eng = EngineShard(EngineConfig.from_dict(cfg))
    eng.train_pass(_plan(eng, [40, 17, 64]), LossConfig())
    eng.optim.grad_norm()  # builds the plan
    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            ops.append(str(func))
            return func(*args, **(kw or {}))

    with Count():
        norm = eng.optim.grad_norm()
    out = {
        "ops": ops,
        "norm": float(norm),
        "coords": {"tp": eng.coords.tp, "pp": eng.coords.pp, "dp": eng.coords.dp},
        "grads": numpy_shards(eng.canonical_shards(grads=True, owned=True)),
        "parameters": eng.num_parameters(),
    }
    eng.close()
    return out


def params_after_steps(cfg: dict[str, Any], steps: int, foreach: bool) -> dict[str, Any]:
    """The parameters after ``steps`` train steps (clipping on), with the engine's fused AdamW
    or, ``foreach``, with torch's foreach AdamW as megatron builds it without TE or apex."""
    from trainctl.api.models import LossConfig
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.optim_phase import inner_optimizers
    from trainctl.workers.engine.shard import EngineShard

    from helpers.batches import numpy_shards, ragged_batch, to_host

    eng = EngineShard(EngineConfig.from_dict(cfg))
    if foreach:
        for o in inner_optimizers(eng.optim.optimizer):
            for g in o.optimizer.param_groups:
                g["fused"], g["foreach"] = False, True
    from trainctl.workers.control.plan import plan_step

    norms = []
    for i in range(steps):
        plan = plan_step(to_host(ragged_batch(i)), eng.cfg, loss=LossConfig(), packing="flat")
        report = eng.train_batch(plan.microbatches[eng.coords.dp], LossConfig())
        norms.append(report.grad_norm)
    fused = [
        g["fused"] for o in inner_optimizers(eng.optim.optimizer) for g in o.optimizer.param_groups
    ]
    out = {
        "coords": {"tp": eng.coords.tp, "pp": eng.coords.pp, "dp": eng.coords.dp},
        "shard_params": numpy_shards(eng.canonical_shards(owned=True)),
        "norms": norms,
        "fused": fused,
    }
    eng.close()
    return out


def grads_with_the_head_gradient(cfg: dict[str, Any], in_forward: bool) -> dict[str, Any]:
    """One PPO train pass (with KL) and its gradients, the head's gradient taken in the
    forward pass (``fused_head_loss``) or, ``in_forward`` False, by the two-pass head."""
    from trainctl.api.models import LossConfig, LossKind
    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine import schedule
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    from helpers.batches import numpy_shards, ragged_batch, to_host

    separable = schedule.gradient_in_forward
    if not in_forward:
        schedule.gradient_in_forward = lambda loss: False  # type: ignore[assignment]
    try:
        eng = EngineShard(EngineConfig.from_dict(cfg))
        loss = LossConfig(kind=LossKind("ppo"), kl_coef=0.05)
        plan = plan_step(to_host(ragged_batch(3)), eng.cfg, loss=loss, packing="flat")
        result = eng.train_pass(plan.microbatches[eng.coords.dp], loss)
        out = {
            "coords": {"tp": eng.coords.tp, "pp": eng.coords.pp, "dp": eng.coords.dp},
            "loss": result.loss,
            "metrics": result.metrics,
            "norm": float(eng.optim.grad_norm()),
            "grads": numpy_shards(eng.canonical_shards(grads=True, owned=True)),
        }
        eng.close()
        return out
    finally:
        schedule.gradient_in_forward = separable
