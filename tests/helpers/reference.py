"""Single-process reference computations, independent of trainctl's packing and kernels.

Run as a script (a fresh process, world size 1): reads a JSON batch on stdin, builds the same
seed model as the service, and prints the global token-mean cross-entropy computed one
sequence at a time with ``F.cross_entropy`` in float64 on the full-vocabulary logits.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any


def reference_loss(batch: list[dict[str, Any]], engine_cfg: dict[str, Any] | None = None) -> float:
    import torch
    import torch.nn.functional as F

    from trainctl.workers.engine import megatron_cpu

    model = _single_rank_model(engine_cfg)
    total, count = 0.0, 0
    with torch.no_grad(), megatron_cpu.cuda_to_cpu():
        for seq in batch:
            ids = torch.tensor(seq["tokens"], dtype=torch.long)
            mask = torch.tensor(seq.get("loss_mask") or [1] * len(ids), dtype=torch.float64)
            weights = torch.tensor(seq.get("weights") or [1.0] * len(ids), dtype=torch.float64)
            logits = _full_logits(model, ids)
            nll = F.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")
            total += float((nll * mask[1:] * weights[1:]).sum())
            count += int(mask[1:].count_nonzero())
    return total / count


def reference_logprobs(
    batch: list[dict[str, Any]], engine_cfg: dict[str, Any] | None = None
) -> list[list[float]]:
    """Per-token log p(token | prefix), one sequence at a time, float64 log-softmax over the
    full vocabulary; position 0 holds 0.0 (the service's convention)."""
    import torch
    import torch.nn.functional as F

    from trainctl.workers.engine import megatron_cpu

    model = _single_rank_model(engine_cfg)
    out = []
    with torch.no_grad(), megatron_cpu.cuda_to_cpu():
        for seq in batch:
            ids = torch.tensor(seq["tokens"], dtype=torch.long)
            logits = _full_logits(model, ids)
            lp = F.log_softmax(logits[:-1].double(), -1).gather(1, ids[1:, None])[:, 0]
            out.append([0.0, *lp.tolist()])
    return out


def _single_rank_engine(engine_cfg: dict[str, Any] | None) -> Any:
    """trainctl's engine on a world of one (gloo, initialised here once per process)."""
    import torch.distributed as dist

    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.engine.shard import EngineShard

    if not dist.is_initialized():
        # A world of one needs no rendezvous: an in-process store, no port to race for.
        from torch._C._distributed_c10d import HashStore

        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    return EngineShard(EngineConfig.from_dict(engine_cfg or {}))


def _single_rank_model(engine_cfg: dict[str, Any] | None) -> Any:
    return _single_rank_engine(engine_cfg).chunks[0].module.eval()


def _full_logits(model: Any, ids: Any) -> Any:
    """All logits ``[t, V]`` of one sequence: the model ends at its final norm, the output
    layer is applied here in one plain matmul."""
    from trainctl.workers.engine.model import lm_head_weight

    hidden = model(ids[None], ids.new_tensor(range(len(ids)))[None], attention_mask=None)[0]
    return hidden @ lm_head_weight(model).t()


def reference_step(batch: list[dict[str, Any]], engine_cfg: dict[str, Any]) -> dict[str, float]:
    """eval, one train step and eval again on a single rank, through trainctl's engine."""
    from trainctl.workers.control.plan import plan_step

    eng = _single_rank_engine(engine_cfg)
    cfg = eng.cfg
    from trainctl.api import TrainBatchRequest

    req = TrainBatchRequest(sequences=batch)
    plan = plan_step(list(req.sequences), cfg, packing="flat")  # the reference packs flat
    mbs = plan.microbatches[0]
    before = eng.eval_batch(mbs, plan.loss).loss
    step = eng.train_batch(mbs, plan.loss)
    after = eng.eval_batch(mbs, plan.loss).loss
    return {
        "eval_before": before,
        "loss": step.loss,
        "grad_norm": float(step.grad_norm or 0),
        "eval_after": after,
    }


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = json.load(sys.stdin)
    if payload.get("mode") == "step":
        print(json.dumps(reference_step(payload["sequences"], payload["engine"])))
    elif payload.get("mode") == "logprobs":
        print(json.dumps(reference_logprobs(payload["sequences"], payload.get("engine"))))
    else:
        print(json.dumps({"loss": reference_loss(payload["sequences"], payload.get("engine"))}))
