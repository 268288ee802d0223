"""Tiny random models of every family we import, made and saved by transformers itself
(offline, no hub): the references of the import/export tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

SHAPE = dict(
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
_QWEN3_5 = dict(
    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 40000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip
FAMILIES: dict[str, Callable[..., Any]] = {
    # Each takes config values that replace ``SHAPE``'s and its own (``tiny_model``'s shape):
    # they go to the constructor, which derives what depends on them (``layer_types``).
    "llama": lambda **o: transformers.LlamaConfig(**SHAPE | {"rope_theta": 50000.0} | o),
    # Llama 3.1-style RoPE scaling with values other than megatron's hard-coded 1 / 4 / 8192,
    # and an original context short enough that every branch of the formula is used.
    "llama3": lambda **o: transformers.LlamaConfig(
        **SHAPE | {
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        } | o
    ),
    # Qwen2.5 and Qwen3 small models tie their embeddings; Qwen3's heads are wider than
    # hidden_size / heads.
    "qwen2": lambda **o: transformers.Qwen2Config(
        **SHAPE | {"tie_word_embeddings": True, "rope_theta": 20000.0} | o
    ),
    "qwen3": lambda **o: transformers.Qwen3Config(
        **SHAPE | {"tie_word_embeddings": True, "head_dim": 32, "rope_theta": 30000.0} | o
    ),
    "qwen3_moe": lambda **o: transformers.Qwen3MoeConfig(
        **SHAPE | {
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 48, "norm_topk_prob": True,
        } | o
    ),
    # Qwen3.5: three Gated DeltaNet layers, then gated full attention (its default pattern),
    # RoPE on a quarter of each head, two value heads per key head.
    "qwen3_5": lambda **o: transformers.Qwen3_5TextConfig(**SHAPE | _QWEN3_5 | o),
    # Qwen3.5-MoE: the same hybrid layers, each with four experts (two per token) and a
    # shared expert behind a sigmoid gate.
    "qwen3_5_moe": lambda **o: transformers.Qwen3_5MoeTextConfig(
        **SHAPE | _QWEN3_5 | {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
        } | o
    ),
}  # fmt: skip
TIED = ("qwen2", "qwen3")


def tiny_model(family: str, directory: Path, **shape: Any) -> Any:
    """A tiny random model of ``family`` saved into ``directory``, with non-trivial norms and
    biases, so that a wrong epsilon, norm or bias mapping shows. ``shape``: config values
    instead of ``SHAPE``'s (a larger model of the same family)."""
    torch.manual_seed(0)
    config = FAMILIES[family](**shape)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


PARAGRAPH = "\n\n"
"""What every even token id of ``word_tokenizer``'s vocabulary decodes to (with its own tag)."""


def word_tokenizer(directory: Path, vocab_size: int = SHAPE["vocab_size"]) -> Any:
    """A word-level tokenizer for a tiny model, saved into ``directory`` by transformers: one
    token per id of the model's vocabulary (vLLM refuses ids the tokenizer lacks). An even id
    decodes to a paragraph break and a tag (``"\\n\\nt4"``), an odd one to a word (``"w3"``),
    so a sampled completion meets ``"\\n\\n"`` within a few tokens, and where is known from the
    ids alone."""
    from tokenizers import Tokenizer, models

    vocab = {(f"{PARAGRAPH}t{i}" if i % 2 == 0 else f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1")
    fast.save_pretrained(directory)
    return fast
