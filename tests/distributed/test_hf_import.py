"""Checkpoints written by transformers (tiny, random) load as the starting model: the engine's
log-probs equal transformers' own, so names, the fused QKV and gate/up layouts, RoPE (and its
Llama 3 scaling), q/k/v biases, q/k norms and the norm epsilon all map correctly. The exporter
writes back the family's own names and the same values, bit for bit."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from hf_cases import logprobs_from_hf
from rankpool import RankPool


def test_llama_checkpoint_imports_exactly(pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    model = _tiny("llama", tmp_path)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 256, n).tolist() for n in (17, 5, 40)]
    results = pools(2).run(logprobs_from_hf, str(tmp_path), {"tp": 2}, batch)
    got, model_cfg = results[0]
    assert model_cfg["norm_eps"] == 1e-6 and model_cfg["rotary_base"] == 50000
    with torch.no_grad():
        for i, tokens in enumerate(batch):
            ids = torch.tensor([tokens])
            logits = model(ids).logits[0, :-1].double()
            ref = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
            assert got[i][0] == 0.0
            np.testing.assert_allclose(got[i][1:], ref, rtol=1e-4, atol=1e-4)


_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**_SHAPE, rope_theta=50000.0),
    # Llama 3.1-style RoPE scaling with values other than megatron's hard-coded 1 / 4 / 8192,
    # and an original context short enough that every branch of the formula is used.
    "llama3": lambda: transformers.LlamaConfig(
        **_SHAPE,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
            "low_freq_factor": 2.0, "high_freq_factor": 8.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_SHAPE, rope_theta=20000.0),
    "qwen3": lambda: transformers.Qwen3Config(**_SHAPE, head_dim=16, rope_theta=30000.0),
}  # fmt: skip


def _tiny(family: str, directory: Path) -> Any:
    """A tiny random model of ``family`` saved by transformers, with non-trivial norms and
    biases, so that a wrong epsilon, norm or bias mapping shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _reference(model: Any, batch: list[list[int]]) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for tokens in batch:
            ids = torch.tensor([tokens])
            logits = model(ids).logits[0, :-1].double()
            out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].numpy())
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_import_equal_to_transformers(
    pools: Callable[[int], RankPool], tmp_path: Path, family: str
) -> None:
    model = _tiny(family, tmp_path)
    rng = np.random.default_rng(1)
    batch = [rng.integers(0, 256, n).tolist() for n in (17, 5, 40, 96)]
    want = _reference(model, batch)
    for world, layout in ((1, {}), (2, {"tp": 2}), (2, {"pp": 2})):
        results = pools(world).run(logprobs_from_hf, str(tmp_path), layout, batch)
        got, model_cfg = next(r for r in results if r[0])  # the rank that reports them
        assert model_cfg["family"] == ("llama" if family == "llama3" else family)
        for i in range(len(batch)):
            assert got[i][0] == 0.0
            np.testing.assert_allclose(
                got[i][1:], want[i], rtol=1e-5, atol=1e-5, err_msg=f"{layout}"
            )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_writes_the_family_back_bit_for_bit(tmp_path: Path, family: str) -> None:
    from safetensors.torch import load_file

    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ModelConfig

    _tiny(family, tmp_path / "in")
    m = hf.model_config_from_hf(hf.read_config(tmp_path / "in"), ModelConfig())
    m.validate()
    source = load_file(str(tmp_path / "in" / "model.safetensors"))
    hf.save(tmp_path / "out", hf.load(tmp_path / "in", m), m)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == set(source)
    for name, t in source.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    again = hf.model_config_from_hf(hf.read_config(tmp_path / "out"), ModelConfig())
    assert again == m


def test_unsupported_options_are_refused_by_name() -> None:
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ConfigError, ModelConfig

    base = hf.hf_config(ModelConfig())
    cases = {
        "model_type 'gemma2' is not supported": {"model_type": "gemma2"},
        "mlp_bias": {"mlp_bias": True},
        "hidden_act 'gelu'": {"hidden_act": "gelu"},
        "rope_scaling of type 'yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        "num_experts": {"model_type": "qwen2", "num_experts": 8},
        "attention_bias": {"attention_bias": True},
    }
    for words, change in cases.items():
        with pytest.raises(ConfigError, match=re.escape(words)):
            hf.model_config_from_hf({**base, **change}, ModelConfig())


def test_export_mapping_inverts_import() -> None:
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ModelConfig
    from trainctl.workers.engine.weights import init_full

    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    shapes = {
        "embedding.word_embeddings.weight": (512, 64),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (512, 64),
    }
    for layer in range(2):
        p = f"decoder.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (64,),
            p + "pre_mlp_layernorm.weight": (64,),
            p + "self_attention.linear_qkv.weight": (64 + 2 * 2 * 16, 64),
            p + "self_attention.linear_proj.weight": (64, 64),
            p + "mlp.linear_fc1.weight": (2 * 512, 64),
            p + "mlp.linear_fc2.weight": (64, 512),
        }
    names = list(shapes)
    canonical = {n: init_full(n, shapes[n], seed=3, num_layers=2) + 1.0 for n in names}
    back = hf.from_hf(hf.to_hf(canonical, m), m)
    assert set(back) == set(canonical)
    for n in names:
        assert torch.equal(back[n], canonical[n]), n
