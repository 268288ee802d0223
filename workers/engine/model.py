"""Build this rank's megatron-core GPT shard, its DDP wrapper and its optimizer.

The model is megatron-core's ``GPTModel`` on the local (non-TransformerEngine) layer spec, with
our packed-sequence core attention (``workers/engine/attention.py``) in place of the local one,
and our grouped experts (``workers/engine/experts.py``) in place of megatron's SequentialMLP.
Llama-style: RMSNorm, SwiGLU MLP, rotary positions (Llama 3 scaling optional); as the family
says, q/k/v biases (Qwen2), q/k norms (Qwen3), experts (Qwen3-MoE), and tied embeddings.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor

from trainctl.workers.engine import lora, megatron_cpu
from trainctl.workers.engine.attention import PackedCoreAttention
from trainctl.workers.engine.config import EngineConfig, OptimizerConfig
from trainctl.workers.engine.experts import GroupedExperts
from trainctl.workers.engine.families import FAMILIES
from trainctl.workers.engine.linear_attention import PackedGatedDeltaNet
from trainctl.workers.engine.mlp import DenseMLP
from trainctl.workers.engine.norm import DeferredRMSNorm, RMSNorm
from trainctl.workers.engine.optim_phase import use_fused_adamw


def transformer_config(cfg: EngineConfig, *, bf16: bool, cuda: bool = False) -> TransformerConfig:
    """megatron's TransformerConfig for ``cfg``: bf16 or fp32 parameters and compute. Free of
    TransformerEngine and apex; on ``cuda`` the SwiGLU is megatron's compiled one (one kernel
    each way instead of the chunk, SiLU, product and their backward), elsewhere plain ops."""
    m, lay = cfg.model, cfg.layout
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        tensor_model_parallel_size=lay.tp,
        sequence_parallel=cfg.use_sequence_parallel,
        # Experts are not tensor-parallel (workers/engine/experts.py), as in ParallelDims.
        expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=lay.pp,
        context_parallel_size=lay.cp,
        virtual_pipeline_model_parallel_size=lay.vp if lay.vp > 1 else None,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.qkv_bias,
        qk_layernorm=m.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        # workers/engine/weights.py initialises every parameter by its canonical name instead, so a
        # model is the same on every layout.
        perform_initialization=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        fp16=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=False,
        cross_entropy_fusion_impl="native",
        batch_p2p_comm=False,
        attention_output_gate=FAMILIES[m.family].attention_gate,
        layernorm_zero_centered_gamma=FAMILIES[m.family].zero_centered_norm,
        # Our loss is already divided by the global token count: the schedule must not divide
        # again, and DDP must sum gradients over DP x CP instead of averaging them.
        calculate_per_token_loss=True,
        **_recompute_options(cfg),
        **_moe_options(cfg),
        **_linear_attention_options(cfg),
    )


def _linear_attention_options(cfg: EngineConfig) -> dict[str, object]:
    m = cfg.model
    if not m.linear_layers:
        return {}
    return {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(t == "linear_attention") for t in m.layer_types],
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim,
        "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim,
        "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
    }


def _recompute_options(cfg: EngineConfig) -> dict[str, object]:
    if cfg.recompute == "full":
        # Every layer's input is kept, its activations are recomputed in backward.
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    if cfg.recompute in ("norms", "elementwise"):
        # megatron's CheckpointWithoutOutput: each norm's output is emptied once attention or
        # the MLP has used it, and refilled by a gradient hook before their backward reads it
        # (``elementwise``: the SwiGLU product too, by DenseMLP, workers/engine/mlp.py).
        return {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}
    if cfg.recompute == "selective":
        # The attention core and the dense MLP: their inputs are kept, their insides (the
        # MLP's [tokens, 2 x ffn] gate/up activations above all) recomputed. Our attention is
        # torch's memory-efficient SDPA already, so most of the saving is the MLP's.
        modules = ["core_attn"] if cfg.model.num_experts else ["core_attn", "mlp"]
        return {"recompute_granularity": "selective", "recompute_modules": modules}
    return {}


def _moe_options(cfg: EngineConfig) -> dict[str, object]:
    m = cfg.model
    if not m.num_experts:
        return {}
    return {
        "num_moe_experts": m.num_experts,
        "moe_router_topk": m.moe_topk,
        # Top-k of the logits, then a softmax over those k (= renormalised top-k probabilities),
        # or a softmax over every expert, then its top k.
        "moe_router_pre_softmax": not m.moe_norm_topk,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "expert_model_parallel_size": cfg.layout.ep,
        # The all-gather dispatcher runs without CUDA streams (docs/megatron_cpu.md).
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        # No auxiliary loss: it is computed per rank's tokens, so it would depend on the layout.
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        # Each router can take given top-k indices (workers/engine/replay.py); with none given
        # it routes by its own top-k, as without the option.
        "moe_enable_routing_replay": True,
        # Qwen3.5-MoE's shared expert: megatron's SharedExpertMLP (a tensor-parallel MLP
        # beside the routed experts) with its sigmoid gate.
        **(
            {
                "moe_shared_expert_intermediate_size": m.moe_shared_ffn_hidden_size,
                "moe_shared_expert_gate": True,
            }
            if m.moe_shared_ffn_hidden_size
            else {}
        ),
    }


def build_gpt(
    cfg: EngineConfig,
    tc: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    compiled_norms: bool = False,
) -> GPTModel:
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.model.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=cfg.model.qk_norm,
        normalization="RMSNorm",
    )
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = PackedCoreAttention
    # Every norm is ours: megatron's torch-backed norm refuses sequence parallelism.
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if attention.q_layernorm is not IdentityOp:
        # Applied by the core attention, fused with the rotation (workers/engine/norm.py).
        attention.q_layernorm = attention.k_layernorm = DeferredRMSNorm
    product = {"recompute_product": cfg.recompute == "elementwise"}
    if cfg.model.num_experts:
        layer.mlp.submodules.experts = ModuleSpec(module=GroupedExperts, params=product)
    else:
        layer.mlp.module = DenseMLP
        layer.mlp.params = product
    # The block spec names the final norm (a layer spec alone would get megatron's).
    block = TransformerBlockSubmodules(
        layer_specs=_stage_layers(cfg, tc, spec, vp_stage), layer_norm=RMSNorm
    )
    with megatron_cpu.cuda_to_cpu():
        model = GPTModel(
            config=tc,
            transformer_layer_spec=block,
            vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.model.max_seq_len,
            pre_process=pre_process,
            post_process=post_process,
            # Tied, with pp > 1: the last stage holds a copy megatron marks ``shared``, and
            # finalize_model_grads sums its gradient with the first stage's.
            share_embeddings_and_output_weights=cfg.model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            rotary_percent=cfg.model.rotary_percent,
            vp_stage=vp_stage,
        )
    if tc.bf16:
        # Every parameter in bf16, norms included (megatron's Float16Module does the same);
        # RoPE's frequencies are not a parameter or buffer and stay fp32.
        model.bfloat16()
    # Rotary positions are applied in our core attention (workers/engine/attention.py), after
    # the q/k norms it also takes over: from each token's position id in a packed micro-batch
    # (megatron's, from the packed length, would be wrong for a trie's depths), from 0..s-1 in
    # an unpacked call (one plain sequence, as the single-process references make). megatron's
    # module stays for its frequencies (inv_freq, Llama 3 scaling below).
    model.rotary_pos_emb.forward = _no_rotary
    if post_process:
        # The model ends at the final norm: its output is the hidden states, and the loss
        # function applies the output layer (``lm_head_weight``) inside the log-prob kernel.
        model.output_layer.forward = _hidden_states_out
    m = cfg.model
    if m.rope_scaling_factor:
        # megatron's own Llama 3 scaling hard-codes low = 1, high = 4 and original = 8192: the
        # checkpoint's values win (the same formula, every parameter given).
        rope = model.rotary_pos_emb
        rope.inv_freq = rope._apply_scaling(
            rope.inv_freq,
            factor=m.rope_scaling_factor,
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_position,
        )
    _bind_attention(model)
    if compiled_norms:  # EngineConfig.norm_kernel, resolved for the rank's device
        for module in model.modules():
            if type(module) is RMSNorm:  # not the q/k norms the core attention applies
                module.compiled = True
    return model


def _stage_layers(
    cfg: EngineConfig, tc: TransformerConfig, spec: ModuleSpec, vp_stage: int | None
) -> list[ModuleSpec]:
    """The layer specs of this pipeline stage: ``spec`` for every layer, or, for a hybrid model
    (Qwen3.5), a Gated DeltaNet in place of attention where ``layer_types`` says so."""
    count = get_num_layers_to_build(tc, vp_stage=vp_stage)
    linear = cfg.model.linear_layers
    if not linear:
        return [spec] * count
    gdn = copy.deepcopy(spec)
    gdn.submodules.self_attention = ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=RMSNorm, params={"zero_centered": False}),
            out_proj=RowParallelLinear,
        ),
    )
    offset = get_transformer_layer_offset(tc, vp_stage=vp_stage)
    return [gdn if offset + i in linear else spec for i in range(count)]


def _no_rotary(*_: Any, **__: Any) -> None:
    return None  # applied by PackedCoreAttention, after the q/k norms


def _bind_attention(model: GPTModel) -> None:
    """Give each layer's core attention what it applies itself: the rotary frequencies and its
    layer's q/k norms (deferred, ``DeferredRMSNorm``)."""
    for layer in model.decoder.layers:
        attention: Any = getattr(layer, "self_attention", None)
        core = getattr(attention, "core_attention", None)
        if not isinstance(core, PackedCoreAttention):
            continue  # a Gated DeltaNet layer
        q, k = attention.q_layernorm, attention.k_layernorm
        core.bind(
            model.rotary_pos_emb,
            q if isinstance(q, DeferredRMSNorm) else None,
            k if isinstance(k, DeferredRMSNorm) else None,
        )


