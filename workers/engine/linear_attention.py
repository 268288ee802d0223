"""Gated DeltaNet (Qwen3.5's linear attention) over packed sequences: megatron-core's layer,
driven for our packing.

megatron-core 0.16.1's ``GatedDeltaNet`` builds the layer: its input projection, causal
convolution, ``dt_bias``, ``A_log``, output norm and output projection. Its pure-torch chunked
delta rule (``torch_chunk_gated_delta_rule``) is the recurrence. Its own forward refuses packed
sequences, and imports the flash-linear-attention package for its L2 norm even where the torch
rule runs. This subclass keeps the module, its parameters and the rule, and replaces only the
forward:

* each packed sequence becomes one row of a right-padded batch, so the convolution and the
  recurrence start afresh at every sequence and never see another's tokens. The pads come after
  a sequence's tokens, and both are causal, so the pads change nothing before them;
* the projection's rows, and the convolution's channels, are grouped by key head (``gdn`` in
  ``workers/engine/families.py``). A contiguous TP split then keeps whole groups, and one rank's
  slice reads as ``[groups, q | k | v | z | b | a]``;
* q and k are L2-normalised as transformers does (``x / sqrt(sum(x^2) + 1e-6)``).

Under sequence parallelism the input projection all-gathers the tokens and the output projection
reduce-scatters them, as megatron's linear layers do for attention. Context parallelism and
prefix tries are refused before a model is built (``workers/engine/config.py``).

Shapes: ``T`` packed tokens, ``B`` packed sequences, ``L`` the longest, ``G`` key-head groups
on this TP rank, ``r`` value heads per key head, ``dk`` / ``dv`` head sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule
from torch import Tensor


@contextlib.contextmanager
def _no_fla_needed() -> Iterator[None]:
    """megatron's constructor refuses to build without flash-linear-attention installed; our
    forward never calls it."""
    have = gated_delta_net.HAVE_FLA
    gated_delta_net.HAVE_FLA = True
    try:
        yield
    finally:
        gated_delta_net.HAVE_FLA = have


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class PackedGatedDeltaNet(GatedDeltaNet):  # type: ignore[misc]  # megatron-core ships no types
    """megatron's Gated DeltaNet over packed sequences. Owns its layer's parameters (megatron's)
    and the output norm."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("attn_mask_type", None)
        with _no_fla_needed():
            super().__init__(*args, **kwargs)
        # The output norm's weight is shared by this rank's heads, other heads on other TP
        # ranks: megatron's finalize_model_grads sums the gradients of weights marked so.
        self.out_norm.weight.sequence_parallel = self.tp_size > 1

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``hidden_states [t, 1, H]`` (``[s, b, H]`` unpacked) -> the layer's output and
        its output projection's bias (None)."""
        x, _bias = self.in_proj(hidden_states)  # [T, b, local]: all tokens under SP
        tokens, batch = x.shape[0], x.shape[1]
        if packed_seq_params is not None:
            if getattr(packed_seq_params, "tree", None) is not None:
                raise ValueError("Gated DeltaNet layers cannot run over prefix tries")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            rows, valid = _rows_of(cu.to(x.device), tokens)
            seqs = x[:, 0][rows] * valid[..., None]  # [B, L, local]
        else:
            seqs, valid = x.transpose(0, 1), None
        out = self._mix(seqs)  # [B, L, G * r * dv]
        out = out[valid] if valid is not None else out.transpose(0, 1)
        out = out.reshape(tokens, batch, -1)
        projected: tuple[Tensor, Tensor | None] = self.out_proj(out)  # (out, bias)
        return projected

    def _mix(self, x: Tensor) -> Tensor:
        """One padded batch ``[B, L, local]`` of the projection's output -> the gated, normed
        output of the delta rule ``[B, L, G * r * dv]``."""
        b, length = x.shape[0], x.shape[1]
        groups = self.num_key_heads // self.tp_size
        r = self.num_value_heads // self.num_key_heads
        dk, dv = self.key_head_dim, self.value_head_dim
        x = x.reshape(b, length, groups, 2 * dk + 2 * r * dv + 2 * r)
        qkv, z, beta, alpha = x.split([2 * dk + r * dv, r * dv, r, r], dim=-1)
        # The causal convolution, channel by channel, over [q | k | v] of each group.
        mixed = qkv.reshape(b, length, -1).transpose(1, 2)
        mixed = self.act_fn(self.conv1d(mixed)[..., :length]).transpose(1, 2)
        q, k, v = mixed.reshape(b, length, groups, -1).split([dk, dk, r * dv], dim=-1)
        q = _l2norm(q).repeat_interleave(r, dim=2)
        k = _l2norm(k).repeat_interleave(r, dim=2)
        v = v.reshape(b, length, groups * r, dv)
        heads = groups * r
        g = -self.A_log.float().exp() * F.softplus(
            alpha.reshape(b, length, heads).float() + self.dt_bias
        )
        out, _ = torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta.reshape(b, length, heads).sigmoid(),
            use_qk_l2norm_in_kernel=False,
        )  # fmt: skip
        # The output norm per head, gated by silu(z) in fp32 (megatron's _apply_gated_norm).
        y: Tensor = self.out_norm(out.reshape(-1, dv))
        y = y * self.act_fn(z.reshape(-1, dv).float())
        return y.to(out.dtype).reshape(b, length, heads * dv)


def _rows_of(cu: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """Packed boundaries ``cu [B + 1]`` -> ``rows [B, L]`` (each sequence's packed rows,
    right-padded with valid row indices) and ``valid [B, L]`` (False at the padding)."""
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    steps = torch.arange(longest, device=cu.device)
    valid = steps[None, :] < lengths[:, None]
    rows = (cu[:-1, None] + steps[None, :]).clamp(max=max(tokens - 1, 0))
    return rows, valid
