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
import torch.nn.functional as F
from torch import Tensor, nn

from trainctl.api import LossConfig, TokenSequence
from trainctl.api.models import LossKind, Normalization
from trainctl.workers.control.plan import pack, sequence_scales
from trainctl.workers.engine.inputs import packed_tokens
from trainctl.workers.ops.aggregate import aggregate_loss
from trainctl.workers.ops.cp import gather_from_cp, split_for_cp
from trainctl.workers.ops.grouped_linear import GroupedLinear
from trainctl.workers.ops.logprob import vocab_parallel_logprob
from trainctl.workers.ops.loss import connected_zero, local_loss, per_token_terms
from trainctl.workers.ops.metrics import Reduction, StatsTracker, sequence_log_ppl

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


# -- CP-local losses ------------------------------------------------------------------------

V = 32


def _rl_sequences(seed: int, n_seqs: int) -> list[TokenSequence]:
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
    per_dp = [_rl_sequences(100 + d, 4) for d in range(dp)]
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
    per_dp = [_rl_sequences(200 + d, 3) for d in range(2)]
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
    per_dp = [_rl_sequences(200 + d, 3) for d in range(2)]
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


# -- stats ------------------------------------------------------------------------------------


def stats_case() -> dict[str, float]:
    """Counts, loss, vocab min/max and log-ppl of one batch split over the CP group."""
    c = dist.get_world_size()
    g = grid(cp=c)
    seqs = _rl_sequences(300, 5)
    mb = packed_tokens(pack(seqs, list(range(5)), pad_multiple=8))  # 8: valid for c in 1, 2, 4
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(mb.num_tokens, V, generator=gen, dtype=torch.float64)
    shard = split_for_cp(mb.per_token, mb.cu_seqlens, cp_size=c, cp_rank=g.coords["cp"])
    t = shard.per_token
    x = logits[shard.positions]
    nll = -torch.log_softmax(x, -1).gather(-1, t["labels"][:, None])[:, 0]
    seq_lens = torch.tensor([len(s) for s in seqs])
    cu = mb.cu_seqlens.long()
    real = (shard.positions - cu[t["seq_id"]]) < seq_lens[t["seq_id"]]
    valid = t["loss_mask"] > 0
    tracker = StatsTracker()
    tracker.denominator(n_tokens=real, n_valid_tokens=valid, prompt_tokens=real & ~valid)
    tracker.stat(
        denominator="n_valid_tokens",
        loss=nll,
        vocab_min=x.min(-1).values,
        vocab_max=x.max(-1).values,
    )
    tracker.stat(denominator="n_valid_tokens", reduction=Reduction.MIN, vocab_min=x.min(-1).values)
    tracker.stat(denominator="n_valid_tokens", reduction=Reduction.MAX, vocab_max=x.max(-1).values)
    log_ppl, has = sequence_log_ppl(
        nll, t["loss_mask"], t["seq_id"], len(seqs), cp_group=g.groups["cp"]
    )
    for i in range(len(seqs)):
        if has[i]:
            tracker.scalar(f"log_ppl_seq{i}", float(log_ppl[i]), Reduction.MAX)
    return tracker.export(group=g.groups["cp"])


def ppl_uneven_case() -> float:
    """docs/algorithms.md §1.7's example: NLLs 0.9 on rank 0 and 0.3, 0.3 on rank 1 -> ppl e^0.5."""
    g = grid(cp=2)
    r = g.coords["cp"]
    nll = (
        torch.tensor([0.9, 0.0], dtype=torch.float64)
        if r == 0
        else torch.tensor([0.3, 0.3], dtype=torch.float64)
    )
    mask = torch.tensor([1.0, 0.0]) if r == 0 else torch.tensor([1.0, 1.0])
    log_ppl, _ = sequence_log_ppl(
        nll, mask, torch.zeros(2, dtype=torch.long), 1, cp_group=g.groups["cp"]
    )
    return float(torch.exp(log_ppl[0]))


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


# -- dummy micro-batches -------------------------------------------------------------------


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


# -- PP metadata broadcast -----------------------------------------------------------------


