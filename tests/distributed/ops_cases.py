"""Functions the rank pool runs for the parallel-math tests, with their single-process references.

Every rank builds the same global data from a seed, keeps its own share, runs the parallel op
with explicit process groups, and compares against a float64 computation of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainctl.api import LossConfig, TokenSequence
from trainctl.api.models import LossKind, Normalization
from trainctl.workers.control.plan import pack, sequence_scales
from trainctl.workers.engine.inputs import packed_tokens
from trainctl.workers.ops.aggregate import aggregate_loss
from trainctl.workers.ops.cp import gather_from_cp, split_for_cp
from trainctl.workers.ops.logprob import vocab_parallel_logprob
from trainctl.workers.ops.loss import connected_zero, local_loss, per_token_terms

# -- process groups -------------------------------------------------------------------------

_AXES = ("tp", "cp", "dp", "pp")  # megatron's order: TP fastest


@dataclass
class Grid:
    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, Any]  # "tp", "cp", "dp", "pp", "dpcp"

    def src_of(self, axis: str) -> int:
        """Global rank of coordinate 0 along ``axis`` in this rank's group."""
        stride = 1
        for a in _AXES:
            if a == axis:
                break
            stride *= self.sizes[a]
        return dist.get_rank() - self.coords[axis] * stride


def grid(tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1) -> Grid:
    """This rank's coordinates and groups; every rank creates every group in the same order.

    The groups live for one case: the rank pool destroys them when the case returns."""
    key = (tp, cp, dp, pp)
    sizes = dict(zip(_AXES, key, strict=True))
    world = tp * cp * dp * pp
    assert world == dist.get_world_size(), (sizes, dist.get_world_size())

    def coords(r: int) -> dict[str, int]:
        out = {}
        for a in _AXES:
            out[a] = r % sizes[a]
            r //= sizes[a]
        return out

    me = coords(dist.get_rank())
    groups = {}
    for name, axes in (
        ("tp", {"tp"}),
        ("cp", {"cp"}),
        ("dp", {"dp"}),
        ("pp", {"pp"}),
        ("dpcp", {"dp", "cp"}),
    ):
        members: dict[tuple[int, ...], list[int]] = {}
        for r in range(world):
            c = coords(r)
            members.setdefault(tuple(c[a] for a in _AXES if a not in axes), []).append(r)
        mine = tuple(me[a] for a in _AXES if a not in axes)
        for k in sorted(members):
            g = dist.new_group(members[k])
            if k == mine:
                groups[name] = g
    return Grid(sizes, me, groups)


# -- vocab-parallel log-prob ----------------------------------------------------------------


def logprob_tp_case(b: int, s: int, v: int, cs: int, oov: bool) -> dict[str, Any]:
    g = grid(tp=dist.get_world_size())
    t, k = g.sizes["tp"], g.coords["tp"]
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(b, s, v, generator=gen)
    target = torch.randint(0, v, (b, s), generator=gen)
    if oov:
        target[:, ::4] = v + 3
    vt = v // t
    seed_grad = torch.linspace(0.5, 1.5, b * s).reshape(b, s)

    full = logits.double().requires_grad_()
    ref = torch.log_softmax(full, -1)
    inside = target < v
    # An out-of-vocabulary target has log-prob 0 and, as docs/algorithms.md §3 defines it, the
    # gradient of "no target": -softmax. -lse + lse.detach() is 0 with exactly that gradient.
    lse = torch.logsumexp(full, -1)
    no_target = -lse + lse.detach()
    ref_lp = torch.where(
        inside, ref.gather(-1, target.clamp(max=v - 1)[..., None])[..., 0], no_target
    )
    ref_lp.backward(seed_grad.double())

    out = {}
    for chunk in (0, cs):
        x = logits[..., k * vt : (k + 1) * vt].clone().requires_grad_()
        lp = vocab_parallel_logprob(
            x, target, vocab_start=k * vt, tp_group=g.groups["tp"], chunk_size=chunk
        )
        lp.backward(seed_grad)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            x.grad.double(), full.grad[..., k * vt : (k + 1) * vt], atol=1e-5, rtol=1e-4
        )
        out[chunk] = (lp, x.grad)
    if t <= 2:  # beyond two ranks gloo's ring sums in an order that depends on the tensor size
        assert torch.equal(out[0][0], out[cs][0]) and torch.equal(out[0][1], out[cs][1])
    return {"columns": (k * vt, (k + 1) * vt)}


