"""Benchmark cases of LoRA (``bench/tables/lora.py``): the training state a rank holds, full
fine-tuning against adapters, and the cost of switching adapters. One rank, one process."""

from __future__ import annotations

import socket
import time
from typing import Any

MODEL = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 8,
         "ffn_hidden_size": 2048, "vocab_size": 8192, "max_seq_len": 128}  # fmt: skip
"""The model of the ``state_bytes`` table (25M parameters)."""


def _engine(precision: str, adapters: int, rank: int, offload: str = "") -> Any:
    import torch.distributed as dist

    from trainctl.workers.engine.config import EngineConfig, LoraConfig, ModelConfig
    from trainctl.workers.engine.shard import EngineShard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return EngineShard(
        EngineConfig(
            model=ModelConfig(**MODEL),  # type: ignore[arg-type]
            precision=precision,  # type: ignore[arg-type]
            max_tokens_per_microbatch=MODEL["max_seq_len"],
            lora=LoraConfig(
                max_adapters=adapters,
                max_rank=max(rank, 1),
                max_in_memory=1 if offload else 0,
                offload_dir=offload,
            ),
        )
    )


def _step(eng: Any) -> None:
    import numpy as np

    from trainctl.api import TokenSequence
    from trainctl.workers.control.plan import plan_step

    seq = TokenSequence(
        tokens=np.random.default_rng(0).integers(0, 512, 64).astype(np.int64),
        loss_mask=np.ones(64, np.float32),
    )
    plan = plan_step([seq], eng.cfg)
    eng.train_batch(plan.microbatches[0], plan.loss)


def lora_state_case(precision: str, adapters: int, rank: int) -> dict[str, float]:
    """Bytes per base parameter of training state after a step of every adapter (``adapters``
    = 0: full fine-tuning), read off the live tensors (each storage once) and the slots."""
    import torch

    from trainctl.workers.engine.boundary import AdapterSpec

    torch.set_num_threads(1)
    eng = _engine(precision, adapters, rank)
    for i in range(adapters):
        eng.adapters.create(AdapterSpec(name=f"a{i}", rank=rank, alpha=float(rank)))
        eng.adapters.activate(f"a{i}")
        _step(eng)
    if not adapters:
        _step(eng)
    seen: set[int] = set()

    def size(t: Any) -> int:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return int(s.nbytes())

    def tensors(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            return [obj] if obj.dim() > 0 else []
        if isinstance(obj, dict):
            return [t for v in obj.values() for t in tensors(v)]
        if isinstance(obj, list | tuple):
            return [t for v in obj for t in tensors(v)]
        return []

    params = sum(size(p) for c in eng.chunks for p in c.module.parameters())
    grads = sum(
        size(p.main_grad) for c in eng.chunks for p in c.module.parameters() if p.requires_grad
    )
    masters = sum(size(p) for g in eng.optim.optimizer.param_groups for p in g["params"])
    adam = sum(
        size(t)
        for o in getattr(eng.optim.optimizer, "chained_optimizers", [eng.optim.optimizer])
        for st in o.optimizer.state.values()
        for t in tensors(st)
    )
    slots = 0
    bank = eng.adapters.bank
    if bank is not None:
        bank.state()  # the active adapter stashed too: every slot complete
        slots = sum(size(t) for s in bank.slots.values() for t in tensors(s.tensors))
        slots += sum(size(t) for s in bank.slots.values() for t in tensors(s.optimizer))
    base = sum(p.numel() for n, p in eng._parameters() if not n.endswith((".lora_a", ".lora_b")))
    return {
        "base_parameters": float(base),
        "params": params / base,
        "grads": grads / base,
        "masters": masters / base,
        "adam": adam / base,
        "slots": slots / base,
    }


def lora_switch_case(
    precision: str, rank: int, repeats: int, disk: bool = False
) -> dict[str, float]:
    """Seconds to switch to another trained adapter (stash the active one, load the other),
    and to call the active one again (no switch), median of ``repeats``. ``disk``: three
    adapters with one idle in host memory, so every switch reads one from disk and writes
    another there."""
    import statistics
    import tempfile

    import torch

    from trainctl.workers.engine.boundary import AdapterSpec

    torch.set_num_threads(1)
    names = ("a", "b", "c") if disk else ("a", "b")
    eng = _engine(precision, len(names), rank, tempfile.mkdtemp() if disk else "")
    for name in names:
        eng.adapters.create(AdapterSpec(name=name, rank=rank, alpha=float(rank)))
        eng.adapters.activate(name)
        _step(eng)
    switch, same = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        eng.adapters.activate(names[i % len(names)])
        switch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.adapters.activate(names[i % len(names)])
        same.append(time.perf_counter() - t0)
    bank = eng.adapters
    per_adapter = sum(s.nbytes for s in bank.slots.values()) / len(bank.slots)
    return {
        "switch_ms": 1e3 * statistics.median(switch),
        "same_ms": 1e3 * statistics.median(same),
        "adapter_mb": per_adapter / 2**20,
    }
