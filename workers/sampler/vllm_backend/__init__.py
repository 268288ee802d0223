"""vLLM as a sampler backend (``--sampler-backend vllm``): ``engine.py`` hosts it in the
engine's process, ``sampler.py`` serves it as the asynchronous ``SamplerEngine``,
``outputs.py`` reads its outputs, ``rules.py`` says what it can run and with which
environment, ``lora_guard.py`` mends its CPU LoRA ops. vLLM is imported here and nowhere else (an
import-linter contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainctl.workers.sampler.vllm_backend.rules import check, env

if TYPE_CHECKING:
    from trainctl.workers.sampler.backend import SamplerEngine

__all__ = ["check", "engine_class", "env"]


def engine_class() -> type[SamplerEngine]:
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    return VllmSampler
