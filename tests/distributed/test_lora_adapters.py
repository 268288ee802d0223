"""Many adapters on one base: two adapters (different ranks and targets) stepped in
alternation give, bit for bit, what each gives stepped alone - losses, grad norms and weights -
on one rank and under ZeRO-1 at dp2; the base never changes; deleting one leaves the other
intact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.rankpool import RankPool
from lora_cases import split_steps, train_adapters

MODEL = {"num_layers": 2, "max_seq_len": 64}


def _cfg(offload: str = "", **layout: int) -> dict:
    lora = {"max_adapters": 3, "max_rank": 8}
    if offload:  # one idle adapter in host memory at most: another waits on disk
        lora |= {"max_in_memory": 1, "offload_dir": offload}
    return {
        "layout": layout,
        "max_tokens_per_microbatch": 96,
        "model": MODEL,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "lora": lora,
    }


@pytest.mark.parametrize("layout", [{}, {"dp": 2}], ids=["1rank", "dp2-zero1"])
def test_alternating_adapters_equal_each_alone(
    pools: Callable[[int], RankPool], layout: dict
) -> None:
    pool = pools(layout.get("dp", 1))
    a_alone = pool.run(train_adapters, _cfg(**layout), "aaa")
    b_alone = pool.run(train_adapters, _cfg(**layout), "bbb")
    mixed = pool.run(train_adapters, _cfg(**layout), "abbaab", "b")
    for alone_a, alone_b, both in zip(a_alone, b_alone, mixed, strict=True):
        assert both["losses"]["a"] == alone_a["losses"]["a"]
        assert both["losses"]["b"] == alone_b["losses"]["b"]
        assert both["digests"] == {"a": alone_a["digests"]["a"], "b": alone_b["digests"]["b"]}
        assert both["steps"] == {"a": 3, "b": 3}
        # The losses moved (the adapters trained) and the base did not.
        assert both["losses"]["a"][0][0] != both["losses"]["a"][2][0]
        before, after = both["base"]
        assert before == after
        assert both["left"] == ["a"] and both["after_delete"] == both["digests"]["a"]


def test_limits_are_refused_by_name() -> None:
    from trainctl.workers.engine.adapter_bank import AdapterBank
    from trainctl.workers.engine.boundary import AdapterSpec

    bank = AdapterBank(
        sites=[], params={}, optimizer=None,
        zero_optimizer=False, max_adapters=1, max_rank=8, tp_rank=0, tp=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rank: 9 is outside \[1, 8\].*--lora-max-rank"):
        bank.check_new(AdapterSpec(name="x", rank=9, alpha=1.0, targets=("attn",)))
    bank.create(AdapterSpec(name="x", rank=2, alpha=1.0, targets=("attn",)))
    with pytest.raises(ValueError, match="exists already"):
        bank.check_new(AdapterSpec(name="x", rank=2, alpha=1.0))
    with pytest.raises(ValueError, match="--max-adapters"):
        bank.check_new(AdapterSpec(name="y", rank=2, alpha=1.0, targets=("attn",)))
    with pytest.raises(KeyError, match="'z' does not exist"):
        bank.activate("z")


@pytest.mark.parametrize("layout", [{}, {"dp": 2}], ids=["1rank", "dp2-zero1"])
def test_interleaved_split_steps_keep_each_adapters_window(
    pools: Callable[[int], RankPool], layout: dict
) -> None:
    """Two clients' forward_backward parts and optim_steps interleave: each adapter's step
    sums only its own parts (the window moves with the adapter), bit for bit."""
    pool = pools(layout.get("dp", 1))
    a_alone = pool.run(split_steps, _cfg(**layout), "aaA")
    b_alone = pool.run(split_steps, _cfg(**layout), "bbB")
    mixed = pool.run(split_steps, _cfg(**layout), "abbaBA")
    for alone_a, alone_b, both in zip(a_alone, b_alone, mixed, strict=True):
        assert both["norms"]["a"] == alone_a["norms"]["a"]
        assert both["norms"]["b"] == alone_b["norms"]["b"]
        assert both["digests"] == {"a": alone_a["digests"]["a"], "b": alone_b["digests"]["b"]}


@pytest.mark.parametrize("layout", [{}, {"dp": 2}], ids=["1rank", "dp2-zero1"])
def test_adapters_waiting_on_disk_come_back_bit_exact(
    pools: Callable[[int], RankPool], layout: dict, tmp_path: Path
) -> None:
    """With one idle adapter allowed in host memory, a third adapter's switch sends the least
    recently used one to disk (its factors, AdamW state and waiting gradients); steps and
    split steps then equal those of adapters that never left memory."""
    pool = pools(layout.get("dp", 1))
    # c is sent to disk after its step and comes back for another; a goes to disk with
    # a forward_backward part waiting and comes back for its second part and its step.
    order, split = "cabbaabc", "acCbbaBA"
    in_memory = pool.run(train_adapters, _cfg(**layout), order)
    on_disk = pool.run(train_adapters, _cfg(str(tmp_path / "t"), **layout), order)
    for mem, disk in zip(in_memory, on_disk, strict=True):
        assert disk["losses"] == mem["losses"] and disk["digests"] == mem["digests"]
        assert mem["on_disk"] == [] and disk["on_disk"] == ["a"]
    split_mem = pool.run(split_steps, _cfg(**layout), split)
    split_disk = pool.run(split_steps, _cfg(str(tmp_path / "s"), **layout), split)
    for mem, disk in zip(split_mem, split_disk, strict=True):
        assert disk["norms"] == mem["norms"] and disk["digests"] == mem["digests"]
        assert len(disk["on_disk"]) == 1
