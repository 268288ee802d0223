"""One vLLM sampler engine in a process of its own (``VllmSampler``, no Ray, no service): the
cases of ``test_engine.py``, importable by a spawned process."""

from __future__ import annotations

import os
from typing import Any

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def _hf_weights(seed: int) -> dict[str, Any]:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def jam_then_refused_load() -> dict[str, Any]:
    """A request that raises inside vLLM's step (a seed of 2^64, past the gateway's check),
    then a weight set with one tensor of the wrong shape: what each answered, and whether the
    engine still samples what it sampled before."""
    from trainctl.workers.sampler.engine import engine_env

    os.environ.update(engine_env(False, 1))
    from trainctl.api import SampleRequest, TrainctlError
    from trainctl.workers.sampler.engine import VllmSampler
    from trainctl.workers.sampler.spec import SamplerSpec

    engine = VllmSampler(0, SamplerSpec(hf_config=CONFIG, max_model_len=256, max_num_seqs=8))
    weights = _hf_weights(0)
    engine.load_weights(1, weights)
    ok = SampleRequest(prompts=[[1, 2, 3], [4, 5]], n=2, max_tokens=5, seed=5)
    ref = engine.sample(ok).samples
    out: dict[str, Any] = {}
    bad = SampleRequest.model_construct(**{**ok.model_dump(), "seed": 2**64})
    try:
        engine.sample(bad)
        out["bad_seed"] = "answered"
    except TrainctlError as e:
        out["bad_seed"] = (e.status, e.message)
    out["after_bad_seed"] = engine.sample(ok).samples == ref
    wrong = dict(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    wrong[name] = wrong[name][:, :-1].clone()
    try:
        engine.load_weights(2, wrong)
        out["wrong_shape"] = "loaded"
    except TrainctlError as e:
        out["wrong_shape"] = (e.status, e.message)
    out["step_after_refusal"] = engine.step
    out["after_refusal"] = engine.sample(ok).samples == ref
    changed = _hf_weights(1)
    engine.load_weights(3, changed)
    out["after_a_good_load"] = engine.sample(ok).samples != ref
    return out
