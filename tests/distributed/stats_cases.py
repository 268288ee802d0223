"""Rank functions for the CP-invariant statistics tests (docs/algorithms.md §1.7)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainctl.workers.control.plan import pack
from trainctl.workers.engine.inputs import packed_tokens
from trainctl.workers.ops.cp import split_for_cp
from trainctl.workers.ops.metrics import Reduction, StatsTracker
from trainctl.workers.ops.sequence_loss import SequenceIndex

from ops_cases import V, grid, rl_sequences


def stats_case() -> dict[str, float]:
    """Counts, loss, vocab min/max and log-ppl of one batch split over the CP group."""
    c = dist.get_world_size()
    g = grid(cp=c)
    seqs = rl_sequences(300, 5)
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
    total, counts = SequenceIndex(t["seq_id"], len(seqs), g.groups["cp"]).sums(nll, t["loss_mask"])
    for i in range(len(seqs)):
        if counts[i] > 0:
            tracker.scalar(f"log_ppl_seq{i}", float(total[i] / counts[i]), Reduction.MAX)
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
    total, counts = SequenceIndex(torch.zeros(2, dtype=torch.long), 1, g.groups["cp"]).sums(
        nll, mask
    )
    return float(torch.exp(total[0] / counts[0]))


def scalar_mean_case() -> float:
    """One scalar record per rank, 1.0 and 3.0, exported as a mean over the group: 2.0."""
    tracker = StatsTracker()
    tracker.scalar("x", 1.0 + 2.0 * dist.get_rank(), Reduction.MEAN)
    return tracker.export(group=dist.group.WORLD)["x:mean"]