def _hidden_states_out(
    input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
) -> tuple[Tensor, None]:
    return input_, None


def lm_head_weight(model: GPTModel) -> Tensor:
    """The output layer's weight ``[V / tp, H]``: the embedding's when tied (on the last stage
    at pp > 1, megatron's copy of it); with an adapter on the unembedding, ``W + s B A``."""
    weight: Tensor = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    return lora.head_weight(model, weight)


def wrap_ddp(
    tc: TransformerConfig, model: GPTModel, *, distributed_optimizer: bool
) -> DistributedDataParallel:
    """megatron's DDP: fp32 main gradients (``main_grad``) whatever the parameters' dtype,
    summed over DP x CP (all-reduced, or reduce-scattered under the distributed optimizer)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=False,
    )
    with megatron_cpu.cuda_to_cpu():
        return DistributedDataParallel(config=tc, ddp_config=ddp_config, module=model)


def set_hyperparameters(optimizer: Any, o: OptimizerConfig) -> None:
    """AdamW's learning rate, betas, eps and weight decay for the next update, on every param
    group (megatron's multipliers kept: norms and biases take no weight decay)."""
    for group in optimizer.param_groups:
        group["lr"] = o.lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = o.weight_decay * group.get("wd_mult", 1.0)
        group["betas"] = (o.beta1, o.beta2)
        group["eps"] = o.eps


def build_optimizer(cfg: EngineConfig, chunks: list[DistributedDataParallel], *, bf16: bool) -> Any:
    """megatron's AdamW over ``chunks``, in torch's fused form: with ``bf16``, fp32 master
    weights (no loss scale: bf16 has fp32's exponent range); with the distributed optimizer,
    sharded over DP x CP."""
    o = cfg.optimizer
    oc = MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        # Clipping is done by the engine (megatron's clip asserts CUDA tensors).
        clip_grad=0.0,
        bf16=bf16,
        fp16=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    with megatron_cpu.cuda_to_cpu():
        optimizer = get_megatron_optimizer(oc, chunks)
    # Without TransformerEngine or apex megatron picks torch's foreach AdamW: the fused one is
    # the same update in a few launches (workers/engine/optim_phase.py).
    use_fused_adamw(optimizer)
    return optimizer


def drop_forward_state(chunks: Sequence[torch.nn.Module]) -> None:
    """Forget the tensors megatron's MoE token dispatchers keep from their last forward (the
    routing probabilities, with their autograd graph). That graph holds the parameters and
    DDP's gradient hooks from C++, so the model, and every process group it names, stays alive
    after the shard is dropped (measured: 48 gloo threads per MoE shard, never freed)."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None:
                continue
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor):
                    setattr(dispatcher, name, None)