def fused_head_tp_case(n: int, h: int, v: int, chunk: int) -> dict[str, Any]:
    """The fused LM head at TP = world: each rank holds ``v / tp`` rows of the head weight;
    log-probs, the hidden-state gradient (summed over TP) and the weight shard's gradient
    against a float64 single-process reference."""
    from trainctl.workers.ops.fused_head import fused_head_logprob

    g = grid(tp=dist.get_world_size())
    t, k = g.sizes["tp"], g.coords["tp"]
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.1
    target = torch.randint(0, v, (n,), generator=gen)
    seed_grad = torch.linspace(0.5, 1.5, n)

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = torch.log_softmax(ref_h @ ref_w.t(), -1).gather(1, target[:, None])[:, 0]
    ref.backward(seed_grad.double())

    vt = v // t
    x = hidden.clone().requires_grad_()
    w = weight[k * vt : (k + 1) * vt].clone().requires_grad_()
    lp = fused_head_logprob(
        x, w, target, vocab_start=k * vt, tp_group=g.groups["tp"], chunk_size=chunk
    )
    lp.backward(seed_grad)
    close = {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(lp.double(), ref.detach(), **close)
    torch.testing.assert_close(x.grad.double(), ref_h.grad, **close)
    torch.testing.assert_close(w.grad.double(), ref_w.grad[k * vt : (k + 1) * vt], **close)
    return {"columns": (k * vt, (k + 1) * vt)}


# -- CP-local losses ------------------------------------------------------------------------

V = 32


def rl_sequences(seed: int, n_seqs: int) -> list[TokenSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_seqs):
        n = int(rng.integers(3, 20))
        prompt = int(rng.integers(1, n - 1))
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.float32)
        out.append(
            TokenSequence(
                tokens=rng.integers(0, V, n).astype(np.int64),
                loss_mask=mask,
                weights=rng.uniform(0.5, 1.5, n).astype(np.float32),
                advantages=rng.normal(size=n).astype(np.float32),
                old_logprobs=(-rng.uniform(0.5, 4, n)).astype(np.float32),
                ref_logprobs=(-rng.uniform(0.5, 4, n)).astype(np.float32),
            )
        )
    return out


def _reference_terms(lp: Tensor, seq: TokenSequence, spec: LossConfig) -> Tensor:
    """Per-target terms of one sequence, written out independently of ops.loss."""
    nxt = slice(1, None)
    adv, old, ref = (
        torch.from_numpy(getattr(seq, k)[nxt]).double()
        for k in ("advantages", "old_logprobs", "ref_logprobs")
    )
    if spec.kind is LossKind.CROSS_ENTROPY:
        terms = -lp
    else:
        ratio = torch.exp(lp - old)
        terms = -ratio * adv
        if spec.kind is LossKind.PPO:
            clipped = -torch.clamp(ratio, 1 - spec.clip_low, 1 + spec.clip_high) * adv
            terms = torch.maximum(terms, clipped)
    if spec.kl_coef:
        terms = terms + spec.kl_coef * (torch.exp(ref - lp) - (ref - lp) - 1)
    return terms


