"""What a sampler engine is built from: torch-free, so that the controller can make one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SAMPLER_NODE_RESOURCE = "trainctl_sampler"
"""A Ray resource that marks nodes kept for sampler engines (the Helm chart's sampler worker
group advertises one per pod): ranks are never placed there, and where such nodes exist, each
engine takes one."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A directory with any of these holds a tokenizer transformers can load."""


def tokenizer_of(model_dir: str) -> str | None:
    """``model_dir`` if it holds the model's tokenizer (an --init-hf directory), else None."""
    if model_dir and any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return model_dir
    return None


@dataclass(frozen=True)
class SamplerSpec:
    """How to build a sampler engine (the same for every replica)."""

    hf_config: dict[str, Any]
    """The model's Hugging Face ``config.json`` (the same mapping as ``export_hf``)."""
    backend: str = "vllm"
    """The engine's backend (``backend.BACKENDS``; ``--sampler-backend``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's weights and activations: 'float32' (exact log-probs) or 'bfloat16'."""
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    """KV cache of a CPU engine, GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    gpu_memory_utilization: float = 0.5
    """Share of a GPU's memory a GPU engine may take (it shares the node with ranks)."""
    max_num_seqs: int = 64
    """Sequences one engine step batches."""
    seed: int = 0
    max_adapters: int = 0
    """LoRA adapters an engine keeps loaded (the service's ``--max-adapters``); 0: no LoRA."""
    max_lora_rank: int = 0
    """The largest adapter rank (``--lora-max-rank``)."""
    versions: int = 2
    """Versions of each adapter an engine may hold at once (``--sampler-versions``)."""
    return_routes: bool = False
    """Capture the experts each token is routed to (``--sampler-routes``; GPU engines)."""
    concurrency: int = 64
    """Requests of one version an engine runs at once (``--sampler-concurrency``)."""
    in_flight: bool = False
    """A weight load does not wait for the requests for the newest weights that an engine is
    running: they go on with the loaded weights, their prefixes recomputed
    (``--sampler-sync in_flight``)."""
    weight_transfer: str | None = None
    """vLLM's weight-transfer backend the engine is built with (``gloo``: the collective
    transport, ``vllm_backend/gloo_engine.py``); None: weights arrive as shipments alone."""
    tokenizer: str | None = None
    """The directory of the model's tokenizer (``tokenizer_of``): string stops work. None:
    the engine runs on token ids alone."""


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter as vLLM's LoRA loader reads it: PEFT's ``adapter_config.json`` and the
    tensors of ``adapter_model.safetensors`` (what ``export_hf(adapter=...)`` writes)."""

    config: dict[str, Any]
    tensors: dict[str, Any]
