"""The benchmark tables, one module each; ``SECTIONS`` names them in the order
``bench/run.py`` runs them and ``bench/results.md`` lists them."""

from __future__ import annotations

from collections.abc import Callable

from bench.tables import (
    async_rl,
    checkpoint,
    cp_loss,
    fused_head,
    gateway,
    load,
    logprob,
    lora,
    recompute,
    sampler_load,
    sampling,
    sequence_parallel,
    state_bytes,
    step,
    tree,
    wire,
)

SECTIONS: dict[str, Callable[[bool], str]] = {
    "step": step.section,
    "wire": wire.section,
    "gateway": gateway.section,
    "load": load.section,
    "logprob": logprob.section,
    "fused_head": fused_head.section,
    "fused_head_qwen3_5": fused_head.section_qwen3_5,
    "recompute": recompute.section,
    "sequence_parallel": sequence_parallel.section,
    "tree": tree.section,
    "state_bytes": state_bytes.section,
    "cp_loss": cp_loss.section,
    "sampling": sampling.section,
    "lora": lora.section,
    "sampler_load": sampler_load.section,
    "async_rl": async_rl.section,
    "checkpoint": checkpoint.section,
}
