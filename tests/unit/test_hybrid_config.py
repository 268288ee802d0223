"""A hybrid model's configuration (Qwen3.5: Gated DeltaNet and full attention): what it takes,
and what it refuses, naming the field, before any rank is built."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainctl.api import TokenSequence
from trainctl.workers.control.plan import plan_step
from trainctl.workers.engine import hf
from trainctl.workers.engine.config import (
    ConfigError,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelLayout,
)

HYBRID = ModelConfig(
    family="qwen3_5", num_layers=4, head_dim=16, rotary_percent=0.25,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8,
)  # fmt: skip


def _engine(model: ModelConfig = HYBRID, **kw: object) -> EngineConfig:
    return EngineConfig(model=model, max_tokens_per_microbatch=2048, **kw)  # type: ignore[arg-type]


def test_a_hybrid_model_packs_flat_by_default_and_refuses_tries() -> None:
    cfg = _engine().validate()
    assert cfg.model.linear_layers == (0, 1, 2)
    assert cfg.default_packing == "flat"
    assert _engine(model=ModelConfig()).validate().default_packing == "tree"
    with pytest.raises(ConfigError, match=r"packing 'tree' cannot pack .* Gated DeltaNet"):
        _engine(packing="tree").validate()
    seqs = [TokenSequence(np.arange(8)), TokenSequence(np.arange(6))]
    assert len(plan_step(seqs, cfg).microbatches) == 1
    with pytest.raises(ValueError, match=r"^packing: packing 'tree' cannot pack"):
        plan_step(seqs, cfg, packing="tree")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"layer_types": ("linear_attention",) * 3}, "model.layer_types has 3 entries for 4"),
        ({"layer_types": ("mamba",) * 4}, "model.layer_types: each one of"),
        ({"family": "qwen3"}, "family 'qwen3' has no linear attention"),
        ({"linear_key_head_dim": 0}, "model.linear_key_head_dim must be positive"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ],
)
def test_bad_hybrid_shapes_are_refused_by_field(change: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        dataclasses.replace(HYBRID, **change).validate()


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ({"cp": 2}, r"layout.cp > 1: Gated DeltaNet .* no context parallelism"),
        ({"tp": 4}, r"model.linear_num_key_heads \(2\) must be divisible by layout.tp \(4\)"),
    ],
)
def test_layouts_the_linear_layers_cannot_take_are_refused(layout: dict, words: str) -> None:
    wide = dataclasses.replace(HYBRID, num_attention_heads=8, num_query_groups=4)
    with pytest.raises(ConfigError, match=words):
        ParallelLayout(**layout).validate(wide)


def test_the_hybrid_config_round_trips_and_refuses_what_it_cannot_build() -> None:
    config = hf.hf_config(HYBRID)
    assert config["model_type"] == "qwen3_5_text" and config["partial_rotary_factor"] == 0.25
    assert hf.model_config_from_hf(config, ModelConfig()) == HYBRID
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        hf.model_config_from_hf({**config, "mtp_num_hidden_layers": 1}, ModelConfig())
    qwen3 = hf.hf_config(ModelConfig(family="qwen3"))
    with pytest.raises(ConfigError, match=r"partial_rotary_factor 0.5 \(qwen3_5 only\)"):
        hf.model_config_from_hf({**qwen3, "partial_rotary_factor": 0.5}, ModelConfig())


def test_what_is_not_built_yet_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match=r"lora.max_adapters: LoRA on a model with Gated"):
        _engine(lora=LoraConfig(max_adapters=2)).validate()
    config = hf.hf_config(HYBRID)
    with pytest.raises(ConfigError, match=r"'qwen3_5_moe'.*vision-language.*qwen3_5_moe_text"):
        hf.model_config_from_hf({**config, "model_type": "qwen3_5_moe"}, ModelConfig())
    with pytest.raises(ConfigError, match=r"'qwen3_5'.*vision-language.*qwen3_5_text"):
        hf.model_config_from_hf({**config, "model_type": "qwen3_5"}, ModelConfig())
    moe = {**config, "model_type": "qwen3_5_moe_text", "num_experts": 4,
           "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80}  # fmt: skip
    got = hf.model_config_from_hf(moe, ModelConfig())
    assert (got.family, got.moe_shared_ffn_hidden_size, got.moe_norm_topk) == (
        "qwen3_5_moe",
        80,
        True,
    )
    assert hf.model_config_from_hf(hf.hf_config(got), ModelConfig()) == got
    with pytest.raises(ConfigError, match=r"shared_expert_intermediate_size \(a qwen3_5_moe "):
        hf.model_config_from_hf({**moe, "shared_expert_intermediate_size": 0}, ModelConfig())
