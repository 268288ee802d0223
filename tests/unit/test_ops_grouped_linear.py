"""Grouped linear with zero-token experts (docs/algorithms.md §5; T5.1, T5.3, T5.4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainctl.workers.ops.grouped_linear import GroupedLinear, WgradOptions, grouped_linear

E, K, N = 4, 6, 5
SPLITS = {"first": [0, 3, 2, 4], "last": [3, 2, 4, 0], "middle": [3, 0, 0, 4], "all": [0, 0, 0, 0]}


@pytest.mark.parametrize("empty", list(SPLITS))
@pytest.mark.parametrize("bias", [True, False])
def test_t5_1_empty_split(empty: str, bias: bool) -> None:
    torch.manual_seed(0)
    m = SPLITS[empty]
    layer = GroupedLinear(E, K, N, bias=bias)
    if bias:
        for b in layer.biases:
            torch.nn.init.normal_(b)
    x = torch.randn(sum(m), K, requires_grad=True)
    out = layer(x, m)
    assert out.shape == (sum(m), N)
    g = torch.randn_like(out)
    out.backward(g)
    # Reference: F.linear per expert with autograd.
    ref_w = [w.detach().clone().requires_grad_() for w in layer.weights]
    ref_b = [b.detach().clone().requires_grad_() for b in layer.biases] if bias else [None] * E
    xr = x.detach().clone().requires_grad_()
    ys = [F.linear(xe, w, b) for xe, w, b in zip(xr.split(m), ref_w, ref_b, strict=True)]
    torch.cat(ys).backward(g)
    torch.testing.assert_close(x.grad, xr.grad)
    params = list(layer.weights) + (list(layer.biases) if bias else [])
    refs = ref_w + (ref_b if bias else [])
    for e, (p, r) in enumerate(zip(params, refs, strict=True)):
        assert p.grad is not None and p.grad.shape == p.shape
        if m[e % E] == 0:
            assert torch.count_nonzero(p.grad) == 0
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad)


def _weights(fill: float = 1.0, marked: bool = True) -> list[torch.Tensor]:
    ws = []
    for _ in range(E):
        w = torch.randn(N, K, requires_grad=True)
        w.main_grad = torch.full((N, K), fill)  # type: ignore[attr-defined]
        if marked:
            w.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        ws.append(w)
    return ws


def test_t5_3_main_grad_semantics() -> None:
    m = [0, 0, 0, 0]
    ws = _weights()
    x = torch.randn(0, K, requires_grad=True)
    grouped_linear(x, m, ws, opts=WgradOptions(fuse_wgrad_accumulation=True)).sum().backward()
    for w in ws:  # accumulate: + 0
        assert torch.equal(w.main_grad, torch.ones(N, K))
        assert w.grad_added_to_main_grad is True
        assert w.grad is not None and w.grad.shape == w.main_grad.shape
    ws = _weights()
    opts = WgradOptions(fuse_wgrad_accumulation=True, overwrite_main_grad=True, zero_out_wgrad=True)
    grouped_linear(x, m, ws, opts=opts).sum().backward()
    for w in ws:  # overwrite: 0, never stale
        assert torch.count_nonzero(w.main_grad) == 0
        assert torch.count_nonzero(w.grad) == 0  # zero-filled dummy


def test_main_grad_accumulates_real_tokens() -> None:
    ws = _weights(fill=0.0, marked=False)
    x = torch.randn(3, K)
    grouped_linear(
        x, [1, 2, 0, 0], ws, opts=WgradOptions(fuse_wgrad_accumulation=True)
    ).sum().backward()
    torch.testing.assert_close(ws[0].main_grad, torch.ones(N, 1) @ x[:1])
    assert ws[0].grad is None  # fused without the DDP marker: by design


def test_main_grad_is_found_under_saved_tensor_hooks() -> None:
    """Saved-tensor hooks (activation offloading, a memory ledger) may hand backward another
    tensor object than the one saved, without the parameter's ``main_grad`` attribute: the
    fused wgrad still lands in each parameter's own ``main_grad``."""
    ws = _weights(fill=0.0)
    x = torch.randn(3, K)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        out = grouped_linear(x, [1, 2, 0, 0], ws, opts=WgradOptions(fuse_wgrad_accumulation=True))
    out.sum().backward()
    torch.testing.assert_close(ws[0].main_grad, torch.ones(N, 1) @ x[:1])
    assert all(w.grad_added_to_main_grad for w in ws)


def test_t5_4_zero_grad_dtype() -> None:
    layer = GroupedLinear(E, K, N, bias=True, dtype=torch.float64)
    x = torch.randn(2, K, dtype=torch.float64)
    layer(x, [2, 0, 0, 0]).sum().backward()
    for p in list(layer.weights) + list(layer.biases):
        assert p.grad.dtype == torch.float64
