"""One sampler engine: vLLM hosted in this process, fed weights as Hugging Face-named tensors.

The engine is built from the model's ``config.json`` alone, with placeholder weights
(``load_format="dummy"``); its real weights arrive through ``load_weights``, from memory,
through vLLM's own loading path (its worker's ``reload_weights``, reached with
``collective_rpc``): each tensor goes through the model's ``load_weights`` and whatever
processing the platform applies after loading. No file of weights is written or read.

One call runs at a time (the Ray actor has ``max_concurrency=1``), so a weight load always
falls between two sample calls: a result is produced by one step's weights, and says which.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainctl.api import (
    Completion,
    ConflictError,
    NotReadyError,
    PromptSamples,
    SampleRequest,
    SampleResult,
)
from trainctl.workers.sampler.spec import SamplerSpec


def engine_env(cuda: bool, threads: int) -> dict[str, str]:
    """The environment a sampler's process needs before vLLM is imported."""
    env = {
        # The engine core runs in this process: no spawned engine process to guard or reap.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # The functions sent by collective_rpc are ours, in this process.
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    if not cuda:
        env |= {
            "VLLM_TARGET_DEVICE": "cpu",
            # Ranks share these cores: never pin this engine's threads to them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
        }
    return env


@dataclass(frozen=True)
class Loaded:
    """A sampler's answer to ``load_weights``."""

    step: int
    seconds: float


def _reload(worker: Any, named: list[tuple[str, Any]]) -> int:
    """Run on vLLM's worker: load HF-named tensors through the model's own loading path."""
    worker.reload_weights(weights_iterator=iter(named))
    _refresh_cpu_embedding_gemms(worker.model_runner.model)
    return len(named)


def _refresh_cpu_embedding_gemms(model: Any) -> None:
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


class VllmSampler:
    """vLLM in this process; ``SamplerActor`` (``pool.py``) is its Ray actor."""

    def __init__(self, index: int, spec: SamplerSpec) -> None:
        import torch

        self.index = index
        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
        self._dir = tempfile.TemporaryDirectory(prefix="trainctl-sampler-")
        config = {**spec.hf_config, "torch_dtype": spec.dtype, "dtype": spec.dtype}
        Path(self._dir.name, "config.json").write_text(json.dumps(config))

        from vllm import LLM

        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if cuda:
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
        self.llm = LLM(
            model=self._dir.name,
            load_format="dummy",  # the weights come from the trainer, never from disk
            skip_tokenizer_init=True,
            dtype=spec.dtype,
            enforce_eager=True,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            seed=spec.seed,
            **kwargs,
        )
        self._warm_up()
        self.build_s = time.perf_counter() - t0
        self.step: int | None = None
        """The optimizer step of the weights loaded (None: placeholders only)."""

    def _warm_up(self) -> None:
        """One short generation, so that the first request does not pay for the engine's
        first-call set-up (seconds on a CPU)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=2, logprobs=0, prompt_logprobs=0, detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], params, use_tqdm=False)

    def pid(self) -> int:
        """This engine's process (``info`` shows it; an operator can find it)."""
        return os.getpid()

    def load_weights(self, step: int, tensors: dict[str, Any]) -> Loaded:
        """Load a step's weights: every tensor of the model, under its HF name."""
        t0 = time.perf_counter()
        named = sorted(tensors.items())
        self.llm.collective_rpc(_reload, args=(named,))
        self.step = step
        return Loaded(step=step, seconds=time.perf_counter() - t0)

    def sample(self, req: SampleRequest) -> SampleResult:
        """Generate from every prompt with the loaded step's weights."""
        if self.step is None:
            raise NotReadyError("the sampler has no weights yet: they arrive with the first sync")
        if req.expected_step is not None and req.expected_step != self.step:
            raise ConflictError(
                f"expected_step: the samplers serve the weights of step {self.step}, not "
                f"{req.expected_step}",
                details={"field": "expected_step", "step": self.step},
            )
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=req.n,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids),
            logprobs=0 if req.logprobs else None,
            prompt_logprobs=0 if req.prompt_logprobs else None,
            detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req.prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return SampleResult(
            samples=[_prompt_samples(o, req) for o in outs],
            step=self.step,
            sampler=self.index,
            seconds=seconds,
        )


def _chosen(entries: Any, tokens: Any) -> list[float | None]:
    """The log-prob of each token actually there, from vLLM's per-position dictionaries."""
    return [
        None if d is None else float(d[t].logprob) for d, t in zip(entries, tokens, strict=True)
    ]


def _prompt_samples(out: Any, req: SampleRequest) -> PromptSamples:
    completions = []
    for c in out.outputs:
        tokens = [int(t) for t in c.token_ids]
        lps = _chosen(c.logprobs, tokens) if req.logprobs else None
        completions.append(
            Completion(
                tokens=tokens,
                logprobs=None if lps is None else [float(x) for x in lps if x is not None],
                finish_reason="stop" if c.finish_reason == "stop" else c.finish_reason or "length",
            )
        )
    prompt_lps = None
    if req.prompt_logprobs:
        prompt_lps = _chosen(out.prompt_logprobs, out.prompt_token_ids)
        prompt_lps[0] = None
    return PromptSamples(completions=completions, prompt_logprobs=prompt_lps)
