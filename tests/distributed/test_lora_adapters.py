"""Many adapters on one base: two adapters (different ranks and targets) stepped in
alternation give, bit for bit, what each gives stepped alone - losses, grad norms and weights -
on one rank and under ZeRO-1 at dp2; the base never changes; deleting one leaves the other
intact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from lora_cases import split_steps, train_adapters

from rankpool import RankPool

MODEL = {"num_layers": 2, "max_seq_len": 64}


def _cfg(**layout: int) -> dict:
    return {
        "layout": layout,
        "max_tokens_per_microbatch": 96,
        "model": MODEL,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "lora": {"max_adapters": 2, "max_rank": 8},
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
    from trainctl.workers.engine.adapters import AdapterBank
    from trainctl.workers.engine.boundary import AdapterSpec

    bank = AdapterBank(
        sites=[], groups=frozenset({"attn", "unembed"}), params={}, optimizer=None,
        zero_optimizer=False, max_adapters=1, max_rank=8, tp_rank=0, tp=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rank: 9 is outside \[1, 8\].*--lora-max-rank"):
        bank.check_new(AdapterSpec(name="x", rank=9, alpha=1.0, targets=("attn",)))
    with pytest.raises(ValueError, match=r"targets: .*\['mlp'\]"):
        bank.check_new(AdapterSpec(name="x", rank=2, alpha=1.0, targets=("mlp",)))
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
