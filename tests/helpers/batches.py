"""The batches the tests send, as JSON-shaped sequences (``to_host`` makes them typed)."""

from __future__ import annotations

from typing import Any

import numpy as np


def ragged_batch(seed: int = 0, vocab: int = 512) -> list[dict[str, Any]]:
    """Ragged sequences with prompt masks and RL inputs; one weighted, one with no target."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((37, 5, 64, 19, 2, 41, 12, 30)):
        prompt = int(rng.integers(1, max(2, n // 2)))
        seq: dict[str, Any] = {
            "tokens": rng.integers(0, vocab, n).tolist(),
            "loss_mask": [0] * prompt + [1] * (n - prompt),
            "advantages": rng.normal(size=n).tolist(),
            "old_logprobs": (-rng.uniform(4, 8, n)).tolist(),
            "ref_logprobs": (-rng.uniform(4, 8, n)).tolist(),
        }
        if i == 3:
            seq["weights"] = rng.uniform(0.5, 2.0, n).tolist()
        if i == 4:
            seq["loss_mask"] = [0] * n
        out.append(seq)
    return out


def shared_batch(
    seed: int = 0, vocab: int = 512, groups: tuple[str, ...] = ("grpo", "turns", "other")
) -> list[dict[str, Any]]:
    """Sequences that share prefixes, each with its own mask and RL inputs (so shared tokens
    carry different advantages): a GRPO group of 4 responses to one prompt; multi-turn
    siblings branching at several depths, one of them a prefix of another and one an identical
    duplicate; and an unrelated sequence."""
    rng = np.random.default_rng(seed)

    def tok(n: int) -> list[int]:
        return rng.integers(1, vocab, n).tolist()

    seqs: list[tuple[list[int], int]] = []  # (tokens, prompt length)
    if "grpo" in groups:
        prompt = tok(20)
        seqs += [(prompt + tok(n), 20) for n in (9, 14, 3, 11)]
    if "turns" in groups:
        t1, t2, t3 = tok(10), tok(7), tok(6)
        seqs += [
            (t1 + t2 + t3, 10),
            (t1 + t2 + tok(8), 10),
            (t1 + tok(5), 10),
            (t1 + t2, 10),  # a prefix of the first two
            (t1 + t2 + t3, 10),  # a duplicate of the first
        ]
    if "other" in groups:
        seqs.append((tok(23), 4))
    out = []
    for tokens, prompt in seqs:
        n = len(tokens)
        out.append(
            {
                "tokens": tokens,
                "loss_mask": [0] * prompt + [1] * (n - prompt),
                "advantages": rng.normal(size=n).tolist(),
                "old_logprobs": (-rng.uniform(4, 8, n)).tolist(),
                "ref_logprobs": (-rng.uniform(4, 8, n)).tolist(),
            }
        )
    out[1]["weights"] = rng.uniform(0.5, 2.0, len(out[1]["tokens"])).tolist()
    return out


def with_sampler(batch: list[dict[str, Any]], seed: int = 3) -> list[dict[str, Any]]:
    """The batch plus the inference engine's log-probs, off the behaviour log-probs, and a
    ratio mask (gspo's) on about two thirds of each sequence's loss tokens."""
    rng = np.random.default_rng(seed)
    return [
        {
            **s,
            "sampler_logprobs": (
                np.asarray(s["old_logprobs"]) + rng.normal(0, 0.3, len(s["tokens"]))
            ).tolist(),
            "sequence_ratio_mask": (
                np.asarray(s["loss_mask"]) * (rng.random(len(s["tokens"])) < 0.7)
            ).tolist(),
        }
        for s in batch
    ]


def to_host(batch: list[dict[str, Any]]) -> list[Any]:
    from trainctl.api import TokenSequence

    def arr(s: dict[str, Any], k: str) -> np.ndarray | None:
        return None if k not in s else np.asarray(s[k], np.float32)

    return [
        TokenSequence(
            tokens=np.asarray(s["tokens"], np.int64),
            loss_mask=np.asarray(s["loss_mask"], np.float32),
            weights=arr(s, "weights"),
            advantages=arr(s, "advantages"),
            old_logprobs=arr(s, "old_logprobs"),
            ref_logprobs=arr(s, "ref_logprobs"),
            sampler_logprobs=arr(s, "sampler_logprobs"),
            sequence_ratio_mask=arr(s, "sequence_ratio_mask"),
        )
        for s in batch
    ]


def numpy_shards(shards: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in shards.items()}


def sft_batch(seed: int, vocab: int = 512) -> list[dict]:
    """Ragged sequences with prompt masks only (an SFT batch)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (23, 7, 48, 3, 31):
        tokens = rng.integers(0, vocab, n).tolist()
        prompt = int(rng.integers(1, n))
        out.append({"tokens": tokens, "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return out


def sft_shared_batch(seed: int, vocab: int = 512) -> list[dict]:
    """``sft_batch`` plus sequences that share prefixes, with their own masks."""
    rng = np.random.default_rng(100 + seed)
    prompt = rng.integers(1, vocab, 17).tolist()
    turn = rng.integers(1, vocab, 9).tolist()
    shared = [prompt + rng.integers(1, vocab, n).tolist() for n in (6, 11, 4, 8)]
    shared += [prompt + turn, prompt + turn + rng.integers(1, vocab, 5).tolist()]
    return sft_batch(seed) + [
        {"tokens": s, "loss_mask": [0] * 17 + [1] * (len(s) - 17)} for s in shared
    ]
