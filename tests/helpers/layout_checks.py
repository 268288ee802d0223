"""The checks a service of any layout must pass against the single-rank engine, driven over
HTTP: log-probs put back together from CP shards and DP ranks in the caller's order, one
train step's loss, grad norm and eval losses, and per-request packing. The batches share
prefixes (a GRPO group, multi-turn siblings), so a tree service computes fewer tokens.

``tests/service/test_layouts.py`` runs them at dp2 x cp2 and tp2 x pp2;
``tests/service/test_service.py`` at dp2 on the shared service, first, while it is at step 0."""

from __future__ import annotations

import httpx
import numpy as np

from helpers.batches import sft_shared_batch
from helpers.servicekit import Service
from helpers.single_process import close, single_process


def logprobs_match_a_single_process_computation(svc: Service, packing: str) -> None:
    """At step 0: the untrained model's log-probs and entropies."""
    client = svc.client()
    assert client.info().step == 0, "this check needs the untrained model"
    batch = sft_shared_batch(seed=6)
    got = client.logprobs(batch, entropy=True)
    want = single_process("logprobs", batch)
    assert [len(x) for x in got.logprobs] == [len(s["tokens"]) for s in batch]
    for g, w in zip(got.logprobs, want, strict=True):
        assert np.allclose(g, w, rtol=1e-5, atol=1e-5), (g, w)
    assert got.entropy is not None and all(e[0] == 0.0 and min(e[1:]) > 0 for e in got.entropy)
    check_packing(packing, got.metrics)


def check_packing(packing: str, metrics: dict[str, float]) -> None:
    """A tree service computed fewer tokens than the batch has; a flat one all of them."""
    tokens, computed = metrics["tokens:sum"], metrics["computed_tokens:sum"]
    if packing == "tree":
        assert 0 < computed < tokens, metrics
    else:
        assert computed == tokens, metrics


def train_step_matches_single_rank(svc: Service, layout: dict[str, int], packing: str) -> None:
    """At step 0: the first step's eval loss before, loss, grad norm and eval loss after."""
    client = svc.client()
    info = client.info()
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
    check_packing(packing, step.metrics)


def a_request_chooses_its_packing(svc: Service) -> None:
    """Whatever the server's default, a request may ask for tree or flat packing: the same
    eval loss and log-probs, fewer computed tokens for tree; an unknown packing is refused by
    name and changes nothing."""
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
    check_packing("tree", tree.metrics)
    check_packing("flat", flat.metrics)
    a, b = (client.logprobs(batch, packing=p) for p in ("tree", "flat"))
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert np.allclose(x, y, rtol=1e-5, atol=1e-5), (x, y)
