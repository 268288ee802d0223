"""Hugging Face Llama-format weights: export for inference engines, import as a start.

The served model is Llama-shaped (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases,
untied output), so its canonical parameters (``workers/engine/weights.py``) map one to one onto a
``LlamaForCausalLM`` checkpoint (``config.json`` + ``model.safetensors``), except two fused
megatron tensors:

    linear_qkv   rows grouped by key/value head g: [q heads of g; k_g; v_g]  <->  q/k/v_proj
    linear_fc1   [gate; up]                                                  <->  gate/up_proj

Qwen2-style checkpoints load too when they have no attention biases (Qwen2 has them; we do not
support biases and say so). MoE models cannot be exported in this format.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` equal to ``m``."""
    if m.num_experts:
        raise ConfigError("MoE models cannot be exported as Llama checkpoints")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.hidden_size // m.num_attention_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": float(m.rotary_base),
        "rope_parameters": {"rope_theta": float(m.rotary_base), "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def model_config_from_hf(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The ``ModelConfig`` of a Llama/Qwen2-style ``config.json``; unsupported features fail
    with a message naming them."""
    kind = cfg.get("model_type", "?")
    if kind not in ("llama", "qwen2", "mistral"):
        raise ConfigError(f"{CONFIG}: model_type {kind!r} is not a Llama-style decoder")
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("attention_bias") or kind == "qwen2":
        problems.append("attention biases (q/k/v bias)")
    if cfg.get("mlp_bias"):
        problems.append("MLP biases")
    # transformers < 5 writes rope_theta / rope_scaling; 5 writes rope_parameters.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    if scaling:
        problems.append(f"RoPE scaling {scaling!r}")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        problems.append(f"head_dim {head_dim} x {heads} heads != hidden_size")
    if problems:
        raise ConfigError(f"{CONFIG}: not supported: " + "; ".join(problems))
    return dataclasses.replace(
        base,
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        vocab_size=int(cfg["vocab_size"]),
        max_seq_len=min(int(cfg.get("max_position_embeddings", base.max_seq_len)), 1 << 20),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=int(float(theta)),
        num_experts=0,
    )


def _qkv_split(m: ModelConfig) -> tuple[int, int, int]:
    d = m.hidden_size // m.num_attention_heads
    per_group = m.num_attention_heads // m.num_query_groups
    return per_group * d, d, m.num_query_groups


def to_hf(canonical: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Full canonical tensors -> Llama tensor names."""
    q_rows, d, groups = _qkv_split(m)
    out: dict[str, Tensor] = {}
    for name, t in canonical.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        layer, rest = _layer(name)
        prefix = f"model.layers.{layer}."
        if rest in _PER_LAYER:
            out[prefix + _PER_LAYER[rest]] = t
        elif rest == "self_attention.linear_qkv.weight":
            g = t.reshape(groups, q_rows + 2 * d, -1)
            out[prefix + "self_attn.q_proj.weight"] = g[:, :q_rows].reshape(-1, t.shape[-1])
            out[prefix + "self_attn.k_proj.weight"] = g[:, q_rows : q_rows + d].reshape(
                -1, t.shape[-1]
            )
            out[prefix + "self_attn.v_proj.weight"] = g[:, q_rows + d :].reshape(-1, t.shape[-1])
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate
            out[prefix + "mlp.up_proj.weight"] = up
        else:
            raise ValueError(f"{name}: no Llama counterpart")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Llama tensor names -> full canonical tensors (inverse of ``to_hf``)."""
    q_rows, d, groups = _qkv_split(m)
    out = {name: hf[key] for name, key in _TOP.items() if key in hf}
    if "output_layer.weight" not in out:  # tied embeddings: the output starts as a copy
        out["output_layer.weight"] = hf["model.embed_tokens.weight"].clone()
    for layer in range(m.num_layers):
        p, c = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for ours, theirs in _PER_LAYER.items():
            out[c + ours] = hf[p + theirs]
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        h = q.shape[-1]
        fused = torch.cat(
            [q.reshape(groups, q_rows, h), k.reshape(groups, d, h), v.reshape(groups, d, h)], 1
        )
        out[c + "self_attention.linear_qkv.weight"] = fused.reshape(-1, h)
        out[c + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
    return out


def _layer(name: str) -> tuple[int, str]:
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"{name}: not a per-layer parameter")
    return int(m.group(1)), m.group(2)


def save(directory: Path, canonical: dict[str, Tensor], m: ModelConfig) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(hf_config(m), indent=2))
    save_file(to_hf(canonical, m), str(directory / WEIGHTS), metadata={"format": "pt"})
    return [directory / CONFIG, directory / WEIGHTS]


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a Hugging Face checkpoint directory has one)")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def load(directory: Path, m: ModelConfig) -> dict[str, Tensor]:
    """Full canonical tensors of a checkpoint (every ``*.safetensors`` file, float32)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors files")
    hf: dict[str, Tensor] = {}
    for f in files:
        hf.update({k: v.float() for k, v in load_file(str(f)).items()})
    return from_hf(hf, m)


def engine_dict_from(directory: Path, engine: dict[str, Any]) -> dict[str, Any]:
    """``engine`` (an ``EngineConfig`` dict) set up to start from the checkpoint in
    ``directory``: its model shape from ``config.json``, ``init_hf`` pointing at it."""
    out = dict(engine)
    model = model_config_from_hf(read_config(directory), ModelConfig(**out.get("model", {})))
    out["model"] = dataclasses.asdict(model)
    out["init_hf"] = str(Path(directory).resolve())
    budget = out.get("max_tokens_per_microbatch", EngineConfig().max_tokens_per_microbatch)
    out["max_tokens_per_microbatch"] = max(budget, model.max_seq_len)
    return out