def _stage_batch(n_seqs: int, seq_length: int, loss_inputs: tuple[str, ...]):
    from trainctl.workers.ops.pp_broadcast import StageBatch

    lengths = [seq_length // n_seqs] * (n_seqs - 1)
    lengths.append(seq_length - sum(lengths))
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    gen = torch.Generator().manual_seed(n_seqs)
    shape = (1, seq_length)
    return StageBatch(
        tokens=torch.randint(0, V, shape, generator=gen),
        position_ids=torch.arange(seq_length)[None],
        labels=torch.randint(0, V, shape, generator=gen),
        loss_mask=torch.ones(shape),
        loss_inputs={k: torch.randn(shape, generator=gen) for k in loss_inputs},
        cu_seqlens=cu,
        max_seqlen=torch.tensor([max(lengths)], dtype=torch.int32),
    )


def pp_broadcast_case(
    tp: int, pp: int, seq_counts: list[int], with_cu: bool = True, collated: bool = False
) -> list[dict[str, Any]]:
    """Every TP rank of every stage gets what its stage needs; returns what each call sent.

    ``collated``: the sender's ``cu_seqlens`` is ``[1, n]``, as megatron collates it."""
    from trainctl.workers.ops import pp_broadcast as ppb

    g = grid(tp=tp, pp=pp)
    role = ppb.StageRole.of(g.coords["pp"], pp)
    src = g.src_of("tp")
    sender = dist.get_rank() == src
    inputs = ("loss_scale", "advantages")
    cfg = ppb.BroadcastConfig(seq_length=24, loss_inputs=inputs)
    calls: list[tuple[tuple[int, ...], str]] = []
    real = dist.broadcast

    def recording(t: Tensor, *a: Any, **k: Any) -> Any:
        calls.append((tuple(t.shape), str(t.dtype)))
        return real(t, *a, **k)

    out = []
    ppb.dist.broadcast = recording  # type: ignore[assignment]
    try:
        for n in seq_counts:
            full = _stage_batch(n, 24, inputs)
            if not with_cu:
                full = ppb.replace(full, cu_seqlens=None)
            elif collated:
                full = ppb.replace(full, cu_seqlens=full.cu_seqlens[None])
            got = ppb.broadcast_stage_batch(
                full if sender else None, role=role, cfg=cfg, tp_group=g.groups["tp"], src=src
            )
            res: dict[str, Any] = {"role": role.value}
            if with_cu:
                assert got.cu_seqlens is not None and got.cu_seqlens.dtype == torch.int32
                assert torch.equal(got.cu_seqlens.reshape(-1), full.cu_seqlens.reshape(-1))
                assert got.max_seqlen is not None and got.max_seqlen.dtype == torch.int32
                assert torch.equal(got.max_seqlen, full.max_seqlen)
            else:
                assert got.cu_seqlens is None
            first = role in (ppb.StageRole.ONLY, ppb.StageRole.FIRST)
            last = role in (ppb.StageRole.ONLY, ppb.StageRole.LAST)
            assert (got.tokens is not None) == first and (got.labels is not None) == last
            if first:
                assert torch.equal(got.tokens, full.tokens)
            if last:
                assert torch.equal(got.labels, full.labels)
                assert set(got.loss_inputs) == set(inputs)
                assert torch.equal(
                    got.loss_inputs["advantages"], full.loss_inputs["advantages"].double()
                )
            res["cu"] = None if got.cu_seqlens is None else got.cu_seqlens.tolist()
            res["cu_shape"] = None if got.cu_seqlens is None else tuple(got.cu_seqlens.shape)
            out.append(res)
    finally:
        ppb.dist.broadcast = real  # type: ignore[assignment]
    # The sender's and the receivers' call sequences are identical, shapes and dtypes.
    seqs: list[Any] = [None] * tp
    dist.all_gather_object(seqs, calls, group=g.groups["tp"])
    assert all(s == seqs[0] for s in seqs), seqs
    return out


def pp_broadcast_refused_case() -> str:
    """A sender with several packed rows (``[2, n]`` cu_seqlens) is refused on every TP rank."""
    from trainctl.workers.ops import pp_broadcast as ppb

    g = grid(tp=2)
    src = g.src_of("tp")
    full = _stage_batch(3, 24, ())
    assert full.cu_seqlens is not None
    full = ppb.replace(full, cu_seqlens=full.cu_seqlens.repeat(2, 1))
    cfg = ppb.BroadcastConfig(seq_length=24)
    try:
        ppb.broadcast_stage_batch(
            full if dist.get_rank() == src else None,
            role=ppb.StageRole.ONLY,
            cfg=cfg,
            tp_group=g.groups["tp"],
            src=src,
        )
    except ValueError as e:
        return str(e)
    return "accepted"


def scalar_mean_case() -> float:
    """One scalar record per rank, 1.0 and 3.0, exported as a mean over the group: 2.0."""
    tracker = StatsTracker()
    tracker.scalar("x", 1.0 + 2.0 * dist.get_rank(), Reduction.MEAN)
    return tracker.export(group=dist.group.WORLD)["x:mean"]
