"""Hugging Face checkpoints: import as a start, export for inference engines, per family.

The families and their tensor tables are data (``workers/engine/families.py``); this module
reads them both ways: ``config.json`` <-> ``ModelConfig``, and the family's tensors <-> our
canonical full tensors (``workers/engine/weights.py``).

Supported: ``llama`` (Llama 2/3, Mistral-style; RoPE scaling of type ``llama3`` with the
checkpoint's own factors), ``qwen2`` (q/k/v biases), ``qwen3`` (q/k RMSNorm, its own head
size), ``qwen3_moe`` (router and experts on every layer), ``qwen3_5`` (hybrid Gated
DeltaNet and gated attention) and ``qwen3_5_moe`` (the same with experts and a gated shared
expert on every layer); tied input/output embeddings in any of them. Anything else a
``config.json`` asks for (another family, another activation, other biases, sliding-window
attention, other RoPE scaling, shared experts elsewhere, experts on some layers only) is
refused with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine.config import ConfigError, EngineConfig, ModelConfig
from trainctl.workers.engine.families import (
    FAMILIES,
    OUTPUT,
    TOP,
    Family,
    Fuse,
    export_problem,
    find_family,
)

CONFIG, WEIGHTS = "config.json", "model.safetensors"
_IGNORED = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints carry; recomputed, never loaded."""


NOT_YET = {
    "qwen3_5": "this is the vision-language Qwen3.5: serve its text model, a checkpoint whose "
    "config.json says model_type 'qwen3_5_text'",
    "qwen3_5_moe": "this is the vision-language Qwen3.5-MoE: serve its text model, a "
    "checkpoint whose config.json says model_type 'qwen3_5_moe_text'",
}
"""model_types we know of and refuse, with why."""