def cp_loss_case(dp: int, cp: int, kind: str, normalization: str, kl: float) -> dict[str, Any]:
    """Sum over DP x CP of the CP-local losses == the single-process loss; same for gradients."""
    g = grid(cp=cp, dp=dp)
    spec = LossConfig(kind=LossKind(kind), clip_low=0.2, clip_high=0.28, kl_coef=kl)
    norm = Normalization(normalization)
    per_dp = [rl_sequences(100 + d, 4) for d in range(dp)]
    everything = [s for seqs in per_dp for s in seqs]
    scales, n_tokens, n_seqs = sequence_scales(everything, norm)
    gen = torch.Generator().manual_seed(7)
    packs, full_logits = [], []
    start = 0
    for seqs in per_dp:
        mb = packed_tokens(
            pack(
                seqs,
                list(range(len(seqs))),
                pad_multiple=2 * cp,
                scales=scales[start : start + len(seqs)],
            )
        )
        start += len(seqs)
        packs.append(mb)
        full_logits.append(torch.randn(mb.num_tokens, V, generator=gen, dtype=torch.float64))

    # Reference: the whole global batch in one process, sequence by sequence.
    leaves = [x.clone().requires_grad_() for x in full_logits]
    seq_losses, token_count = [], 0
    for d, seqs in enumerate(per_dp):
        cu = packs[d].cu_seqlens.tolist()
        for i, seq in enumerate(seqs):
            rows = leaves[d][cu[i] : cu[i] + len(seq) - 1]
            lp = torch.log_softmax(rows, -1).gather(-1, torch.from_numpy(seq.tokens[1:])[:, None])[
                :, 0
            ]
            w = torch.from_numpy(seq.loss_mask[1:] * seq.weights[1:]).double()
            seq_losses.append(((_reference_terms(lp, seq, spec) * w).sum(), seq.num_loss_tokens))
            token_count += seq.num_loss_tokens
    if norm is Normalization.TOKEN_MEAN:
        ref_loss = sum(s for s, _ in seq_losses) / token_count
    elif norm is Normalization.SEQ_MEAN_TOKEN_MEAN:
        ref_loss = sum(s / n for s, n in seq_losses if n) / sum(1 for _, n in seq_losses if n)
    else:
        ref_loss = sum(s for s, _ in seq_losses)
    ref_loss.backward()
    assert token_count == n_tokens and n_seqs == sum(1 for _, n in seq_losses if n)

    # This rank: its DP micro-batch, its CP shard, local logits only.
    d, r = g.coords["dp"], g.coords["cp"]
    shard = split_for_cp(packs[d].per_token, packs[d].cu_seqlens, cp_size=cp, cp_rank=r)
    t = shard.per_token
    local_logits = full_logits[d][shard.positions].clone().requires_grad_()
    lp = torch.log_softmax(local_logits, -1).gather(-1, t["labels"][:, None])[:, 0]
    terms = per_token_terms(
        lp,
        **spec.options(),
        loss_mask=t["loss_mask"].double(),
        advantages=t["advantages"].double(),
        old_logprobs=t["old_logprobs"].double(),
        ref_logprobs=t["ref_logprobs"].double(),
    )
    loss = local_loss(terms, t["loss_scale"])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=g.groups["dpcp"])
    # Mean-of-means, the classic mistake, is not the global loss (sanity of the setup).
    assert abs(float(total) - float(ref_loss)) <= 1e-10 * max(1.0, abs(float(ref_loss))), (
        float(total),
        float(ref_loss),
    )
    torch.testing.assert_close(
        local_logits.grad, leaves[d].grad[shard.positions], atol=1e-12, rtol=1e-10
    )
    return {"loss": float(total), "ref": float(ref_loss), "local_valid": int(t["loss_mask"].sum())}


def eval_reduce_case() -> dict[str, float]:
    """dp2 x cp2: reducing the local losses over DP+CP gives the global mean; DP-only does not."""
    g = grid(cp=2, dp=2)
    per_dp = [rl_sequences(200 + d, 3) for d in range(2)]
    scales, _, _ = sequence_scales([s for x in per_dp for s in x], Normalization.TOKEN_MEAN)
    d, r = g.coords["dp"], g.coords["cp"]
    mb = packed_tokens(pack(per_dp[d], [0, 1, 2], pad_multiple=4, scales=scales[3 * d : 3 * d + 3]))
    gen = torch.Generator().manual_seed(9 + d)
    logits = torch.randn(mb.num_tokens, V, generator=gen, dtype=torch.float64)
    full_lp = torch.log_softmax(logits, -1).gather(-1, mb.labels[:, None])[:, 0]
    shard = split_for_cp(mb.per_token, mb.cu_seqlens, cp_size=2, cp_rank=r)
    local = local_loss(-full_lp[shard.positions], shard.per_token["loss_scale"])
    both, dp_only = local.clone(), local.clone()
    dist.all_reduce(both, group=g.groups["dpcp"])
    dist.all_reduce(dp_only, group=g.groups["dp"])
    mine = local_loss(-full_lp, mb.loss_scale)  # this DP rank's whole micro-batch
    every = mine.clone()  # one full micro-batch per DP slot: their sum is the global loss
    dist.all_reduce(every, group=g.groups["dp"])
    return {"dpcp": float(both), "dp_only": float(dp_only), "global": float(every)}


