"""vLLM as a sampler backend (``--sampler-backend vllm``): ``engine.py`` hosts it in the
engine's process, ``sampler.py`` serves it as the asynchronous ``SamplerEngine``,
``outputs.py`` reads its outputs, ``rules.py`` says what it can run and with which
environment, ``lora_guard.py`` mends its CPU LoRA ops. ``gloo_engine.py`` and
``nccl_engine.py`` are the engines' ends of the collective over vLLM's weight-sync API (our
``gloo`` backend; vLLM's ``nccl`` one, keeping what it received), ``nccl_sender.py`` trainer
rank 0's end of the ``nccl`` one. vLLM is imported here and nowhere else (an import-linter
contract)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from trainctl.workers.sampler.vllm_backend.rules import check, env

if TYPE_CHECKING:
    from trainctl.workers.sampler.backend import SamplerEngine

__all__ = ["check", "engine_class", "env", "missing"]


def engine_class() -> type[SamplerEngine]:
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    return VllmSampler


def missing() -> str | None:
    """Whether vLLM is installed here (looked up, not imported: it takes seconds)."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        "needs vLLM, which is not installed: pip install 'trainctl[sampler]' (from a "
        "checkout: scripts/serve --samplers N installs it)"
    )
