"""The model's shape: ``ModelConfig``, validated on its own (no torch import). The engine
configuration (``workers/engine/config.py``) holds it beside the layout and the optimizer, and
re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.workers.engine.families import FAMILIES


class ConfigError(ValueError):
    """An impossible configuration; the message says what to change."""


LINEAR_TREE = (
    "packing 'tree' cannot pack a model with Gated DeltaNet (linear attention) layers: their "
    "recurrent state runs through a sequence in order and cannot branch at a trie's fork; "
    "use packing 'flat'"
)


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Shape of the GPT model every rank builds a shard of."""

    num_layers: int = 2
    """Transformer layers (divisible by pp * virtual stages)."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Query heads (divisible by tp)."""
    num_query_groups: int = 2
    """Key/value heads for grouped-query attention (divisible by tp, divides heads)."""
    ffn_hidden_size: int = 512
    """MLP inner width."""
    vocab_size: int = 512
    """Vocabulary size (divisible by tp). Token ids must lie in [0, vocab_size)."""
    max_seq_len: int = 1024
    """Longest sequence accepted, in tokens."""
    rotary_base: int = 10000
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    seed: int = 1234
    """Weights are initialised from this seed: equal seeds give equal models on any layout."""
    num_experts: int = 0
    """Mixture-of-experts MLPs with this many experts per layer; 0 = dense MLPs."""
    moe_topk: int = 2
    """Experts each token is routed to (MoE only)."""
    moe_ffn_hidden_size: int = 256
    """Inner width of each expert (MoE only)."""
    moe_norm_topk: bool = True
    """Renormalise each token's top-k router probabilities to sum to 1 (Hugging Face
    ``norm_topk_prob``); False keeps the softmax over all experts (MoE only)."""
    moe_shared_ffn_hidden_size: int = 0
    """Inner width of the shared expert (Qwen3.5-MoE): an MLP every token goes through beside
    its routed experts, its output scaled by ``sigmoid`` of a learned per-token gate; 0: none
    (MoE only)."""
    family: str = "llama"
    """The Hugging Face family (``workers/engine/families.py``): ``llama``, ``qwen2``,
    ``qwen3``, ``qwen3_moe``, ``qwen3_5`` or ``qwen3_5_moe``. It decides the attention
    options (``qkv_bias``, ``qk_norm``) and the format of imports and exports."""
    head_dim: int = 0
    """Channels per attention head; 0 = hidden_size / num_attention_heads (Qwen3 sets its
    own)."""
    tie_embeddings: bool = False
    """The output layer is the input embedding (one matrix, Hugging Face
    ``tie_word_embeddings``)."""
    rope_scaling_factor: float = 0.0
    """Llama 3 RoPE scaling (``rope_type: llama3``): the factor; 0 = no scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling: wavelengths above ``original / low`` are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling: wavelengths below ``original / high`` are kept."""
    rope_original_max_position: int = 8192
    """Llama 3 RoPE scaling: the context length the model was pre-trained with."""
    rotary_percent: float = 1.0
    """The share of each head's channels that RoPE rotates (Qwen3.5: 0.25)."""
    layer_types: tuple[str, ...] = ()
    """Per layer, ``full_attention`` or ``linear_attention`` (Gated DeltaNet, Qwen3.5);
    empty: every layer is full attention."""
    linear_num_key_heads: int = 0
    """Gated DeltaNet query/key heads (divisible by tp)."""
    linear_num_value_heads: int = 0
    """Gated DeltaNet value heads (a multiple of the key heads)."""
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet's causal convolution width."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON gives lists

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet (linear-attention) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query, key and value projections (Qwen2)."""
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head of the queries and keys, before RoPE (Qwen3)."""
        return FAMILIES[self.family].qk_norm

    @property
    def kv_channels(self) -> int:
        """Channels per attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family must be one of {list(FAMILIES)}, got {self.family!r}")
        fam = FAMILIES[self.family]
        if fam.moe and not self.num_experts:
            raise ConfigError(f"model.family {self.family!r} needs model.num_experts > 0")
        if fam.shared_expert != bool(self.moe_shared_ffn_hidden_size > 0):
            raise ConfigError(
                f"model.moe_shared_ffn_hidden_size: family {self.family!r} "
                + ("needs a shared expert (> 0)" if fam.shared_expert else "has no shared expert")
            )
        if self.head_dim < 0:
            raise ConfigError(f"model.head_dim must be >= 0, got {self.head_dim}")
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads}), or set model.head_dim"
            )
        if self.num_experts and not 1 <= self.moe_topk <= self.num_experts:
            raise ConfigError(
                f"model.moe_topk ({self.moe_topk}) must lie in [1, num_experts = "
                f"{self.num_experts}]"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        self._validate_linear_attention()
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if self.rope_scaling_factor and not (self.rope_scaling_factor > 0 and high > low > 0):
            raise ConfigError(
                "model.rope_scaling_factor needs a positive factor and "
                "rope_high_freq_factor > rope_low_freq_factor > 0"
            )

    def _validate_linear_attention(self) -> None:
        kinds = {"full_attention", "linear_attention"}
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"model.layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        if set(self.layer_types) - kinds:
            raise ConfigError(
                f"model.layer_types: each one of {sorted(kinds)}, got "
                f"{sorted(set(self.layer_types) - kinds)}"
            )
        if not self.linear_layers:
            return
        if not FAMILIES[self.family].linear_layer:
            raise ConfigError(f"model.layer_types: family {self.family!r} has no linear attention")
        dims = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")  # fmt: skip
        for name in dims:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive for linear attention layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                "model.linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
