"""Rank functions for the collective-in-step tests: dummy micro-batches and zero-token experts
keep every rank's all-reduces matched (docs/algorithms.md §2, §5)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from trainctl.workers.ops.grouped_linear import GroupedLinear
from trainctl.workers.ops.loss import connected_zero

from ops_cases import V, grid


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, V))


def dp_sync_dummy_case() -> bool:
    """Rank 0: 2 real micro-batches; rank 1: 1 real + 1 dummy. Summed grads == real data only."""
    g = grid(dp=2)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, V, (9,), generator=gen) for _ in range(3)]  # mb0, mb1 | mb2
    n_total = sum(b.numel() - 1 for b in batches)

    def mb_loss(model: nn.Module, toks: Tensor) -> Tensor:
        out = model(toks[:-1])
        return F.cross_entropy(out, toks[1:], reduction="sum") / n_total

    model = _tiny_model()
    mine = batches[:2] if g.coords["dp"] == 0 else batches[2:]
    for toks in mine:
        mb_loss(model, toks).backward()
    if g.coords["dp"] == 1:  # the dummy: same number of forward/backward passes
        connected_zero(model(torch.zeros(4, dtype=torch.long))).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=g.groups["dp"])
    ref = _tiny_model()
    for toks in batches:
        mb_loss(ref, toks).backward()
    return all(
        torch.allclose(p.grad, q.grad, atol=1e-7)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


def grouped_ddp_case() -> bool:
    """Rank 0 routes no token to any expert, rank 1 does: the per-parameter all-reduce completes
    and equals rank 1's gradients."""
    g = grid(dp=2)
    torch.manual_seed(0)
    layer = GroupedLinear(4, 6, 5, bias=True)
    m = [0, 0, 0, 0] if g.coords["dp"] == 0 else [2, 0, 3, 1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(m), 6, generator=gen)
    layer(x, m).pow(2).sum().backward()
    mine = [p.grad.clone() for p in layer.parameters()]
    for p in layer.parameters():
        dist.all_reduce(p.grad, group=g.groups["dp"])
    theirs = [torch.empty_like(t) for t in mine]
    for t, buf in zip(mine, theirs, strict=True):
        gathered = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(gathered, t, group=g.groups["dp"])
        buf.copy_(gathered[1])
    return all(torch.equal(p.grad, t) for p, t in zip(layer.parameters(), theirs, strict=True))
