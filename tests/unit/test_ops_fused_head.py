"""The fused LM head + log-prob against the unfused path (all logits, ``head_logits``, then
the log-prob kernel): equal log-probs bit for bit, equal entropy, the hidden-state gradient and
the head's weight gradient within fp32 rounding, and a row map serving one hidden row to
several targets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainctl.workers.ops.fused_head import (
    ROW_BLOCK,
    fused_head_entropy,
    fused_head_logprob,
    head_logits,
)
from trainctl.workers.ops.logprob import vocab_parallel_entropy, vocab_parallel_logprob

N, H, V = 3 * ROW_BLOCK + 45, 256, 1024
GRAD_RTOL = 1e-5
"""The weight gradient sums tokens chunk by chunk, the unfused one in one matmul: fp32
rounding of a sum of ~800 terms, held to 1e-5 of the gradient's largest element."""


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.2).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, target


def _grads(lp: torch.Tensor, *params: torch.Tensor) -> list[torch.Tensor]:
    w = torch.linspace(-1.0, 1.0, lp.shape[0])
    return list(torch.autograd.grad((lp * w).sum(), params))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(b.abs().max()))


@pytest.mark.parametrize("chunk", [0, 1, ROW_BLOCK, 2 * ROW_BLOCK + 1, 10_000])
def test_equal_to_the_unfused_path(chunk: int) -> None:
    hidden, weight, target = _case()
    logits = head_logits(hidden, weight, torch.arange(N))
    want = vocab_parallel_logprob(logits, target, chunk_size=ROW_BLOCK)
    got = fused_head_logprob(hidden, weight, target, chunk_size=chunk)
    assert torch.equal(got, want)
    for a, b in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        _close(a, b)


def test_a_row_map_serves_one_hidden_row_to_several_targets() -> None:
    hidden, weight, target = _case(1)
    rows = torch.cat([torch.arange(N), torch.tensor([0, 5, 5, N - 1])])  # branch points
    tgt = torch.cat([target, target[:4]])
    want = vocab_parallel_logprob(head_logits(hidden, weight, rows), tgt)
    got = fused_head_logprob(hidden, weight, tgt, rows=rows, chunk_size=3)
    assert torch.equal(got, want)
    for a, b in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        _close(a, b)
    with pytest.raises(ValueError, match="rows"):
        fused_head_logprob(hidden, weight, tgt, rows=rows[:-1])


def test_entropy_equal_to_the_unfused_path() -> None:
    hidden, weight, _ = _case(2)
    want = vocab_parallel_entropy(head_logits(hidden, weight, torch.arange(N)), chunk_size=64)
    assert torch.equal(fused_head_entropy(hidden, weight, chunk_size=ROW_BLOCK), want)


def test_bf16_inputs_give_fp32_logprobs_and_gradients_of_their_dtype() -> None:
    """Mixed precision: bf16 hidden states and weight give bf16 logits (the matmul's output,
    as megatron's output layer and transformers give them), but the softmax and the log-probs
    are fp32. Against float64 over the same bf16 logits the error is fp32's (~1e-6), where a
    log-prob rounded to bf16 would be off by ~1e-2."""
    hidden, weight, target = _case()
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    lp = fused_head_logprob(h16, w16, target, chunk_size=ROW_BLOCK)
    assert lp.dtype == torch.float32
    want = torch.log_softmax((h16 @ w16.t()).double(), dim=-1)
    want = want.gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)
    dh, dw = _grads(lp, h16, w16)
    assert (dh.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16)


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the operands of every matrix product that runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2], args[-1]
            self.seen.append((func.overloadpacket.__name__, a.dtype, b.dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_backward_runs_its_matmuls_in_bf16_like_the_unfused_head() -> None:
    """The backward's two products per chunk (``dlogits W`` and ``dlogits^T h``) take bf16
    operands, as autograd's do through the unfused head: fp32 operands made them fp32 GEMMs,
    several times slower on a GPU. The gradients agree with the unfused path's to bf16."""
    hidden, weight, target = _case(3)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    want = _grads(vocab_parallel_logprob(head_logits(h16, w16, torch.arange(N)), target), h16, w16)
    lp = fused_head_logprob(h16, w16, target, chunk_size=ROW_BLOCK)
    with _MatmulDtypes() as mode:
        got = _grads(lp, h16, w16)
    assert mode.seen, "the backward ran no matrix product"
    assert all(a == b == torch.bfloat16 for _, a, b in mode.seen), mode.seen
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * float(b.abs().max()))
