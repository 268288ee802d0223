"""Engine configuration: model shape, parallel layout, optimizer. Validated once, handed down.

Plain kw-only dataclasses (no torch import) so the controller and the service can build and
check them without loading the engine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from trainctl.workers.engine.model_config import LINEAR_TREE, ConfigError, ModelConfig

__all__ = [
    "LINEAR_TREE",
    "ConfigError",
    "EngineConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "Packing",
    "ParallelLayout",
    "Precision",
    "Recompute",
    "Switch",
]


Recompute = Literal["none", "norms", "elementwise", "selective", "full"]
Precision = Literal["auto", "bf16", "fp32"]
Switch = Literal["auto", "on", "off"]
Packing = Literal["auto", "flat", "tree"]
"""The choices of ``EngineConfig`` fields the service's settings repeat: named once here, and
``EngineConfig.validate`` checks every such field against its own annotation."""


@dataclass(kw_only=True, frozen=True)
class ParallelLayout:
    """Sizes of the parallel axes. Rank order is megatron's tp-cp-ep-dp-pp (TP fastest)."""

    dp: int = 1
    """Data-parallel replicas."""
    cp: int = 1
    """Context-parallel ranks (a sequence is split over them)."""
    tp: int = 1
    """Tensor-parallel ranks (weights split over them)."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel ranks (MoE only; must divide dp * cp * tp: experts are not
    tensor-parallel, so the TP ranks can hold different experts)."""
    vp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def validate(self, model: ModelConfig) -> None:
        for axis in ("dp", "cp", "tp", "pp", "ep", "vp"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"layout.{axis} must be >= 1, got {getattr(self, axis)}")
        if model.linear_layers and self.cp > 1:
            raise ConfigError(
                "layout.cp > 1: Gated DeltaNet (linear attention) layers have no context "
                "parallelism in megatron-core 0.16.1 (a sequence's recurrent state would have to "
                "pass from one CP rank to the next); use cp = 1"
            )
        if self.tp > 1:
            names: tuple[str, ...] = ("num_attention_heads", "num_query_groups", "vocab_size")
            if model.linear_layers:
                names += ("linear_num_key_heads", "linear_num_value_heads")
            for name in names:
                if getattr(model, name) % self.tp:
                    raise ConfigError(
                        f"model.{name} ({getattr(model, name)}) must be divisible by "
                        f"layout.tp ({self.tp}); change tp or the model"
                    )
        if model.num_layers % (self.pp * self.vp):
            raise ConfigError(
                f"model.num_layers ({model.num_layers}) must be divisible by "
                f"layout.pp * layout.vp ({self.pp * self.vp})"
            )
        if self.vp > 1 and self.pp == 1:
            raise ConfigError("layout.vp > 1 needs layout.pp > 1")
        if (self.dp * self.cp * self.tp) % self.ep:
            raise ConfigError(
                f"layout.ep ({self.ep}) must divide dp * cp * tp ({self.dp * self.cp * self.tp})"
            )
        if self.ep > 1 and not model.num_experts:
            raise ConfigError("layout.ep > 1 needs an MoE model (model.num_experts > 0)")
        if model.num_experts % self.ep:
            raise ConfigError(
                f"model.num_experts ({model.num_experts}) must be divisible by layout.ep "
                f"({self.ep})"
            )

    def describe(self) -> str:
        return f"dp{self.dp} cp{self.cp} tp{self.tp} pp{self.pp} ep{self.ep} vp{self.vp}"


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay and global-norm gradient clipping."""

    lr: float = 1e-3
    """Learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not math.isfinite(value):
                raise ConfigError(f"optimizer.{name} must be a finite number, got {value}")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("optimizer.lr, weight_decay and clip_grad must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("optimizer betas must lie in [0, 1)")


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    """LoRA adapters on a frozen base (``workers/engine/adapter_bank.py``)."""

    max_adapters: int = 0
    """Adapters one service holds at most; 0: no adapters, the base trains (full
    fine-tuning)."""
    max_rank: int = 64
    """The largest adapter rank: every adapted linear keeps factors this wide."""
    max_in_memory: int = 0
    """Idle adapters kept in host memory; the least recently used beyond that many wait on
    disk under ``offload_dir``. 0: all in memory."""
    offload_dir: str = ""
    """Where idle adapters wait on disk (one folder per rank); the service sets it to
    ``<data_dir>/adapters``."""

    @property
    def enabled(self) -> bool:
        return self.max_adapters > 0

    def validate(self) -> None:
        if self.max_adapters < 0 or self.max_rank < 1 or self.max_in_memory < 0:
            raise ConfigError(
                "lora.max_adapters and lora.max_in_memory must be >= 0, lora.max_rank >= 1"
            )
        if self.max_in_memory and not self.offload_dir:
            raise ConfigError("lora.max_in_memory needs lora.offload_dir (where the rest wait)")


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """Everything a rank needs to build its shard and run a step."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch (after padding); at least model.max_seq_len."""
    logprob_chunk_size: int | Literal["auto"] = "auto"
    """Tokens per chunk of the streamed log-prob kernel and of the fused LM head; 0 disables
    chunking. ``auto`` (``resolved_chunk_size``): 4,096 on CUDA, where a larger chunk means
    fewer, larger matrix products and fewer fp32 weight-gradient accumulations; 1,024 on a
    CPU, where an fp32 chunk of a 152K vocabulary's logits is 0.6 GiB against 2.3 at 4,096.
    The GPU tier checks the head's gradients at both sizes."""
    norm_kernel: Literal["auto", "eager", "compiled"] = "auto"
    """The residual stream's RMSNorms (each layer's two, the final one, a Gated DeltaNet's
    output norm): ``eager`` runs ``F.rms_norm``; ``compiled`` runs it through torch.compile
    (``workers/ops/norm.py``), whose backward splits the weight gradient's reduction over the
    tokens, where eager CUDA's one-pass reduction took ~31 ms of a 420 ms step in an H200
    profile. The same numbers within rounding; the compile costs seconds on a rank's first
    step. ``auto`` (``resolved_norm_kernel``): compiled on CUDA, as the q/k norms and the
    rotation already are; eager on a CPU. The GPU benchmark times the other one beside the
    default (``bench/gpu.py --trainctl-variants``)."""
    precision: Precision = "auto"
    """``bf16``: bf16 parameters and compute, with fp32 main gradients, fp32 master weights
    in the optimizer and fp32 log-probs, loss and normaliser; ``fp32``: everything fp32;
    ``auto``: bf16 where CUDA is present, fp32 on a CPU (``resolved_precision``)."""
    distributed_optimizer: Switch = "auto"
    """ZeRO-1: each DP x CP rank keeps the optimizer state and master weights of only its
    1 / (dp x cp) of the parameters; gradients are reduce-scattered and the updated
    parameters all-gathered. ``auto`` is on when dp x cp > 1."""
    sequence_parallel: Switch = "auto"
    """Sequence parallelism (tp > 1): between the tensor-parallel regions (norms, residuals,
    dropout, the MoE router) each TP rank holds 1 / tp of the tokens instead of all of them;
    the column-parallel linears all-gather their input over TP and the row-parallel ones
    reduce-scatter their output, so activation memory there drops by tp for the same traffic.
    ``auto`` is on when tp > 1. MoE at tp > 1 needs it (each TP rank routes its own tokens)."""
    packing: Packing = "auto"
    """How a batch is packed unless its request says: ``tree`` packs sequences that share a
    prefix into prefix tries (each shared token computed once, the same results; a batch
    sharing nothing is packed exactly as ``flat``); ``flat`` packs every sequence whole;
    ``auto``: ``tree``, or ``flat`` for a model with linear-attention layers."""
    recompute: Recompute = "none"
    """Activation recomputation: ``norms`` drops each layer's two RMSNorm outputs once the
    linear after them has used them and recomputes them in backward (the cheapest: a norm's
    forward, for 2 bytes x hidden a token a norm in bf16); ``elementwise`` does the same with
    the dense MLP's SwiGLU product too (fc2's input, 2 bytes x ffn a token: the largest
    tensor a layer keeps for the price of an elementwise op; in MoE layers each expert's
    weighted SwiGLU, ``workers/engine/experts.py``);
    ``selective`` keeps each layer's inputs and recomputes its core attention (and dense MLP)
    in backward; ``full`` keeps only each layer's input and recomputes the whole layer. Less
    activation memory for more compute; the same numbers."""
    fused_lm_head: bool = True
    """The output layer runs inside the log-prob kernel, chunk by chunk, so the logits of a
    micro-batch never exist whole (``workers/ops/fused_head.py``); False computes all logits,
    then log-probs from them (the same values, bit for bit)."""
    collective_timeout_s: float = 120.0
    """Timeout of every process group: a dead peer becomes an error, not a hang."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: gloo on CPU, NCCL + gloo (device + host tensors) on CUDA."""
    init_hf: str = ""
    """Start from this Hugging Face checkpoint directory instead of the seeded initialisation
    (``model`` must match its config.json: ``workers/engine/hf.py``)."""

    def _check_choices(self) -> None:
        """Every field of a ``Literal`` type holds one of its choices."""
        hints = get_type_hints(EngineConfig)
        for f in fields(self):
            hint = hints[f.name]
            allowed = get_args(hint)
            if get_origin(hint) is Literal and getattr(self, f.name) not in allowed:
                raise ConfigError(
                    f"{f.name} must be one of {list(allowed)}, got {getattr(self, f.name)!r}"
                )

    def validate(self) -> EngineConfig:
        self.model.validate()
        self.layout.validate(self.model)
        self.optimizer.validate()
        self.lora.validate()
        if self.max_tokens_per_microbatch < self.model.max_seq_len:
            raise ConfigError(
                f"max_tokens_per_microbatch ({self.max_tokens_per_microbatch}) must be at least "
                f"model.max_seq_len ({self.model.max_seq_len}) so every sequence fits"
            )
        self._check_choices()
        if self.packing == "tree" and self.model.linear_layers:
            raise ConfigError(LINEAR_TREE)
        if self.lora.enabled and self.model.linear_layers:
            raise ConfigError(
                "lora.max_adapters: LoRA on a model with Gated DeltaNet layers (Qwen3.5) is not "
                "built yet (its gated attention and linear layers have no adapter sites); train "
                "the full model, --max-adapters 0"
            )
        if self.sequence_parallel == "on" and self.layout.tp == 1:
            raise ConfigError("sequence_parallel 'on' needs layout.tp > 1 (it splits over TP)")
        if self.model.num_experts and self.layout.tp > 1 and not self.use_sequence_parallel:
            raise ConfigError(
                "MoE with layout.tp > 1 needs sequence parallelism: set sequence_parallel to "
                "'auto' or 'on', or use tp = 1"
            )
        if self.logprob_chunk_size != "auto" and (
            not isinstance(self.logprob_chunk_size, int) or self.logprob_chunk_size < 0
        ):
            raise ConfigError("logprob_chunk_size must be 'auto' or an integer >= 0")
        if self.collective_timeout_s <= 0:
            raise ConfigError("collective_timeout_s must be > 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def default_packing(self) -> Literal["flat", "tree"]:
        if self.packing == "auto":
            return "flat" if self.model.linear_layers else "tree"
        return self.packing

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        d = dict(d)
        return cls(
            model=ModelConfig(**d.pop("model", {})),
            layout=ParallelLayout(**d.pop("layout", {})),
            optimizer=OptimizerConfig(**d.pop("optimizer", {})),
            lora=LoraConfig(**d.pop("lora", {})),
            **d,
        )

    def resolved_precision(self, *, cuda: bool) -> Literal["bf16", "fp32"]:
        """The precision a rank runs: ``auto`` is bf16 with CUDA, fp32 without."""
        if self.precision == "auto":
            return "bf16" if cuda else "fp32"
        return self.precision

    def resolved_chunk_size(self, *, cuda: bool) -> int:
        """The log-prob and LM-head chunk a rank runs: ``auto`` is 4,096 with CUDA, 1,024
        without."""
        if self.logprob_chunk_size == "auto":
            return 4096 if cuda else 1024
        return self.logprob_chunk_size

    def resolved_norm_kernel(self, *, cuda: bool) -> Literal["eager", "compiled"]:
        """The RMSNorm kernel a rank runs: ``auto`` is compiled with CUDA, eager without."""
        if self.norm_kernel == "auto":
            return "compiled" if cuda else "eager"
        return self.norm_kernel

    @property
    def use_distributed_optimizer(self) -> bool:
        """ZeRO-1 over DP x CP: ``auto`` turns it on when there is more than one replica."""
        if self.distributed_optimizer == "auto":
            return self.layout.dp * self.layout.cp > 1
        return self.distributed_optimizer == "on"

    @property
    def use_sequence_parallel(self) -> bool:
        """Sequence parallelism: ``auto`` turns it on when tp > 1."""
        if self.sequence_parallel == "auto":
            return self.layout.tp > 1
        return self.sequence_parallel == "on"

    @property
    def pad_multiple(self) -> int:
        """Every packed sequence is right-padded to a multiple of this (2*cp*tp, or tp)."""
        lay = self.layout
        return 2 * lay.cp * lay.tp if lay.cp > 1 else lay.tp
