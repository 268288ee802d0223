"""A Llama checkpoint written by transformers (tiny, random) loads as the starting model: the
engine's log-probs at tp=2 equal transformers' own, so names, the fused QKV and gate/up
layouts, RoPE and the norm epsilon all map correctly. The exporter's inverse is checked too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from hf_cases import logprobs_from_hf
from rankpool import RankPool


def _tiny_llama(directory: Path) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a wrong epsilon or norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def test_llama_checkpoint_imports_exactly(pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    model = _tiny_llama(tmp_path)
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
