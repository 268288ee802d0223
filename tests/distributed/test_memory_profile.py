"""Memory profiles from a cp2 x tp2 engine: one file per rank, named with its coordinates,
recording the allocations of the step (docs/algorithms.md §6: T6.2, T6.4
on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from helpers.batches import ragged_batch
from helpers.rankpool import RankPool
from state_cases import profile_step


def test_cp2_tp2_profile_files(pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    cfg = {
        "layout": {"cp": 2, "tp": 2},
        "max_tokens_per_microbatch": 96,
        "model": {"max_seq_len": 64},
    }
    results = pools(4).run(profile_step, cfg, ragged_batch(), str(tmp_path), 64)
    names = sorted(r["name"] for r in results)
    assert len(set(names)) == 4
    for r in results:
        pp, dp, cp, tp = r["coords"]
        assert r["name"] == f"snapshot_rank{r['rank']:02d}_p{pp}d{dp}c{cp}t{tp}.trace.json"
        assert (tmp_path / r["name"]).stat().st_size == r["size"] > 0
        assert r["num_allocs"] > 100  # the step's own allocations
        assert r["max_alloc"] >= 64 * (1 << 20)  # T6.4: the 64 MB tensor is in the record
    assert sorted(tuple(r["coords"][2:]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
