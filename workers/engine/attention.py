"""Core attention for packed sequences and prefix tries, given to megatron-core's layer spec.

megatron-core's local ``DotProductAttention`` refuses packed (THD) input and context
parallelism; TransformerEngine's attention needs CUDA. This module attends causally within each
packed sequence with torch's ``scaled_dot_product_attention``, one sequence at a time, so no
``[T, T]`` mask is ever built; with CP it gathers keys and values over the CP group and masks
by global (zigzag) positions. A micro-batch packed as prefix tries attends by ancestry
(``workers/ops/tree_attention.py``): segment by segment on the CPU, one FlexAttention kernel
over the tree's block mask on CUDA.

Rotary positions are applied here, from each token's position id (``rope_freqs``), not by
megatron from the packed length: a trie token's position is its depth, not its index. megatron's
own rotary embedding is switched off (``workers/engine/model.py``); the formula is its own
(``apply_rotary_pos_emb``), so flat sequences get the same values bit for bit.

Shapes (``t`` = packed tokens on this rank, ``np`` / ``ng`` = query heads / key-value groups
on this TP rank, ``hn`` = head dim):
    packed:   query ``[t, np, hn]``, key/value ``[t, ng, hn]`` -> ``[t, np * hn]``
    unpacked: query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]`` -> ``[s, b, np * hn]``
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from trainctl.workers.ops.cp import gather_from_cp, zigzag_positions
from trainctl.workers.ops.tree_attention import Segments, flex_tree_attention, tree_attention


@dataclass
class PackedBatchParams(PackedSeqParams):
    """megatron's packed-sequence parameters plus what our attention reads: the rotary
    frequencies of this rank's tokens and, for prefix tries, the segment table."""

    rope: Tensor | None = None
    """``[t, 1, rot_dim]`` fp32 rotary frequencies by position id (``rope_freqs``)."""
    tree: Segments | None = None


def rope_freqs(rope: RotaryEmbedding, positions: Tensor) -> Tensor:
    """megatron's rotary frequencies (``RotaryEmbedding.get_emb``) at ``positions [t]``
    instead of at ``0..t-1``: ``[t, 1, rot_dim]``, row ``i`` equal to ``get_emb``'s row
    ``positions[i]``, bit for bit (the same ``outer`` of the same values)."""
    if rope.rotary_interleaved or rope.seq_len_interpolation_factor is not None:
        raise NotImplementedError("interleaved or interpolated rotary embeddings")
    inv_freq = rope.inv_freq
    freqs = torch.outer(positions.to(device=inv_freq.device, dtype=inv_freq.dtype), inv_freq)
    # megatron keeps inv_freq where it was built (the host, under CPU initialisation).
    return torch.cat((freqs, freqs), dim=-1)[:, None, :].to(positions.device)


class PackedCoreAttention(MegatronModule):
    """Causal attention within each packed sequence (``cu_seqlens``), drop-in for megatron."""

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

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """``q [b, np, sq, hn]``, ``k/v [b, ng, sk, hn]`` -> ``[b, np, sq, hn]``.

        Causal (``sq == sk``) unless ``mask [sq, sk]`` (True = attend) is given."""
        if self.heads != self.groups:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
        )

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
        if packed_seq_params is None:
            # [s, b, h, d] -> [b, h, s, d]
            out = self._attend(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

        if not isinstance(packed_seq_params, PackedBatchParams) or packed_seq_params.rope is None:
            raise ValueError("packed attention needs PackedBatchParams with rotary frequencies")
        rope = packed_seq_params.rope
        query = apply_rotary_pos_emb(query, rope, self.config, cp_group=self.cp_group)
        key = apply_rotary_pos_emb(key, rope, self.config, cp_group=self.cp_group)
        cu = packed_seq_params.cu_seqlens_q
        if packed_seq_params.cu_seqlens_q_padded is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
        if packed_seq_params.tree is not None:
            query_pos, query_key = None, None
            if self.cp_size > 1:
                # The tries are zigzag-split like sequences: gather every row's keys and
                # values, and mask this rank's queries by ancestry over global rows.
                assert self.cp_group is not None
                key = gather_from_cp(key, cu, self.cp_group)
                value = gather_from_cp(value, cu, self.cp_group)
                query_key = self.cp_group.rank()
                query_pos = zigzag_positions(cu, self.cp_size, query_key)
            dropout_p = self.dropout_p if self.training else 0.0
            tree = packed_seq_params.tree
            if query.is_cuda and dropout_p == 0.0:
                # One FlexAttention kernel over the tree's block mask (no dropout there).
                out = flex_tree_attention(
                    query, key, value, tree, scale=self.softmax_scale, query_pos=query_pos,
                    query_key=query_key,
                )  # fmt: skip
            else:
                out = tree_attention(
                    query, key, value, tree, scale=self.softmax_scale, dropout_p=dropout_p,
                    query_pos=query_pos,
                )  # fmt: skip
            return out.reshape(out.shape[0], -1)
        if self.cp_size > 1:
            return self._forward_cp(query, key, value, cu)
        outs = []
        for start, end in itertools.pairwise(cu.tolist()):
            if end == start:
                continue
            # [len, h, d] -> [1, h, len, d]
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs.append(self._attend(q, k, v)[0].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def _forward_cp(self, query: Tensor, key: Tensor, value: Tensor, cu: Tensor) -> Tensor:
        """Context parallelism: this rank holds the zigzag chunks ``r`` and ``2c-1-r`` of every
        sequence (``cu`` = global padded boundaries). Keys and values are gathered over the CP
        group (backward sends their gradients home); the causal mask compares *global*
        positions inside each sequence."""
        group = self.cp_group
        assert group is not None
        c, r = self.cp_size, group.rank()
        k_all = gather_from_cp(key, cu, group)  # [T, ng, hn], global order
        v_all = gather_from_cp(value, cu, group)
        outs = []
        for start, end in itertools.pairwise(cu.tolist()):
            length = end - start
            if length == 0:
                continue
            h = length // (2 * c)
            local = slice(start // c, start // c + 2 * h)
            late = 2 * c - 1 - r
            dev = query.device
            q_pos = torch.cat(
                [
                    torch.arange(r * h, (r + 1) * h, device=dev),
                    torch.arange(late * h, (late + 1) * h, device=dev),
                ]
            )
            allowed = q_pos[:, None] >= torch.arange(length, device=dev)[None, :]  # [2h, L]
            q = query[local].transpose(0, 1).unsqueeze(0)
            k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (k_all, v_all))
            outs.append(self._attend(q, k, v, mask=allowed)[0].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)
