"""Engine configuration: impossible layouts are rejected with a message saying what to change."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig, ParallelLayout


@pytest.mark.parametrize(
    ("layout", "model", "words"),
    [
        (ParallelLayout(tp=3), ModelConfig(), "divisible by layout.tp (3)"),
        (ParallelLayout(pp=3), ModelConfig(), "num_layers (2) must be divisible"),
        (ParallelLayout(dp=0), ModelConfig(), "layout.dp must be >= 1"),
        (ParallelLayout(vp=2), ModelConfig(num_layers=4), "needs layout.pp > 1"),
        (ParallelLayout(dp=2, ep=4), ModelConfig(), "must divide dp * cp * tp (2)"),
        (ParallelLayout(), ModelConfig(hidden_size=130), "hidden_size (130) must be divisible"),
        (ParallelLayout(), ModelConfig(family="gemma"), "model.family must be one of"),
        (ParallelLayout(), ModelConfig(family="qwen3_moe"), "'qwen3_moe' needs model.num_experts"),
        (ParallelLayout(), ModelConfig(head_dim=-1), "model.head_dim must be >= 0"),
    ],
)
def test_impossible_layouts(layout: ParallelLayout, model: ModelConfig, words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        EngineConfig(layout=layout, model=model).validate()


@pytest.mark.parametrize("field", ["lr", "eps", "weight_decay", "clip_grad"])
def test_an_engine_config_file_with_a_non_finite_optimizer_value_is_refused(field: str) -> None:
    """``--engine-config`` is JSON, which may say Infinity or NaN: an infinite learning rate
    passes ``lr >= 0`` and would make every weight NaN at the first step."""
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=re.escape(f"optimizer.{field} must be a finite")):
            EngineConfig.from_dict({"optimizer": {field: bad}}).validate()


def test_own_head_size_lifts_the_divisibility_rule() -> None:
    m = ModelConfig(hidden_size=130, head_dim=48)
    EngineConfig(model=m).validate()
    assert m.kv_channels == 48 and ModelConfig().kv_channels == 128 // 4


def test_sequence_parallel_follows_tp_and_moe_at_tp2_needs_it() -> None:
    moe = ModelConfig(num_experts=4)
    assert EngineConfig(layout=ParallelLayout(tp=2)).use_sequence_parallel
    assert not EngineConfig(layout=ParallelLayout(dp=2)).use_sequence_parallel
    off = EngineConfig(layout=ParallelLayout(tp=2), sequence_parallel="off").validate()
    assert not off.use_sequence_parallel
    EngineConfig(layout=ParallelLayout(tp=2, ep=2), model=moe).validate()  # ep over TP ranks
    with pytest.raises(ConfigError, match=re.escape("MoE with layout.tp > 1 needs sequence")):
        EngineConfig(layout=ParallelLayout(tp=2), model=moe, sequence_parallel="off").validate()
    with pytest.raises(ConfigError, match=re.escape("'on' needs layout.tp > 1")):
        EngineConfig(sequence_parallel="on").validate()
    with pytest.raises(ConfigError, match="sequence_parallel must be one of"):
        EngineConfig(sequence_parallel="yes").validate()  # type: ignore[arg-type]


def test_budget_must_fit_longest_sequence() -> None:
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch"):
        EngineConfig(max_tokens_per_microbatch=8).validate()


def test_roundtrip_dict() -> None:
    cfg = EngineConfig(layout=ParallelLayout(dp=2, tp=2), model=ModelConfig(seed=7))
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.layout.world_size == 4 and cfg.pad_multiple == 2
    assert EngineConfig(layout=ParallelLayout(cp=2, tp=2)).pad_multiple == 8


def test_sdk_imports_without_server_stack() -> None:
    code = (
        "import sys, trainctl.clients, trainctl.api\n"
        "heavy = [m for m in ('torch', 'ray', 'megatron', 'fastapi') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_models_with_a_hugging_face_form_export() -> None:
    from trainctl.workers.engine.families import export_problem

    assert export_problem("llama", 0) is None and export_problem("qwen3_moe", 8) is None
    problem = export_problem("llama", 4)
    assert problem is not None and "mixture-of-experts model of family 'llama'" in problem
