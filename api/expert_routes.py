"""The checks of ``routed_experts`` (MoE routing replay), numpy only: the one per-token field
with a shape of its own, ``[tokens, layers, top_k]`` (``api/fields.py``). ``SequenceBatch``
runs them, naming the sequence and token of the first bad value."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trainctl.api.errors import field_error

Locate = Callable[[int], tuple[int, int]]
"""A flat token index -> (sequence, position)."""


def of_sequence(v: Any, where: str) -> np.ndarray:
    """One sequence's ``[tokens, layers, top_k]`` expert ids as int64."""
    try:
        a = np.asarray(v)
    except ValueError:  # ragged nested lists
        raise field_error(where, "must be [tokens, layers, top_k]: rows differ in length") from None
    if a.ndim != 3:
        raise field_error(where, f"must be [tokens, layers, top_k], got {a.ndim} dimensions")
    if a.size and a.dtype.kind not in "iu":
        raise field_error(where, f"must be integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def check_same_shape(name: str, parts: Sequence[np.ndarray]) -> None:
    """Every sequence's routes have the same ``[layers, top_k]``."""
    shapes = [p.shape[1:] for p in parts]
    k = next((k for k, sh in enumerate(shapes) if sh != shapes[0]), None)
    if k is not None:
        raise field_error(
            f"sequences[{k}].{name}",
            f"is [tokens, {shapes[k][0]}, {shapes[k][1]}] but sequences[0]'s is "
            f"[tokens, {shapes[0][0]}, {shapes[0][1]}]",
        )


def check_column(name: str, col: np.ndarray, total: int, locate: Locate) -> None:
    """``[total, layers, top_k]`` integers, each token's ids at a layer distinct and >= 0 (the
    model's shape and expert range: ``check_fit``)."""
    if col.ndim != 3 or col.shape[0] != total:
        raise field_error(
            name,
            f"must be [tokens, layers, top_k] with {total} tokens in all, got shape "
            f"{list(col.shape)}",
        )
    if col.dtype.kind not in "iu":
        raise field_error(name, f"must be integers, got {col.dtype}")
    if col.size == 0:
        return
    ordered = np.sort(col, axis=2)
    bad = (col < 0).any(axis=(1, 2)) | (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=(1, 2))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        i, j = locate(k)
        raise field_error(
            f"sequences[{i}].{name}[{j}]",
            f"each layer's experts must be distinct ids >= 0, got {col[k].tolist()}",
        )


def check_fit(col: np.ndarray, locate: Locate, layers: int, top_k: int, num_experts: int) -> None:
    """The routes fit a model of ``layers`` MoE layers, ``top_k`` of ``num_experts`` each."""
    if not num_experts:
        raise field_error(
            "routed_experts", "routing replay needs a mixture-of-experts model; this is dense"
        )
    if col.shape[1:] != (layers, top_k):
        raise field_error(
            "routed_experts",
            f"must be [tokens, {layers}, {top_k}] (this model's layers and top-k), got "
            f"[tokens, {col.shape[1]}, {col.shape[2]}]",
        )
    if col.size and col.max() >= num_experts:
        k = int(np.flatnonzero((col >= num_experts).any(axis=(1, 2)))[0])
        i, j = locate(k)
        raise field_error(
            f"sequences[{i}].routed_experts[{j}]",
            f"expert ids must be in [0, {num_experts}), got {col[k].tolist()}",
        )
