"""The Hugging Face model families we import and export: one table each, data only (no torch).

A family is its ``config.json`` ``model_type``, its architecture class, the options it turns
on, and its tensor table: which of its tensors make up each of our canonical parameters
(``workers/engine/weights.py``). ``workers/engine/hf.py`` reads these tables in both
directions, so adding a family built from the same blocks is a new ``Family``, not new code.

A row maps one canonical per-layer tensor (its name after ``decoder.layers.<i>.``) onto the
family's (after ``model.layers.<i>.``); ``{e}`` stands for the expert index. Two fusions:

    qkv   megatron's ``linear_qkv`` rows are grouped by key/value head g: ``[q heads of g; k_g;
          v_g]``; Hugging Face keeps ``q_proj``, ``k_proj`` and ``v_proj`` (weights and biases)
    glu   megatron's ``linear_fc1`` is ``[gate; up]``; Hugging Face keeps ``gate_proj`` and
          ``up_proj``
    qgkv  gated attention (Qwen3.5): megatron's ``linear_qkv`` rows per group g are ``[q heads
          of g; their output gates; k_g; v_g]``; Hugging Face's ``q_proj`` interleaves each
          head's query and gate rows
    gdn   Gated DeltaNet's input projection and its convolution, grouped by key head g:
          ``[q_g; k_g; v_g; z_g; b_g; a_g]`` (``[q_g; k_g; v_g]`` for the convolution), so a
          contiguous TP split keeps whole groups; Hugging Face keeps ``in_proj_qkv``,
          ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, each head-major
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fuse = Literal["", "qkv", "glu", "qgkv", "gdn"]


@dataclass(frozen=True)
class Row:
    ours: str
    theirs: tuple[str, ...]
    fuse: Fuse = ""


@dataclass(frozen=True)
class Family:
    name: str
    """Our ``ModelConfig.family``."""
    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values read as this family (the first one is written)."""
    architecture: str
    layer: tuple[Row, ...]
    """The tensors of one decoder layer."""
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    """Every layer's MLP is a mixture of experts (and ``model.num_experts`` > 0)."""
    rope_scaling: bool = False
    """Accepts RoPE scaling of type ``llama3``."""
    linear_layer: tuple[Row, ...] = ()
    """The tensors of a Gated DeltaNet layer (hybrid families); none: no linear attention."""
    attention_gate: bool = False
    """Full attention gates its output per channel by ``sigmoid`` of a second query
    projection (Qwen3.5)."""
    zero_centered_norm: bool = False
    """Every RMSNorm of the residual stream and of q/k scales by ``1 + weight`` (Qwen3.5);
    Gated DeltaNet's own output norm does not."""
    shared_expert: bool = False
    """Every MoE layer also has a shared expert, gated per token (Qwen3.5-MoE)."""
    router_normalises: bool = False
    """The router always renormalises its top-k probabilities: the ``config.json`` has no
    ``norm_topk_prob`` (Qwen3.5-MoE)."""


def _qkv(kind: str) -> Row:
    return Row(
        f"self_attention.linear_qkv.{kind}",
        tuple(f"self_attn.{x}_proj.{kind}" for x in "qkv"),
        "qkv",
    )


def _mlp(ours: str, theirs: str) -> tuple[Row, ...]:
    gate_up = (f"{theirs}gate_proj.weight", f"{theirs}up_proj.weight")
    return (
        Row(f"{ours}linear_fc1.weight", gate_up, "glu"),
        Row(f"{ours}linear_fc2.weight", (f"{theirs}down_proj.weight",)),
    )


ATTENTION = (
    Row("input_layernorm.weight", ("input_layernorm.weight",)),
    _qkv("weight"),
    Row("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Row("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
QKV_BIAS = (_qkv("bias"),)
QK_NORM = (
    Row("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Row("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)
DENSE_MLP = _mlp("mlp.", "mlp.")
GATED_ATTENTION = (
    Row("input_layernorm.weight", ("input_layernorm.weight",)),
    Row(
        "self_attention.linear_qkv.weight",
        tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
        "qgkv",
    ),
    Row("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    Row("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
GATED_DELTA_NET = (
    Row("input_layernorm.weight", ("input_layernorm.weight",)),
    Row(
        "self_attention.in_proj.weight",
        tuple(f"linear_attn.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
        "gdn",
    ),
    Row("self_attention.conv1d.weight", ("linear_attn.conv1d.weight",), "gdn"),
    Row("self_attention.dt_bias", ("linear_attn.dt_bias",)),
    Row("self_attention.A_log", ("linear_attn.A_log",)),
    Row("self_attention.out_norm.weight", ("linear_attn.norm.weight",)),
    Row("self_attention.out_proj.weight", ("linear_attn.out_proj.weight",)),
    Row("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
MOE_MLP = (
    Row("mlp.router.weight", ("mlp.gate.weight",)),
    *_mlp("mlp.experts.local_experts.{e}.", "mlp.experts.{e}."),
)
SHARED_EXPERT = (
    *_mlp("mlp.shared_experts.", "mlp.shared_expert."),
    Row("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",)),
)
TOP = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
)
OUTPUT = Row("output_layer.weight", ("lm_head.weight",))
"""Absent from tied checkpoints: the output layer is the embedding."""

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama", ("llama", "mistral"), "LlamaForCausalLM",
            ATTENTION + DENSE_MLP, rope_scaling=True,
        ),
        Family(
            "qwen2", ("qwen2",), "Qwen2ForCausalLM",
            ATTENTION + QKV_BIAS + DENSE_MLP, qkv_bias=True,
        ),
        Family(
            "qwen3", ("qwen3",), "Qwen3ForCausalLM",
            ATTENTION + QK_NORM + DENSE_MLP, qk_norm=True,
        ),
        Family(
            "qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM",
            ATTENTION + QK_NORM + MOE_MLP, qk_norm=True, moe=True,
        ),
        Family(
            "qwen3_5", ("qwen3_5_text",), "Qwen3_5ForCausalLM",
            GATED_ATTENTION + QK_NORM + DENSE_MLP, qk_norm=True,
            linear_layer=GATED_DELTA_NET + DENSE_MLP, attention_gate=True,
            zero_centered_norm=True,
        ),
        Family(
            "qwen3_5_moe", ("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM",
            GATED_ATTENTION + QK_NORM + MOE_MLP + SHARED_EXPERT, qk_norm=True, moe=True,
            linear_layer=GATED_DELTA_NET + MOE_MLP + SHARED_EXPERT, attention_gate=True,
            zero_centered_norm=True, shared_expert=True, router_normalises=True,
        ),
    )
}  # fmt: skip


def find_family(model_type: str) -> Family | None:
    """The family whose ``config.json`` says ``model_type`` (None: not one we serve)."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def export_problem(family: str, num_experts: int) -> str | None:
    """Why a model of ``family`` with ``num_experts`` has no Hugging Face form (None: it has)."""
    if bool(num_experts) != FAMILIES[family].moe:
        kind = "mixture-of-experts" if num_experts else "dense"
        return (
            f"a {kind} model of family {family!r} has no Hugging Face form "
            "(mixture-of-experts models export as family 'qwen3_moe' or 'qwen3_5_moe')"
        )
    return None