def family_of(cfg: dict[str, Any]) -> Family:
    kind = cfg.get("model_type", "?")
    if kind in NOT_YET:
        raise ConfigError(f"{CONFIG}: model_type {kind!r} is not supported: {NOT_YET[kind]}")
    fam = find_family(kind)
    if fam is None:
        known = sorted(t for f in FAMILIES.values() for t in f.model_types)
        raise ConfigError(f"{CONFIG}: model_type {kind!r} is not supported (one of {known})")
    return fam


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the family's ``*ForCausalLM`` equal to ``m``."""
    fam = FAMILIES[m.family]
    rope: dict[str, Any] = {"rope_theta": float(m.rotary_base), "rope_type": "default"}
    if m.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = m.rotary_percent
    if m.rope_scaling_factor:
        rope |= {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_position,
        }
    out = {
        "architectures": [fam.architecture],
        "model_type": fam.model_types[0],
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": float(m.rotary_base),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": m.qkv_bias,
        "mlp_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if fam.linear_layer:
        out |= {
            "layer_types": list(m.layer_types) or ["full_attention"] * m.num_layers,
            "linear_num_key_heads": m.linear_num_key_heads,
            "linear_num_value_heads": m.linear_num_value_heads,
            "linear_key_head_dim": m.linear_key_head_dim,
            "linear_value_head_dim": m.linear_value_head_dim,
            "linear_conv_kernel_dim": m.linear_conv_kernel_dim,
            "partial_rotary_factor": m.rotary_percent,
        }
    if fam.moe:
        out |= {
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.moe_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "norm_topk_prob": m.moe_norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if fam.shared_expert:
        out["shared_expert_intermediate_size"] = m.moe_shared_ffn_hidden_size
    return out


def parameter_count(m: ModelConfig) -> int:
    """The parameters of the family's Hugging Face model equal to ``m``, counted on
    transformers' meta device (no memory is taken; a tied embedding counts once)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config(m))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


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


def _experts(cfg: dict[str, Any], fam: Family, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig fields of the checkpoint's mixture of experts ({} for a dense model)."""
    num = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not fam.moe:
        if num:
            problems.append(f"num_experts {num} (mixture of experts: qwen3_moe, qwen3_5_moe)")
        return {"num_experts": 0}
    if num < 1:
        problems.append(f"num_experts (a {fam.name} model needs at least one expert)")
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        problems.append("decoder_sparse_step / mlp_only_layers (experts on every layer only)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if bool(shared) != fam.shared_expert:
        problems.append(
            "shared_expert_intermediate_size "
            + (f"(a {fam.name} model needs its shared expert)" if fam.shared_expert
               else f"{shared} (shared experts: qwen3_5_moe only)")
        )  # fmt: skip
    return {
        "num_experts": num,
        "moe_topk": int(cfg.get("num_experts_per_tok", 2)),
        "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
        "moe_norm_topk": fam.router_normalises or bool(cfg.get("norm_topk_prob", False)),
        "moe_shared_ffn_hidden_size": shared,
    }


def model_config_from_hf(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The ``ModelConfig`` of a supported ``config.json``; anything unsupported fails with a
    message naming its field."""
    fam = family_of(cfg)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("attention_bias", fam.qkv_bias) != fam.qkv_bias:
        problems.append(f"attention_bias {cfg['attention_bias']} (family {fam.name} has "
                        f"{'' if fam.qkv_bias else 'no '}q/k/v biases)")  # fmt: skip
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias (MLP biases)")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        problems.append("use_sliding_window (sliding-window attention)")
    experts = _experts(cfg, fam, problems)
    linear = _linear_attention(cfg, fam, problems)
    scaling = _rope_scaling(cfg, fam, problems)
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or 0)
    if problems:
        raise ConfigError(f"{CONFIG}: not supported: " + "; ".join(problems))
    return dataclasses.replace(
        base,
        family=fam.name,
        hidden_size=int(cfg["hidden_size"]),
        # Qwen3.5-MoE has no dense MLP, so no intermediate_size: the value is unused there.
        ffn_hidden_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=0 if head_dim * heads == int(cfg["hidden_size"]) else head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_seq_len=min(int(cfg.get("max_position_embeddings", base.max_seq_len)), 1 << 20),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=int(float(theta)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **experts,
        **scaling,
        **linear,
    )


_LINEAR_DIMS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _linear_attention(cfg: dict[str, Any], fam: Family, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid (Gated DeltaNet) checkpoint ({} for another)."""
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not fam.linear_layer:
        if partial != 1.0:
            problems.append(f"partial_rotary_factor {partial} (qwen3_5 only)")
        return {}
    if cfg.get("mtp_num_hidden_layers"):
        problems.append("mtp_num_hidden_layers (multi-token prediction layers)")
    return {
        "rotary_percent": partial,
        "layer_types": tuple(cfg.get("layer_types") or ()),
        **{k: int(cfg[k]) for k in _LINEAR_DIMS},
    }


def rows(m: ModelConfig) -> Iterator[tuple[str, tuple[str, ...], Fuse]]:
    """Every canonical tensor of ``m``: its name, its family's names, and how they fuse."""
    top = TOP if m.tie_embeddings else (*TOP, OUTPUT)
    for row in top:
        yield row.ours, row.theirs, row.fuse
    fam = FAMILIES[m.family]
    for layer in range(m.num_layers):
        ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for row in fam.linear_layer if layer in m.linear_layers else fam.layer:
            for e in range(m.num_experts) if "{e}" in row.ours else (0,):
                yield (
                    ours + row.ours.format(e=e),
                    tuple(theirs + t.format(e=e) for t in row.theirs),
                    row.fuse,
                )


def split(t: Tensor, fuse: Fuse, m: ModelConfig) -> tuple[Tensor, ...]:
    """Our fused tensor -> the family's parts (inverse of ``join``)."""
    if fuse == "glu":
        return tuple(t.chunk(2, dim=0))
    if fuse == "qgkv":
        q_rows, d, groups = _qkv_split(m)
        g = t.reshape(groups, 2 * q_rows + 2 * d, *t.shape[1:])
        q, gate = (x.reshape(-1, d, *t.shape[1:]) for x in g[:, : 2 * q_rows].chunk(2, dim=1))
        q_proj = torch.stack([q, gate], dim=1).reshape(-1, *t.shape[1:])
        k, v = g[:, 2 * q_rows : 2 * q_rows + d], g[:, 2 * q_rows + d :]
        return q_proj, k.reshape(-1, *t.shape[1:]), v.reshape(-1, *t.shape[1:])
    if fuse == "gdn":
        sizes, heads = _gdn_split(m, t.dim() == 3)
        grouped = t.reshape(m.linear_num_key_heads, -1, *t.shape[1:]).split(sizes, dim=1)
        pieces = [p.reshape(-1, *t.shape[1:]) for p in grouped]
        qkv = torch.cat(pieces[:3])
        return (qkv,) if heads is None else (qkv, *pieces[3:])
    if fuse == "qkv":
        q_rows, d, groups = _qkv_split(m)
        g = t.reshape(groups, q_rows + 2 * d, *t.shape[1:])
        parts = (g[:, :q_rows], g[:, q_rows : q_rows + d], g[:, q_rows + d :])
        return tuple(p.reshape(-1, *t.shape[1:]) for p in parts)
    return (t,)


def join(parts: list[Tensor], fuse: Fuse, m: ModelConfig) -> Tensor:
    """The family's parts -> our fused tensor (inverse of ``split``)."""
    if fuse == "glu":
        return torch.cat(parts)
    if fuse == "qgkv":
        q_rows, d, groups = _qkv_split(m)
        rest = parts[0].shape[1:]
        q_gate = parts[0].reshape(-1, 2, d, *rest)  # Hugging Face: [q_h; gate_h] per head
        q, gate = (x.reshape(groups, q_rows, *rest) for x in q_gate.unbind(1))
        k, v = (p.reshape(groups, d, *rest) for p in parts[1:])
        return torch.cat([q, gate, k, v], 1).reshape(-1, *rest)
    if fuse == "gdn":
        sizes, _ = _gdn_split(m, parts[0].dim() == 3)
        nk, rest = m.linear_num_key_heads, parts[0].shape[1:]
        qk = m.linear_num_key_heads * m.linear_key_head_dim
        q, k, v = parts[0].split([qk, qk, parts[0].shape[0] - 2 * qk])
        pieces = [q, k, v, *parts[1:]]
        grouped = [p.reshape(nk, -1, *rest) for p in pieces]
        assert [g.shape[1] for g in grouped] == sizes, (sizes, [g.shape for g in grouped])
        return torch.cat(grouped, 1).reshape(-1, *rest)
    if fuse == "qkv":
        _, _, groups = _qkv_split(m)
        q, k, v = (p.reshape(groups, -1, *p.shape[1:]) for p in parts)
        return torch.cat([q, k, v], 1).reshape(-1, *parts[0].shape[1:])
    return parts[0]


def _gdn_split(m: ModelConfig, conv: bool) -> tuple[list[int], int | None]:
    """Rows per key-head group of Gated DeltaNet's input projection ``[q k v z b a]`` (or of
    its convolution, ``conv``: ``[q k v]``), and the value heads per group (None: conv)."""
    r = m.linear_num_value_heads // m.linear_num_key_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    if conv:
        return [dk, dk, r * dv], None
    return [dk, dk, r * dv, r * dv, r, r], r


def _qkv_split(m: ModelConfig) -> tuple[int, int, int]:
    d = m.kv_channels
    per_group = m.num_attention_heads // m.num_query_groups
    return per_group * d, d, m.num_query_groups


def to_hf(canonical: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Full canonical tensors -> the family's tensor names."""
    out: dict[str, Tensor] = {}
    left = set(canonical)
    for ours, theirs, fuse in rows(m):
        out |= dict(zip(theirs, split(canonical[ours], fuse, m), strict=True))
        left.discard(ours)
    if left:
        raise ValueError(f"no {m.family} counterpart for {sorted(left)}")
    return {k: v.contiguous() for k, v in out.items()}


def check_names(names: set[str], m: ModelConfig) -> None:
    """Refuse a checkpoint whose tensor ``names`` are not exactly those ``m`` needs (a tied
    model may carry the output copy; old buffers are ignored)."""
    left = {k for k in names if not k.endswith(_IGNORED)}
    if m.tie_embeddings:
        left -= set(OUTPUT.theirs)  # some tied checkpoints still carry the copy
    for _, theirs, _ in rows(m):
        missing = [t for t in theirs if t not in names]
        if missing:
            raise ConfigError(f"the checkpoint has no tensor {missing[0]!r} ({m.family} needs it)")
        left -= set(theirs)
    if left:
        raise ConfigError(f"the checkpoint has tensors {m.family} does not use: {sorted(left)[:5]}")


def from_hf(hf: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """The family's tensor names -> full canonical tensors (inverse of ``to_hf``)."""
    check_names(set(hf), m)
    return {ours: join([hf[t] for t in theirs], fuse, m) for ours, theirs, fuse in rows(m)}


def save(directory: Path, canonical: dict[str, Tensor], m: ModelConfig) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``."""
    from safetensors.torch import save_file

    problem = export_problem(m.family, m.num_experts)
    if problem:
        raise ConfigError(problem)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(hf_config(m), indent=2))
    save_file(to_hf(canonical, m), str(directory / WEIGHTS), metadata={"format": "pt"})
    return [directory / CONFIG, directory / WEIGHTS]


def read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a Hugging Face checkpoint directory has one)")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


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
