"""The lean LM head: its compiled passes (what CUDA runs) against the eager ones and float64,
and the memory traffic of forward + backward counted by the dispatcher: at most 5 fp32
``[chunk, V]`` units per 1,024 tokens, GEMMs included, and no fp32 ``[chunk, V]`` tensor
allocated. The compiled passes are compiled here for the CPU (a few seconds, once)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainctl.workers.ops import head_kernels
from trainctl.workers.ops.fused_head import fused_head_logprob, fused_head_loss, head_logits
from trainctl.workers.ops.logprob import vocab_parallel_logprob

N, H, V, CHUNK = 2048, 64, 16384, 1024
BUDGET = 5.0
"""fp32 ``[chunk, V]`` units of traffic per 1,024 tokens, forward and backward (issue 50)."""


@contextmanager
def kernels(k: head_kernels.HeadKernels) -> Iterator[None]:
    head_kernels.force_kernels(k)
    try:
        yield
    finally:
        head_kernels.force_kernels(None)


def _case(dtype: torch.dtype, seed: int = 0, n: int = N, v: int = V) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, H, generator=g) * 0.2).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    seed_w = torch.linspace(-1.0, 1.0, n)
    return hidden, weight, target, seed_w


GATHERS = ("aten::gather", "aten::index.Tensor", "aten::index_select")
"""Ops that read only the elements they return from their source."""
NO_TRAFFIC = ("aten::empty", "aten::empty_strided", "aten::new_empty")
"""Allocations: nothing is read or written."""


class Traffic(TorchDispatchMode):
    """Bytes each dispatched op reads (its tensor arguments) and writes (its outputs and the
    arguments it mutates); views and allocations move nothing, a gather reads what it returns.
    A ``trainctl::head_*`` pass is one op, as it is one kernel. Also every fp32 tensor an op
    makes with ``V`` columns and more than one row."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.bytes, self.vocab = 0, vocab
        self.fp32_chunks: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        if func.is_view or name.startswith(NO_TRAFFIC):
            return out
        gather = name.startswith(GATHERS)
        written: dict[int, torch.Tensor] = {}
        read: dict[int, torch.Tensor] = {}
        for arg, value in zip(schema.arguments, [*args, *kwargs.values()], strict=False):
            if not isinstance(value, torch.Tensor):
                continue
            mutable = arg.alias_info is not None and arg.alias_info.is_write
            if mutable:
                written[id(value)] = value
            if not (mutable and arg.is_out):
                read[id(value)] = value
        outs = out if isinstance(out, tuple | list) else [out]
        if gather:  # the source's returned elements, and the indices
            source = args[0]
            read[id(source)] = source.new_empty(0)
            self.bytes += outs[0].numel() * source.element_size()
        for t in outs:
            if isinstance(t, torch.Tensor):
                written[id(t)] = t
                chunk_sized = t.dim() == 2 and t.shape[0] > 1 and t.shape[-1] == self.vocab
                if chunk_sized and t.dtype == torch.float32:
                    self.fp32_chunks.append((str(func), tuple(t.shape)))
        self.bytes += sum(t.numel() * t.element_size() for t in (*read.values(), *written.values()))
        return out


def _traffic(k: head_kernels.HeadKernels) -> Traffic:
    hidden, weight, target, w = _case(torch.bfloat16)
    with kernels(k):
        fused_head_logprob(hidden, weight, target, chunk_size=CHUNK)  # compile outside the count
        mode = Traffic(V)
        with mode:
            lp = fused_head_logprob(hidden, weight, target, chunk_size=CHUNK)
            torch.autograd.grad((lp * w).sum(), (hidden, weight))
    return mode


def _units(mode: Traffic) -> float:
    return mode.bytes / (N / 1024) / (1024 * V * 4)


