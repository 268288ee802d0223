"""A weight load as it runs inside vLLM's worker (``collective_rpc``): the shipment opened
there, its tensors checked against the weights served, then loaded through the model's own
loading path."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainctl.workers.sampler.transport import (
    Schema,
    Shipment,
    open_shipment,
    schema_mismatch,
    schema_of,
)


@dataclass(frozen=True)
class Reloaded:
    schema: Schema
    problem: str | None
    """Why the weights were refused (nothing was copied), or None."""
    empty: list[str]
    """The parameters left without data (on the meta device): vLLM's reload moves them
    there first, and one it could not fill stays there - a load that "succeeded" broken."""
    opened_s: float = 0.0
    """Seconds the shipment took to open (its tensors fetched), before the load."""


def reload(worker: Any, shipment: Shipment, want: Schema | None) -> Reloaded:
    """Run on vLLM's worker: open the shipment, check its tensors against ``want`` (the
    schema served), and load them through the model's own loading path."""
    plan = getattr(shipment.handle, "plan", None)  # a streamed one: refused before fetching
    if want is not None and plan is not None and (problem := schema_mismatch(plan.schema, want)):
        return Reloaded(plan.schema, problem, [])
    t0 = time.perf_counter()
    tensors = open_shipment(shipment)
    opened_s = time.perf_counter() - t0
    schema = schema_of(tensors)
    if want is not None and (problem := schema_mismatch(schema, want)):
        return Reloaded(schema, problem, [], opened_s)
    return Reloaded(schema, None, reload_tensors(worker, tensors), opened_s)


def reload_tensors(worker: Any, tensors: dict[str, Any]) -> list[str]:
    """Load HF-named ``tensors`` in place through vLLM's worker (the model's own loading
    path), then prepare the CPU's embedding kernels again; the parameters left empty."""
    worker.reload_weights(weights_iterator=iter(sorted(tensors.items())))
    model = worker.model_runner.model
    refresh_cpu_embedding_gemms(model)
    return empty_parameters(model)


def empty_parameters(model: Any) -> list[str]:
    """The parameters without data (on the meta device): vLLM's in-place reload moves them
    there first, and one it could not fill stays there."""
    return [n for n, p in model.named_parameters() if p.is_meta]


def refresh_cpu_embedding_gemms(model: Any) -> None:
    """vLLM 0.32 on a CPU: an in-place reload leaves a *tied* LM head (the input embedding
    used as the output layer: Qwen2.5/Qwen3 small models) computing logits with a GEMM
    kernel prepared from the weights it had before (measured: log-probs off by 0.3 after a
    reload, exact after this). Embedding layers keep their weights, so their kernels can be
    prepared again from the loaded ones; that is all this does."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def reload_kept(worker: Any, version: str) -> bool:
    """Run on vLLM's worker: load a version its weight-transfer engine kept in host memory
    (``gloo_engine.py``'s or ``nccl_engine.py``'s ``kept``: what it received), the same
    in-place reload as a received one; False if it keeps no such version."""
    weights = getattr(worker.weight_transfer_engine, "kept", {}).get(version)
    if weights is None:
        return False
    if empty := reload_tensors(worker, weights):
        raise RuntimeError(f"weights left empty after the reload: {empty[:3]}")
    return True