def aggregate_case() -> dict[str, float]:
    """dp2 x cp2: ``aggregate_loss`` of each rank's micro-batch loss shares (DP rank 1 with an
    extra dummy micro-batch) is the global loss on every rank; summing over DP alone is not."""
    g = grid(cp=2, dp=2)
    per_dp = [rl_sequences(200 + d, 3) for d in range(2)]
    scales, _, _ = sequence_scales([s for x in per_dp for s in x], Normalization.TOKEN_MEAN)
    d, r = g.coords["dp"], g.coords["cp"]
    shares: list[Tensor] = []
    reference = 0.0  # single-process: every DP slot's whole micro-batch, on every rank
    for slot in range(2):
        mb = packed_tokens(
            pack(per_dp[slot], [0, 1, 2], pad_multiple=4, scales=scales[3 * slot : 3 * slot + 3])
        )
        gen = torch.Generator().manual_seed(9 + slot)
        logits = torch.randn(mb.num_tokens, V, generator=gen, dtype=torch.float64)
        full_lp = torch.log_softmax(logits, -1).gather(-1, mb.labels[:, None])[:, 0]
        reference += float(local_loss(-full_lp, mb.loss_scale))
        if slot == d:
            shard = split_for_cp(mb.per_token, mb.cu_seqlens, cp_size=2, cp_rank=r)
            shares.append(local_loss(-full_lp[shard.positions], shard.per_token["loss_scale"]))
    if d == 1:
        shares.append(connected_zero(torch.zeros(4, dtype=torch.float64, requires_grad=True)))
    return {
        "aggregate": float(aggregate_loss(shares, g.groups["dpcp"])),
        "dp_only": float(aggregate_loss(shares, g.groups["dp"])),
        "reference": reference,
    }


def zero_valid_shard_case() -> dict[str, Any]:
    """cp=2, CP rank 0's shard has no valid token: zero loss, zero (not None) gradients."""
    g = grid(cp=2)
    r = g.coords["cp"]
    # One sequence of 8 (H = 2): rank 1 holds positions 2..5; targets only there.
    seq = TokenSequence(
        tokens=np.arange(1, 9, dtype=np.int64),
        loss_mask=np.asarray([0, 0, 0, 1, 1, 1, 1, 0], np.float32),
    )
    mb = packed_tokens(pack([seq], [0], pad_multiple=4, scales=[1 / seq.num_loss_tokens]))
    shard = split_for_cp(mb.per_token, mb.cu_seqlens, cp_size=2, cp_rank=r)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, V))
    logits = model(shard.per_token["input_ids"])
    lp = vocab_parallel_logprob(logits, shard.per_token["labels"])
    loss = local_loss(
        per_token_terms(lp, loss_mask=shard.per_token["loss_mask"]),
        shard.per_token["loss_scale"],
    )
    loss.backward()
    grads_none = [n for n, p in model.named_parameters() if p.grad is None]
    zero = all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    for p in model.parameters():  # the DDP-style sync completes on both ranks
        dist.all_reduce(p.grad, group=g.groups["cp"])
    return {
        "valid": int(shard.per_token["loss_mask"].sum()),
        "loss": float(loss),
        "grads_none": grads_none,
        "all_zero": zero,
    }


def reassemble_grad_case() -> dict[str, Any]:
    """Variant B: gather per-token values over CP; the gradient lands on the right shard."""
    g = grid(cp=2)
    r = g.coords["cp"]
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    full = torch.arange(20, dtype=torch.float64)
    mb = packed_tokens(
        pack(
            [
                TokenSequence(tokens=np.arange(8), loss_mask=np.ones(8, np.float32)),
                TokenSequence(tokens=np.arange(12), loss_mask=np.ones(12, np.float32)),
            ],
            [0, 1],
            pad_multiple=4,
        )
    )
    shard_pos = split_for_cp(mb.per_token, mb.cu_seqlens, cp_size=2, cp_rank=r).positions
    local = full[shard_pos].clone().requires_grad_()
    gathered = gather_from_cp(local, cu, g.groups["cp"])
    assert torch.equal(gathered, full)
    weights = torch.linspace(1, 2, 20, dtype=torch.float64)
    (gathered * weights).sum().div(2).backward()  # every CP rank computes the same full loss
    uniform = local.grad.clone()
    local.grad = None
    gathered = gather_from_cp(local, cu, g.groups["cp"])
    gathered.sum().div(2).backward()
    return {
        "weighted_ok": bool(torch.allclose(uniform, weights[shard_pos])),
        "uniform_ok": bool(torch.equal(local.grad, torch.ones_like(local))),
    }
