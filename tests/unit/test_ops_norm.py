"""RMSNorm compiled (``compiled_rms_norm``, what ``norm_kernel: compiled`` runs) equals the
eager function in values and in both gradients, and compiles once for every pack size."""

from __future__ import annotations

import pytest
import torch

from trainctl.workers.ops.norm import compiled_rms_norm, rms_norm


@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero-centred"])
def test_compiled_equals_eager_and_compiles_once_for_every_pack_size(zero_centered: bool) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled_rms_norm.cache_clear()
    before = counters["stats"]["unique_graphs"]
    norm = compiled_rms_norm()
    g = torch.Generator().manual_seed(0)
    for tokens in (37, 100, 513):
        x = torch.randn(tokens, 1, 48, generator=g).requires_grad_()
        w = (torch.randn(48, generator=g) * 0.1 + (0.0 if zero_centered else 1.0)).requires_grad_()
        got = norm(x, w, 1e-6, zero_centered)
        want = rms_norm(x, w, 1e-6, zero_centered)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        dy = torch.randn(got.shape, generator=g)
        for a, b in zip(
            torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1, dict(counters["stats"])
