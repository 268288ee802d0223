"""The running service at dp2 x cp2 and tp2 x pp2 (4 ranks each) and at dp2, driven over HTTP;
dp2 x cp2 and dp2 pack prefix tries (the default), tp2 x pp2 packs flat. One train step gives
the loss and grad norm of the single-rank engine (packed flat), and the eval loss after the
step - a function of every parameter - matches too (1e-5 relative). The batches share
prefixes (a GRPO group, multi-turn siblings), so the tree services compute fewer tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from helpers.batches import sft_shared_batch
from helpers.servicekit import Service, running_service
from helpers.single_process import close, single_process

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2cp2-tree": {"dp": 2, "cp": 2, "packing": "tree"},
    "tp2pp2-flat": {"dp": 1, "tp": 2, "pp": 2, "packing": "flat"},
    "dp2-tree": {"dp": 2, "packing": "tree"},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Service]]:
    flags = [f"--{k}={v}" for k, v in LAYOUTS[request.param].items()]
    with running_service(tmp_path_factory.mktemp(request.param), *flags) as svc:
        yield request.param, svc


def test_logprobs_match_a_single_process_computation(layout_service: tuple[str, Service]) -> None:
    """Put back together from CP shards and DP ranks, in the caller's order (run first: the
    reference is the untrained model)."""
    name, svc = layout_service
    client = svc.client()
    assert client.info().step == 0
    batch = sft_shared_batch(seed=6)
    got = client.logprobs(batch, entropy=True)
    want = single_process("logprobs", batch)
    assert [len(x) for x in got.logprobs] == [len(s["tokens"]) for s in batch]
    for g, w in zip(got.logprobs, want, strict=True):
        assert np.allclose(g, w, rtol=1e-5, atol=1e-5), (g, w)
    assert got.entropy is not None and all(e[0] == 0.0 and min(e[1:]) > 0 for e in got.entropy)
    _check_packing(name, got.metrics)


def _check_packing(name: str, metrics: dict[str, float]) -> None:
    """The tree service computed fewer tokens than the batch has; the flat ones all of them."""
    tokens, computed = metrics["tokens:sum"], metrics["computed_tokens:sum"]
    if "tree" in name:
        assert 0 < computed < tokens, metrics
    else:
        assert computed == tokens, metrics


def test_train_step_matches_single_rank(layout_service: tuple[str, Service]) -> None:
    name, svc = layout_service
    client = svc.client()
    info = client.info()
    layout = {k: v for k, v in LAYOUTS[name].items() if k != "packing"}
    assert info.world_size == int(np.prod(list(layout.values())))
    assert all(info.layout[k] == v for k, v in layout.items())
    batch = sft_shared_batch(seed=5)
    before = client.eval_batch(batch).loss
    step = client.train_batch(batch)
    after = client.eval_batch(batch).loss

    want = single_process("step", batch)
    assert close(before, want["eval_before"]), (before, want)
    assert close(step.loss, want["loss"]), (step.loss, want)
    assert close(step.metrics["grad_norm:value"], want["grad_norm"]), (step.metrics, want)
    assert close(after, want["eval_after"]), (after, want)
    _check_packing(name, step.metrics)


def test_a_request_chooses_its_packing(layout_service: tuple[str, Service]) -> None:
    """Whatever the server's default, a request may ask for tree or flat packing: the same
    eval loss and log-probs, fewer computed tokens for tree; an unknown packing is refused by
    name and changes nothing."""
    import httpx

    _, svc = layout_service
    client = svc.client()
    batch = sft_shared_batch(seed=7)
    step = client.info().step
    bad = httpx.post(
        f"{svc.url}/v1/train_batch", json={"sequences": batch, "packing": "trie"}, timeout=60
    )
    assert bad.status_code == 422 and "packing" in bad.json()["message"], bad.text
    assert client.info().step == step
    tree, flat = (client.eval_batch(batch, packing=p) for p in ("tree", "flat"))
    assert close(tree.loss, flat.loss), (tree.loss, flat.loss)
    _check_packing("tree", tree.metrics)
    _check_packing("flat", flat.metrics)
    a, b = (client.logprobs(batch, packing=p) for p in ("tree", "flat"))
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert np.allclose(x, y, rtol=1e-5, atol=1e-5), (x, y)
