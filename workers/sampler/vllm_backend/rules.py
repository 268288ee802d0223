"""What vLLM 0.32 can run, and the environment its process needs: each refusal was measured
(docs/sampling.md), and would otherwise fail inside vLLM's own start-up. Imports no vLLM."""

from __future__ import annotations

from trainctl.workers.sampler.backend import SamplerNeeds, UnsupportedError

_GPUS = "give the samplers GPUs (--sampler-num-gpus)"


def check(needs: SamplerNeeds) -> None:
    """``UnsupportedError`` naming the setting, for what these engines cannot do."""
    cpu = not needs.gpus
    if needs.lora and needs.moe and cpu:
        raise UnsupportedError(
            "samplers: vLLM's CPU build has no LoRA for mixture-of-experts models (its "
            f"fused-MoE LoRA kernels need Triton on a GPU): {_GPUS}, or start without "
            "--samplers or --max-adapters"
        )
    if cpu and needs.linear_attention:
        raise UnsupportedError(
            "samplers: vLLM's CPU build cannot load Qwen3.5 (its Qwen3_5ForCausalLM module "
            f"imports the Qwen3-VL vision code, which needs torchvision): {_GPUS}, or start "
            "without --samplers"
        )
    if needs.routes and not needs.moe:
        raise UnsupportedError(
            "sampler_routes: routes are captured for mixture-of-experts models; this is dense"
        )
    if needs.routes and cpu:
        raise UnsupportedError(
            "sampler_routes: vLLM captures routes only in its Model Runner V2, which needs "
            f"Triton, and its CPU build has none: {_GPUS}, or start without --sampler-routes"
        )


def env(cuda: bool, threads: int, routes: bool = False) -> dict[str, str]:
    """The environment a sampler's process needs before vLLM is imported (``routes``: the
    engine captures routed experts, which vLLM does only in its Model Runner V2)."""
    out = {
        # The engine core runs in this process: no spawned engine process to guard or reap.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # The functions sent by collective_rpc are ours, in this process.
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    if routes:
        out["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if not cuda:
        out |= {
            "VLLM_TARGET_DEVICE": "cpu",
            # Ranks share these cores: never pin this engine's threads to them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
        }
    return out


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as ``max_lora_rank``."""


def vllm_max_lora_rank(max_rank: int) -> int:
    """The smallest rank vLLM accepts as its limit that holds every adapter of ``max_rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= max_rank:
            return r
    raise ValueError(f"lora max rank {max_rank} exceeds vLLM's largest, {VLLM_LORA_RANKS[-1]}")