def test_the_compiled_head_moves_at_most_five_units_and_no_fp32_chunk() -> None:
    """bf16 at 2,048 tokens: the compiled passes keep the head under the budget and never make
    an fp32 copy of a chunk of logits. The eager passes (each widens the chunk to fp32, as the
    head did before) are counted by the same counter, and are over it."""
    lean = _traffic(head_kernels.COMPILED)
    assert _units(lean) <= BUDGET, _units(lean)
    assert lean.fp32_chunks == [], lean.fp32_chunks
    eager = _traffic(head_kernels.EAGER)
    assert _units(eager) > BUDGET, _units(eager)
    assert eager.fp32_chunks, "the eager passes widen each chunk"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_passes_agree_with_the_eager_ones(dtype: torch.dtype) -> None:
    """The same log-probs within fp32 rounding, and the same gradients to the operands' own
    rounding (bf16 gradients are bf16 numbers)."""
    hidden, weight, target, w = _case(dtype, seed=1, n=700, v=3000)
    got, want = {}, {}
    for name, k, into in (
        ("compiled", head_kernels.COMPILED, got),
        ("eager", head_kernels.EAGER, want),
    ):
        with kernels(k):
            lp = fused_head_logprob(hidden, weight, target, chunk_size=256)
            into["lp"] = lp.detach()
            into["dh"], into["dw"] = torch.autograd.grad((lp * w).sum(), (hidden, weight))
        assert into["lp"].dtype == torch.float32, name
    torch.testing.assert_close(got["lp"], want["lp"], rtol=0, atol=2e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for key in ("dh", "dw"):
        a, b = got[key].float(), want[key].float()
        torch.testing.assert_close(a, b, rtol=0, atol=tol * float(b.abs().max()))


def test_compiled_bf16_logprobs_are_float64s_and_its_gradients_the_unfused_ones() -> None:
    """Over the same bf16 logits, within 1e-5 of a float64 log-softmax; gradients equal the
    unfused head's (all logits, autograd) to bf16 rounding."""
    hidden, weight, target, w = _case(torch.bfloat16, seed=2, n=900, v=5000)
    with kernels(head_kernels.COMPILED):
        lp = fused_head_logprob(hidden, weight, target, chunk_size=512)
        got = torch.autograd.grad((lp * w).sum(), (hidden, weight))
    ref = torch.log_softmax((hidden @ weight.t()).double(), -1).gather(1, target[:, None])[:, 0]
    torch.testing.assert_close(lp.detach().double(), ref, rtol=0, atol=1e-5)
    unfused = vocab_parallel_logprob(head_logits(hidden, weight, torch.arange(900)), target)
    want = torch.autograd.grad((unfused * w).sum(), (hidden, weight))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * float(b.abs().max()))


def _share_of(scale: torch.Tensor) -> Any:
    def share_of(lp: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return (-lp * scale[a:b]).sum()

    return share_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_with_its_gradient_in_the_forward_equals_the_two_passes(
    dtype: torch.dtype,
) -> None:
    """``fused_head_loss`` (the head's gradient taken in the forward pass) against the fused
    log-probs then the loss then autograd: the same share and log-probs, the same gradients
    to fp32 rounding (bf16: to its own), times the loss's upstream gradient."""
    hidden, weight, target, _ = _case(dtype, seed=4, n=700, v=3000)
    scale = torch.rand(700, generator=torch.Generator().manual_seed(5)).double()
    share, lp = fused_head_loss(hidden, weight, target, _share_of(scale), chunk_size=256)
    assert not lp.requires_grad
    got = torch.autograd.grad(share * 1.5, (hidden, weight))
    ref_lp = fused_head_logprob(hidden, weight, target, chunk_size=256)
    ref_share = (-ref_lp * scale).sum()
    want = torch.autograd.grad(ref_share * 1.5, (hidden, weight))
    assert torch.equal(lp, ref_lp.detach())
    torch.testing.assert_close(share, ref_share.detach(), rtol=1e-12, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * float(b.abs().max()))


def test_the_loss_in_the_forward_moves_less_than_the_two_passes() -> None:
    """One matmul's logits fewer per chunk: the backward recomputes nothing."""
    hidden, weight, target, w = _case(torch.bfloat16)
    scale = w.abs().double()
    with kernels(head_kernels.COMPILED):
        fused_head_loss(hidden, weight, target, _share_of(scale), chunk_size=CHUNK)  # compile
        in_forward = Traffic(V)
        with in_forward:
            share, _ = fused_head_loss(hidden, weight, target, _share_of(scale), chunk_size=CHUNK)
            torch.autograd.grad(share, (hidden, weight))
    two_pass = _traffic(head_kernels.COMPILED)
    saved = _units(two_pass) - _units(in_forward)
    assert saved >= 0.5, (_units(two_pass), _units(in_forward))  # at least a chunk's logits
