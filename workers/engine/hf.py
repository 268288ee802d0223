"""Hugging Face checkpoints: import as a start, export for inference engines, per family.

Each family we serve is one table (``FAMILIES``): its ``model_type`` and architecture, which
options its ``config.json`` turns on, and the names of the tensors that map one to one onto our
canonical parameters (``workers/engine/weights.py``). Adding a family with the same building
blocks is a new table, not new code. Every family shares the two fused megatron tensors:

    linear_qkv   rows grouped by key/value head g: [q heads of g; k_g; v_g]  <->  q/k/v_proj
                 (weights and, with biases, the biases alike)
    linear_fc1   [gate; up]                                                  <->  gate/up_proj

Supported: ``llama`` (Llama 2/3, Mistral-style; RoPE scaling of type ``llama3`` with the
checkpoint's own factors), ``qwen2`` (q/k/v biases) and ``qwen3`` (q/k RMSNorm). Anything else a
``config.json`` asks for (another family, MoE, another activation, other biases or RoPE
scaling) is refused with a message naming the field. Tied input/output embeddings load untied:
the output layer starts as a copy of the embedding and trains on its own.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Family:
    name: str
    """Our ``ModelConfig.family``."""
    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values read as this family (the first one is written)."""
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: bool = False
    """Accepts RoPE scaling of type ``llama3``."""
    per_layer: dict[str, str] = field(default_factory=dict)
    """Our per-layer tensor name -> the family's, for tensors that map one to one."""


_LLAMA_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QK_NORM_LAYER = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama", ("llama", "mistral"), "LlamaForCausalLM", rope_scaling=True,
            per_layer=_LLAMA_LAYER,
        ),
        Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", qkv_bias=True, per_layer=_LLAMA_LAYER),
        Family(
            "qwen3", ("qwen3",), "Qwen3ForCausalLM", qk_norm=True,
            per_layer=_LLAMA_LAYER | _QK_NORM_LAYER,
        ),
    )
}  # fmt: skip
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def family_of(cfg: dict[str, Any]) -> Family:
    kind = cfg.get("model_type", "?")
    for f in FAMILIES.values():
        if kind in f.model_types:
            return f
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ConfigError(f"{CONFIG}: model_type {kind!r} is not supported (one of {known})")


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the family's ``*ForCausalLM`` equal to ``m``."""
    if m.num_experts:
        raise ConfigError("MoE models cannot be exported yet")
    fam = FAMILIES[m.family]
    rope: dict[str, Any] = {"rope_theta": float(m.rotary_base), "rope_type": "default"}
    if m.rope_scaling_factor:
        rope |= {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_position,
        }
    return {
        "architectures": [fam.architecture],
        "model_type": fam.model_types[0],
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
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": m.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _rope_scaling(cfg: dict[str, Any], fam: Family, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig fields of the checkpoint's RoPE scaling ({} for none)."""
    # transformers < 5 writes rope_theta / rope_scaling; 5 writes rope_parameters.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3" or not fam.rope_scaling:
        problems.append(f"rope_scaling of type {kind!r} (only 'llama3', for llama)")
        return {}
    return {
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
        "rope_original_max_position": int(scaling.get("original_max_position_embeddings", 8192)),
    }


def model_config_from_hf(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The ``ModelConfig`` of a supported ``config.json``; anything unsupported fails with a
    message naming its field."""
    fam = family_of(cfg)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    qkv_bias = bool(cfg.get("attention_bias", fam.qkv_bias))
    if qkv_bias and not fam.qkv_bias:
        problems.append(f"attention_bias (q/k/v biases: qwen2 only, not {fam.name})")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias (MLP biases)")
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key):
            problems.append(f"{key} (mixture-of-experts checkpoints are not supported yet)")
    scaling = _rope_scaling(cfg, fam, problems)
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim * heads != cfg["hidden_size"]:
        problems.append(f"head_dim {head_dim} x {heads} heads != hidden_size")
    if problems:
        raise ConfigError(f"{CONFIG}: not supported: " + "; ".join(problems))
    return dataclasses.replace(
        base,
        family=fam.name,
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
        qkv_bias=qkv_bias,
        qk_norm=fam.qk_norm,
        **scaling,
    )


def _qkv_split(m: ModelConfig) -> tuple[int, int, int]:
    d = m.hidden_size // m.num_attention_heads
    per_group = m.num_attention_heads // m.num_query_groups
    return per_group * d, d, m.num_query_groups


def to_hf(canonical: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Full canonical tensors -> the family's tensor names."""
    per_layer = FAMILIES[m.family].per_layer
    q_rows, d, groups = _qkv_split(m)
    out: dict[str, Tensor] = {}
    for name, t in canonical.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        layer, rest = _layer(name)
        prefix = f"model.layers.{layer}."
        if rest in per_layer:
            out[prefix + per_layer[rest]] = t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            g = t.reshape(groups, q_rows + 2 * d, *t.shape[1:])
            for proj, part in zip(
                "qkv", (g[:, :q_rows], g[:, q_rows : q_rows + d], g[:, q_rows + d :]), strict=True
            ):
                out[prefix + f"self_attn.{proj}_proj.{kind}"] = part.reshape(-1, *t.shape[1:])
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate
            out[prefix + "mlp.up_proj.weight"] = up
        else:
            raise ValueError(f"{name}: no {m.family} counterpart")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """The family's tensor names -> full canonical tensors (inverse of ``to_hf``)."""
    per_layer = FAMILIES[m.family].per_layer
    q_rows, d, groups = _qkv_split(m)
    out = {name: hf[key] for name, key in _TOP.items() if key in hf}
    if "output_layer.weight" not in out:  # tied embeddings: the output starts as a copy
        out["output_layer.weight"] = hf["model.embed_tokens.weight"].clone()
    kinds = ("weight", "bias") if m.qkv_bias else ("weight",)
    for layer in range(m.num_layers):
        p, c = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for ours, theirs in per_layer.items():
            out[c + ours] = hf[p + theirs]
        for kind in kinds:
            q, k, v = (hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            rest = q.shape[1:]
            fused = torch.cat(
                [q.reshape(groups, q_rows, *rest), k.reshape(groups, d, *rest),
                 v.reshape(groups, d, *rest)],
                1,
            )  # fmt: skip
            out[c + f"self_attention.linear_qkv.{kind}"] = fused.reshape(-1, *rest)
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
