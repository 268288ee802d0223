"""Core attention for packed sequences and prefix tries, given to megatron-core's layer spec.

megatron-core's local ``DotProductAttention`` refuses packed (THD) input and context
parallelism; TransformerEngine's attention needs CUDA. This module hands packed sequences to
``workers/ops/packed_attention.py``: one flash-attention call over the whole buffer on CUDA
(varlen), else one batched ``scaled_dot_product_attention`` per run of equal lengths, on views,
so the cost is linear in the tokens whatever the number of sequences and no ``[T, T]`` mask is
ever built. With CP it gathers keys and values over the CP group and masks by global (zigzag)
positions. A micro-batch packed as prefix tries attends by ancestry
(``workers/ops/tree_attention.py``): segment by segment on the CPU, one FlexAttention kernel
over the tree's block mask on CUDA.

Rotary positions are applied here, from each token's position id (``rope_tables``), not by
megatron from the packed length: a trie token's position is its depth, not its index. megatron's
own rotary embedding is switched off (``workers/engine/model.py``); the formula is its own
(``workers/ops/rope.py``), so flat sequences get the same values bit for bit in eager mode. The
tables (``cos``, ``sin``) are made once per micro-batch. Qwen3's q/k norms are applied here too,
just before the rotation (megatron's are deferred: ``DeferredRMSNorm``): on CUDA the norm and the
rotation are one compiled kernel each way.

The packing metadata is host integers (``PackedBatchParams.cu_host``, ``max_len``) plus one
int32 device copy of the boundaries for the varlen kernel: no layer reads a device tensor on
the host.

Shapes (``t`` = packed tokens on this rank, ``np`` / ``ng`` = query heads / key-value groups
on this TP rank, ``hn`` = head dim):
    packed:   query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np * hn]``
    unpacked: query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]`` -> ``[s, b, np * hn]``
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from trainctl.workers.ops.cp import gather_from_cp, zigzag_positions
from trainctl.workers.ops.packed_attention import cp_packed_attention, packed_attention, sdpa
from trainctl.workers.ops.rope import RotaryTables, rotation_for
from trainctl.workers.ops.tree_attention import Segments, flex_tree_attention, tree_attention


@dataclass
class PackedBatchParams(PackedSeqParams):  # type: ignore[misc]  # megatron-core ships no types
    """megatron's packed-sequence parameters plus what our attention reads: the boundaries as
    host integers, the rotary tables of this rank's tokens and, for prefix tries, the segment
    table."""

    cu_host: tuple[int, ...] = ()
    """The global padded boundaries (``cu_seqlens_q``'s values), read without a device sync."""
    max_len: int = 0
    """The longest packed sequence (``max_seqlen_q``'s value)."""
    cu_device: Tensor | None = None
    """``cu_host`` as int32 on the compute device, for the varlen kernel (CUDA only)."""
    rope: RotaryTables | None = None
    """``cos``/``sin`` ``[t, 1, rot_dim]`` by position id (``rope_tables``)."""
    tree: Segments | None = None


def rope_tables(rope: RotaryEmbedding, positions: Tensor, dtype: torch.dtype) -> RotaryTables:
    """megatron's rotary frequencies (``RotaryEmbedding.get_emb``) at ``positions [t]``
    instead of at ``0..t-1``, as ``cos``/``sin`` tables ``[t, 1, rot_dim]`` in ``dtype``: row
    ``i`` equal to ``get_emb``'s row ``positions[i]``, bit for bit (the same ``outer`` of the
    same values). Computed where ``positions`` are: the shard keeps ``inv_freq`` there."""
    if rope.rotary_interleaved or rope.seq_len_interpolation_factor is not None:
        raise NotImplementedError("interleaved or interpolated rotary embeddings")
    inv_freq = rope.inv_freq
    freqs = torch.outer(positions.to(dtype=inv_freq.dtype), inv_freq.to(positions.device))
    return RotaryTables.of(torch.cat((freqs, freqs), dim=-1)[:, None, :], dtype)


def _unpinned(x: Tensor, kept: bool = True) -> Tensor:
    """``x`` in storage of its own where something keeps it for backward (``kept``: the
    value always, by the attention kernel; a query or key where a norm precedes its
    rotation).

    megatron's ``query``, ``key`` and ``value`` are views of the fused projection's output
    ``[t, groups, (heads / groups + 2) x dim]`` (the query copied out where a reshape could
    not view it: grouped heads). A view kept for backward keeps that whole buffer alive until
    the layer's backward: at Qwen3-0.6B's widths the k norm's input and the kernel's value,
    4 KB a token, held 8 KB (``bench/saved_activations.py``). Copied out, the buffer goes
    when the layer's forward ends. A view that nothing keeps (a query or key without a norm:
    the rotation keeps only its tables) is left as it is."""
    if not kept or x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.contiguous()


class PackedCoreAttention(MegatronModule):  # type: ignore[misc]  # megatron-core ships no types
    """Causal attention within each packed sequence (``cu_seqlens``), drop-in for megatron. Owns no
    parameters: the heads' shapes and the CP group it attends over."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        tp_size = pg_collection.tp.size() if pg_collection is not None else 1
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.heads = divide(config.num_attention_heads, tp_size)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp_size)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self._bound: tuple[RotaryEmbedding, Any, Any] | None = None

    def bind(self, rotary: RotaryEmbedding, q_norm: Any, k_norm: Any) -> None:
        """What this module applies to the query and key before attending (``build_gpt``):
        the model's rotary frequencies, and the layer's q/k norms where megatron's were
        deferred to here (``DeferredRMSNorm``; None: no norm). Held outside ``nn.Module``'s
        registry: the modules stay where they are, under their own names."""
        self._bound = (rotary, q_norm, k_norm)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _norm_rope(self, x: Tensor, norm: Any, tables: RotaryTables) -> Tensor:
        """The q (or k) norm, if any, then the rotation: one compiled kernel each way on CUDA,
        the eager ops (bit for bit megatron's norm and rotation) elsewhere."""
        rotate, norm_rotate = rotation_for(x)
        if norm is None:
            return rotate(x, tables.cos, tables.sin)
        return norm_rotate(x, norm.weight, norm.eps, tables.cos, tables.sin, norm.zero_centered)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias")
        if self._bound is None:
            raise RuntimeError("PackedCoreAttention is used unbound (build_gpt binds it)")
        rotary, q_norm, k_norm = self._bound
        query, key = _unpinned(query, q_norm is not None), _unpinned(key, k_norm is not None)
        value = _unpinned(value)
        if packed_seq_params is None:
            # One plain sequence per batch row: positions 0..s-1, then [s, b, h, d] ->
            # [b, h, s, d].
            s, b = query.shape[0], query.shape[1]
            pos = torch.arange(s, device=query.device)
            tab = rope_tables(rotary, pos, query.dtype)
            tab = RotaryTables(cos=tab.cos[:, None], sin=tab.sin[:, None])  # over b too
            query, key = self._norm_rope(query, q_norm, tab), self._norm_rope(key, k_norm, tab)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = sdpa(q, k, v, scale=self.softmax_scale, dropout_p=self._dropout())
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

        p = packed_seq_params
        if not isinstance(p, PackedBatchParams) or p.rope is None or not p.cu_host:
            raise ValueError("packed attention needs PackedBatchParams with rotary tables")
        query = self._norm_rope(query, q_norm, p.rope)
        key = self._norm_rope(key, k_norm, p.rope)
        if p.tree is not None:
            out = self._forward_tree(query, key, value, p)
        elif self.cp_size > 1:
            assert self.cp_group is not None
            cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
            out = cp_packed_attention(
                query, gather_from_cp(key, cu, self.cp_group),
                gather_from_cp(value, cu, self.cp_group), p.cu_host, cp_size=self.cp_size,
                cp_rank=self.cp_group.rank(), scale=self.softmax_scale,
                dropout_p=self._dropout(),
            )  # fmt: skip
        else:
            out = packed_attention(
                query, key, value, p.cu_host, scale=self.softmax_scale,
                dropout_p=self._dropout(), cu_device=p.cu_device, max_len=p.max_len,
            )  # fmt: skip
        return out.reshape(out.shape[0], -1)

    def _forward_tree(
        self, query: Tensor, key: Tensor, value: Tensor, p: PackedBatchParams
    ) -> Tensor:
        tree = p.tree
        assert tree is not None
        cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        query_pos, query_key = None, None
        if self.cp_size > 1:
            # The tries are zigzag-split like sequences: gather every row's keys and
            # values, and mask this rank's queries by ancestry over global rows.
            assert self.cp_group is not None
            key = gather_from_cp(key, cu, self.cp_group)
            value = gather_from_cp(value, cu, self.cp_group)
            query_key = self.cp_group.rank()
            query_pos = zigzag_positions(cu, self.cp_size, query_key)
        dropout_p = self._dropout()
        if query.is_cuda and dropout_p == 0.0:
            # One FlexAttention kernel over the tree's block mask (no dropout there).
            return flex_tree_attention(
                query, key, value, tree, scale=self.softmax_scale, query_pos=query_pos,
                query_key=query_key,
            )  # fmt: skip
        return tree_attention(
            query, key, value, tree, scale=self.softmax_scale, dropout_p=dropout_p,
            query_pos=query_pos,
        )  # fmt: skip
