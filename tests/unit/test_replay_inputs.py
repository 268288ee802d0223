"""``routed_experts`` on its way in: checked, carried by both encodings, packed unrolled, and
refused where a trie would have to compute one token on two routes."""

from __future__ import annotations

import numpy as np
import pytest

from trainctl.api import InvalidRequestError, SequenceBatch, TokenSequence, wire
from trainctl.workers.control.plan import make_plan

LAYERS, K = 3, 2


def _routes(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n, LAYERS, 8)), axis=2)[..., :K]


def _seq(tokens: list[int], seed: int) -> dict:
    return {"tokens": tokens, "routed_experts": _routes(len(tokens), seed).tolist()}


def test_routes_survive_json_and_binary_frames() -> None:
    seqs = [_seq([1, 2, 3, 4], 0), _seq([5, 6], 1)]
    batch = SequenceBatch.from_sequences(seqs)
    decoded = wire.decode_sequences(wire.encode_sequences(seqs, {}, compress=True))["sequences"]
    for b in (batch, decoded):
        assert b.column("routed_experts").shape == (6, LAYERS, K)
        np.testing.assert_array_equal(b[1].routed_experts, seqs[1]["routed_experts"])
    assert batch == decoded
    back = wire.decode_per_sequence(
        wire.encode_per_sequence({}, {"routed_experts": [b.routed_experts for b in batch]})
    )[1]["routed_experts"]
    np.testing.assert_array_equal(back[0], seqs[0]["routed_experts"])


@pytest.mark.parametrize(
    ("routes", "where", "says"),
    [
        ([[[0, 1]], [[3, 3]]], r"sequences\[0\]\.routed_experts\[1\]", "distinct"),
        ([[[0, -1]], [[2, 3]]], r"sequences\[0\]\.routed_experts\[0\]", "distinct ids >= 0"),
        ([[0, 1], [2, 3]], r"sequences\[0\]\.routed_experts", "2 dimensions"),
        ([[[0, 1]]], r"sequences\[0\]\.routed_experts", "has 1 entries but tokens has 2"),
        ([[[0, 1]], [[2.5, 3]]], r"sequences\[0\]\.routed_experts", "integers"),
    ],
)
def test_bad_routes_are_refused_naming_the_token(routes: list, where: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"{where}: .*{says}"):
        SequenceBatch.from_sequences([{"tokens": [1, 2], "routed_experts": routes}])


def test_routes_must_fit_the_model() -> None:
    batch = SequenceBatch.from_sequences([_seq([1, 2, 3], 0)])
    batch.check_routes(layers=LAYERS, top_k=K, num_experts=8)
    with pytest.raises(InvalidRequestError, match=r"routed_experts: .*mixture-of-experts"):
        batch.check_routes(layers=LAYERS, top_k=K, num_experts=0)
    with pytest.raises(InvalidRequestError, match=r"must be \[tokens, 4, 2\]"):
        batch.check_routes(layers=4, top_k=K, num_experts=8)
    with pytest.raises(InvalidRequestError, match=r"routed_experts\[\d\]: expert ids .*\[0, 5\)"):
        batch.check_routes(layers=LAYERS, top_k=K, num_experts=5)
    with pytest.raises(InvalidRequestError, match=r"sequences\[1\]\.routed_experts"):
        SequenceBatch.from_sequences([_seq([1, 2], 0), {"tokens": [3], "routed_experts": [[[0]]]}])


def _host(seqs: list[dict]) -> list[TokenSequence]:
    return [TokenSequence(s["tokens"], routed_experts=s["routed_experts"]) for s in seqs]


def test_packed_routes_are_not_rolled_and_pads_take_distinct_experts() -> None:
    seqs = [_seq([1, 2, 3], 0), _seq([4, 5, 6, 7, 8], 1)]
    plan = make_plan(_host(seqs), dp=2, max_tokens_per_microbatch=16, pad_multiple=4)
    for shard in plan.microbatches:
        (mb,) = shard
        got = mb.per_token["routed_experts"]
        (i,) = mb.seq_index.tolist()
        n = len(seqs[i]["tokens"])
        np.testing.assert_array_equal(got[:n], seqs[i]["routed_experts"])
        assert got.shape[0] == mb.num_tokens
        np.testing.assert_array_equal(got[n:], np.broadcast_to(np.arange(K), got[n:].shape))


def test_a_trie_carries_its_rows_routes_and_refuses_two_routes_for_one_token() -> None:
    prompt = [9, 8, 7, 6]
    a, b = _seq([*prompt, 1, 2], 0), _seq([*prompt, 3], 1)
    b["routed_experts"][:4] = a["routed_experts"][:4]  # the same route through the prompt
    plan = make_plan(_host([a, b]), dp=1, max_tokens_per_microbatch=32, pad_multiple=1,
                     packing="tree")  # fmt: skip
    ((mb,),) = plan.microbatches
    assert mb.tree is not None and mb.tree.routes is not None
    for s, start in ((a, 0), (b, 6)):
        rows = mb.tree.rows[start : start + len(s["tokens"])]
        np.testing.assert_array_equal(mb.tree.routes[rows], s["routed_experts"])
    b["routed_experts"][2] = [[7, 6], [5, 4], [3, 2]]  # one prompt token elsewhere
    with pytest.raises(ValueError, match=r"sequences\[0\] and sequences\[1\] .* token 2"):
        make_plan(_host([a, b]), dp=1, max_tokens_per_microbatch=32, pad_multiple=1,
                  packing="tree")  # fmt: skip
    # flat packing computes each sequence's prompt on its own route
    make_plan(_host([a, b]), dp=1, max_tokens_per_microbatch=32, pad_multiple=1)
