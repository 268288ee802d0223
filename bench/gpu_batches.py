"""The batches of the GPU benchmark: packed rows of equal sequences, and a ragged row shaped
like an RL batch (many distinct lengths, which takes the varlen attention path)."""

from __future__ import annotations

import math

import numpy as np

RAGGED_MIN_DISTINCT = 30


def packed(tokens: int, seq_len: int) -> list[int]:
    """``tokens // seq_len`` sequences of ``seq_len`` tokens."""
    return [seq_len] * (tokens // seq_len)


def ragged(tokens: int, low: int = 128, high: int = 4096, seed: int = 0) -> list[int]:
    """Log-normal lengths between ``low`` and ``high`` summing to exactly ``tokens``, in the
    order drawn (a fixed ``seed``: the same batch on every machine). The median is about a
    seventh of ``high`` and the tail reaches it, as completions of a GRPO step do; the last
    length takes the remainder (a remainder under ``low`` joins the shortest sequence)."""
    if tokens < low:
        raise ValueError(f"tokens ({tokens}) must be at least low ({low})")
    rng = np.random.default_rng(seed)
    mu, sigma = math.log(high / 7), 1.0
    out: list[int] = []
    while sum(out) < tokens:
        n = int(np.clip(round(rng.lognormal(mu, sigma)), low, high))
        out.append(min(n, tokens - sum(out)))
    if out[-1] < low:
        rest = out.pop()
        i = int(np.argmin(out))
        out[i] += rest
    return out


def parse(spec: str) -> list[int]:
    """An explicit ragged spec, ``"32x512+4x4096"``: 32 sequences of 512 and 4 of 4,096."""
    out: list[int] = []
    for part in spec.split("+"):
        count, length = part.split("x")
        out += [int(length)] * int(count)
    return out


def sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids, one list per length (the same for every side of a row)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]
