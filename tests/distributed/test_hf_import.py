"""Checkpoints written by transformers (tiny, random) load as the starting model: the engine's
log-probs equal transformers' own, so names, the fused QKV and gate/up layouts, RoPE (and its
Llama 3 scaling), q/k/v biases, q/k norms, wider heads, tied embeddings, the router and the
experts (and its top-k normalisation) and the norm epsilon all map correctly. The exporter
writes back the family's own names and the same values, bit for bit; trained a step on a
layout that splits what the family adds, the export gathered from the ranks starts an engine
with the trained model's eval loss."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers.hf_models import FAMILIES, TIED, tiny_model
from helpers.rankpool import RankPool
from hf_cases import eval_from_hf, logprobs_from_hf, trained_export

LAYOUTS = [{}, {"tp": 2}, {"pp": 2}]
# tp2 runs MoE under sequence parallelism, each TP rank routing its own slice of the tokens;
# tp2 x ep2 puts the two experts' halves on the two TP ranks.
MOE_LAYOUTS = [{}, {"tp": 2}, {"pp": 2}, {"dp": 2, "ep": 2}, {"tp": 2, "ep": 2}]


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
    model = tiny_model(family, tmp_path)
    rng = np.random.default_rng(1)
    batch = [rng.integers(0, 256, n).tolist() for n in (17, 5, 40, 96)]
    want = _reference(model, batch)
    for layout in MOE_LAYOUTS if "moe" in family else LAYOUTS:
        world = int(np.prod([layout.get(axis, 1) for axis in ("dp", "cp", "tp", "pp")]))
        results = pools(world).run(logprobs_from_hf, str(tmp_path), layout, batch)
        got = {i: lp for r in results for i, lp in r[0].items()}  # from the ranks reporting
        model_cfg = results[0][1]
        assert model_cfg["family"] == ("llama" if family == "llama3" else family)
        assert model_cfg["tie_embeddings"] == (family in TIED)
        assert sorted(got) == list(range(len(batch)))
        for i in range(len(batch)):
            assert got[i][0] == 0.0
            np.testing.assert_allclose(
                got[i][1:], want[i], rtol=1e-5, atol=1e-5, err_msg=f"{layout}"
            )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_writes_the_family_back_bit_for_bit(tmp_path: Path, family: str) -> None:
    from safetensors.torch import load_file

    from trainctl.workers.engine import hf, hf_read
    from trainctl.workers.engine.config import ModelConfig

    tiny_model(family, tmp_path / "in")
    m = hf.model_config_from_hf(hf.read_config(tmp_path / "in"), ModelConfig())
    m.validate()
    source = load_file(str(tmp_path / "in" / "model.safetensors"))
    hf.save(tmp_path / "out", hf_read.load(tmp_path / "in", m), m)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == set(source)
    for name, t in source.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    again = hf.model_config_from_hf(hf.read_config(tmp_path / "out"), ModelConfig())
    assert again == m


# Tied embeddings split over two stages; wide heads, Gated DeltaNet heads and gated attention
# over two TP ranks; experts over two EP ranks (at tp2 x ep2 with the shared expert over the
# two TP ranks).
EXPORT_LAYOUTS = {
    "llama3": {"dp": 2},
    "qwen2": {"pp": 2},
    "qwen3": {"tp": 2},
    "qwen3_moe": {"dp": 2, "ep": 2},
    "qwen3_5": {"tp": 2},
    "qwen3_5_moe": {"tp": 2, "ep": 2},
}


@pytest.mark.parametrize("family", sorted(EXPORT_LAYOUTS))
def test_a_trained_model_exports_from_its_shards_and_restarts_with_its_eval_loss(
    pools: Callable[[int], RankPool], tmp_path: Path, family: str
) -> None:
    """What ``export_hf`` does on a service of that layout, rank by rank: the trained model's
    owned shards merged into the family's checkpoint (its tensor names and dtypes; a tied model
    has no ``lm_head.weight``), which a one-rank engine starts from with the same eval loss."""
    from safetensors.torch import load_file

    from helpers.batches import sft_batch

    layout = EXPORT_LAYOUTS[family]
    tiny_model(family, tmp_path / "source")
    batch = sft_batch(seed=31, vocab=256)
    world = int(np.prod([layout.get(axis, 1) for axis in ("dp", "tp", "pp")]))
    out = tmp_path / "export"
    results = pools(world).run(trained_export, str(tmp_path / "source"), layout, batch, str(out))
    (trained,) = {(r["before"], r["after"]) for r in results if r["last_stage"]}
    assert trained[1] < trained[0], trained  # the step changed the weights that are exported

    given, written = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "source", out))
    assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in given.items()}
    assert ("lm_head.weight" in written) == (family not in TIED)
    assert any(not torch.equal(written[k], given[k]) for k in given)

    (restarted,) = pools(1).run(eval_from_hf, str(out), batch)
    assert abs(restarted - trained[1]) <= 1e-5 * abs(trained[1]), (restarted, trained)


def test_unsupported_options_are_refused_by_name() -> None:
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ConfigError, ModelConfig

    base = hf.hf_config(ModelConfig())
    moe = hf.hf_config(ModelConfig(family="qwen3_moe", num_experts=4))
    cases = {
        "model_type 'gemma2' is not supported": {"model_type": "gemma2"},
        "mlp_bias": {"mlp_bias": True},
        "hidden_act 'gelu'": {"hidden_act": "gelu"},
        "rope_scaling of type 'yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        "num_experts 8 (mixture of experts: qwen3_moe, qwen3_5_moe)": {
            "model_type": "qwen2", "num_experts": 8,
        },
        "attention_bias True": {"attention_bias": True},
        "use_sliding_window": {"model_type": "qwen2", "use_sliding_window": True},
        "mlp_only_layers": {**moe, "mlp_only_layers": [1]},
        "shared_expert_intermediate_size 64 (shared experts: qwen3_5_moe only)": {
            **moe, "shared_expert_intermediate_size": 64,
        },
    }  # fmt: skip
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


QWEN3_5_VOCAB = 248_320
"""Qwen3.5's vocabulary (its tokenizer's 248,044 tokens, padded)."""


def test_qwen3_5_at_its_full_vocabulary_equals_transformers(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """The LM head at Qwen3.5's real vocabulary, split over two TP ranks (124,160 rows each)
    and streamed in chunks by the fused head: targets from the whole range, the top shard's
    included, give transformers' log-probs."""
    model = tiny_model("qwen3_5", tmp_path, vocab_size=QWEN3_5_VOCAB)
    rng = np.random.default_rng(2)
    batch = [rng.integers(0, QWEN3_5_VOCAB, n).tolist() for n in (33, 64)]
    batch[0][-8:] = range(QWEN3_5_VOCAB - 8, QWEN3_5_VOCAB)  # the last rows of the top shard
    want = _reference(model, batch)
    for layout in ({}, {"tp": 2}):
        results = pools(max(1, layout.get("tp", 1))).run(
            logprobs_from_hf, str(tmp_path), layout, batch
        )
        assert results[0][1]["vocab_size"] == QWEN3_5_VOCAB
        got = {i: lp for r in results for i, lp in r[0].items()}
        assert sorted(got) == [0, 1]
        for i in range(len(batch)):
            np.testing.assert_allclose(
                got[i][1:], want[i], rtol=1e-5, atol=1e-5, err_msg=f"{layout}"
            )
