"""Base requests on a CPU engine with LoRA enabled get no adapter's weights.

vLLM marks a token of a request without an adapter with LoRA slot index ``-1``. Its GPU kernels
skip such tokens. Its CPU path (vLLM 0.32, ``vllm/lora/ops/torch_ops``, called by
``PunicaWrapperCPU``) selects ``weights[indices]``, and Python reads ``-1`` as the *last* slot:
with ``max_loras=1`` that is whichever adapter the engine activated last. The prefill of a
batch with no adapter at all is skipped, but the decode steps and the LoRA LM head are not, so
a base request got an adapter's update on every generated token, and on its prompt's logits
when the adapter trains the unembedding (measured: base log-probs of -5.2e26 after an adapter
with alpha 1e30 was trained, never sampled).

``install`` replaces the six CPU ops ``PunicaWrapperCPU`` calls with the same products over a
selection that is all zeros where the index is negative, so such a token gets exactly no update
(``torch.where``, not a multiplication: an adapter's inf or NaN stays out too). Adapter tokens
get the same products as before. It runs inside the engine's process, before the engine is
built; nothing else of vLLM changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _selected(weights: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """``weights[indices]`` as ``[tokens, out, in]``, all zeros where ``indices < 0``."""
    sel = weights[indices.clamp(min=0)]
    if sel.dim() == 4:
        sel = sel.squeeze(1)
    sel = sel.to(dtype)
    return torch.where((indices >= 0).view(-1, 1, 1), sel, torch.zeros((), dtype=dtype))


def bgmv_shrink(
    inputs: Tensor, weights: Tensor, output: Tensor, indices: Tensor, scaling: float = 1.0
) -> None:
    """``output[:, :r] = scaling * inputs @ A[idx]^T`` per token (0 for an index of -1)."""
    lora = _selected(weights, indices, output.dtype)
    out = torch.einsum("bi, boi -> bo", inputs.to(output.dtype), lora)
    output[:, : out.shape[1]] = scaling * out


def bgmv_expand(
    inputs: Tensor, weights: Tensor, output: Tensor, indices: Tensor, add_inputs: bool = True
) -> None:
    """``output += inputs @ B[idx]^T`` per token (or ``=``), over the columns both have."""
    lora = _selected(weights, indices, output.dtype)
    out = torch.einsum("bi, boi -> bo", inputs.to(output.dtype), lora)
    rows = 1 if out.shape[0] == 1 and output.shape[0] != 1 else output.shape[0]
    cols = min(out.shape[1], output.shape[1])
    if add_inputs:
        output[:, :cols] += out[:rows, :cols]
    else:
        output[:, :cols] = out[:rows, :cols]


def bgmv_expand_slice(
    inputs: Tensor,
    weights: Tensor,
    output: Tensor,
    indices: Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """``bgmv_expand`` into the columns ``[slice_offset, slice_offset + slice_size)``."""
    lora = _selected(weights, indices, output.dtype)
    out = torch.einsum("bi, boi -> bo", inputs.to(output.dtype), lora)
    if add_inputs:
        output[:, slice_offset : slice_offset + slice_size] += out
    else:
        output[:, slice_offset : slice_offset + slice_size] = out


def _per_token(indices: Tensor, seq_lens: Tensor) -> Tensor:
    return torch.repeat_interleave(indices, seq_lens)


def sgmv_shrink(
    inputs: Tensor, weights: Tensor, output: Tensor, b_seq_start_loc: Tensor,
    seq_len_tensor: Tensor, lora_indices_tensor: Tensor, batches: int, max_seq_length: int,
    token_nums: int, scaling: float,
) -> None:  # fmt: skip
    bgmv_shrink(inputs, weights, output, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(
    inputs: Tensor, weights: Tensor, output: Tensor, b_seq_start_loc: Tensor,
    seq_len_tensor: Tensor, lora_indices_tensor: Tensor, batches: int, max_seq_length: int,
    token_nums: int, add_inputs: bool = False,
) -> None:  # fmt: skip
    idx = _per_token(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, weights, output, idx, add_inputs)


def sgmv_expand_slice(
    inputs: Tensor, weights: Tensor, output: Tensor, b_seq_start_loc: Tensor,
    seq_len_tensor: Tensor, lora_indices_tensor: Tensor, batches: int, max_seq_length: int,
    token_nums: int, slice_offset: int, slice_size: int, add_inputs: bool = False,
) -> None:  # fmt: skip
    idx = _per_token(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, weights, output, idx, slice_offset, slice_size, add_inputs)


GUARDED = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
    "sgmv_shrink": sgmv_shrink,
    "sgmv_expand": sgmv_expand,
    "sgmv_expand_slice": sgmv_expand_slice,
}


def install() -> dict[str, Any]:
    """Point vLLM's CPU LoRA wrapper at the guarded ops (idempotent); returns the ops it
    replaced, by name."""
    from vllm.lora.punica_wrapper import punica_cpu

    replaced = {}
    for name, fn in GUARDED.items():
        current = getattr(punica_cpu, name)
        if current is not fn:
            replaced[name] = current
            setattr(punica_cpu, name, fn)
    return replaced
