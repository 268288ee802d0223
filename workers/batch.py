"""Typed host-side batches: what the controller plans and the ranks consume.

numpy only (no torch): the controller builds these without loading the engine, and they travel
through Ray's object store zero-copy.

Conventions (one sequence of length ``L``):
    ``loss_mask[t] = 1`` means token ``t`` is a training target (predicted from tokens ``< t``);
    ``loss_mask[0]`` is ignored, nothing predicts the first token.
After packing, position ``t`` of a sequence carries ``labels[t] = tokens[t+1]`` and
``loss_weight[t] = loss_mask[t+1] * weights[t+1]``: the roll happens on the whole sequence
*before* any context-parallel split, and the last token of every sequence and every pad get
weight 0 (shared/design/ALGORITHMS.md §1.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class HostSequence:
    """One request sequence, validated by the gateway."""

    tokens: np.ndarray  # [L] int64
    loss_mask: np.ndarray  # [L] float32, 1 where the token is a target
    weights: np.ndarray | None = None  # [L] float32 per-token loss weights, or None for 1

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Targets that count in the loss: masked tokens after position 0."""
        return int(np.count_nonzero(self.loss_mask[1:]))

    def rolled(self) -> tuple[np.ndarray, np.ndarray]:
        """``(labels [L] int64, loss_weight [L] float32)`` for next-token prediction."""
        labels = np.zeros_like(self.tokens)
        labels[:-1] = self.tokens[1:]
        target_w = self.loss_mask if self.weights is None else self.loss_mask * self.weights
        loss_weight = np.zeros(len(self), dtype=np.float32)
        loss_weight[:-1] = target_w[1:]
        return labels, loss_weight


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """Sequences packed into 1-D tensors, each right-padded to the layout's pad multiple."""

    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, restarting at 0 for each sequence
    labels: np.ndarray  # [T] int64, next token (rolled before any split)
    loss_weight: np.ndarray  # [T] float32, 0 at pads and at each sequence's last token
    cu_seqlens: np.ndarray  # [B+1] int32, padded sequence boundaries
    seq_index: np.ndarray  # [B] int64, index in the request; -1 for a pad-only sequence
    seq_lens: np.ndarray  # [B] int64, unpadded lengths
    is_dummy: bool = False
    """A placeholder that keeps this DP rank in step with its peers; contributes zero loss."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if len(self.cu_seqlens) > 1 else 0


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The dispatch plan of one step: micro-batches per DP rank plus global normalisers."""

    microbatches: tuple[tuple[PackedMicroBatch, ...], ...]  # [dp][num_microbatches]
    loss_normalizer: float
    """Global count of loss tokens N: every rank divides its local loss sum by it."""
    num_sequences: int
    num_tokens: int
    """Real (unpadded) tokens in the request."""
    num_loss_tokens: int

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0])

    @property
    def num_dummies(self) -> int:
        return sum(mb.is_dummy for shard in self.microbatches for mb in shard)

    @property
    def padded_tokens(self) -> int:
        return sum(mb.num_tokens for shard in self.microbatches for mb in shard)
