"""Typed host-side batches: what the controller plans and the ranks consume.

numpy only (no torch): the controller builds these without loading the engine, and they travel
through Ray's object store zero-copy.

Conventions (one sequence of length ``L``): every per-token array is aligned with ``tokens``;
``loss_mask[t] = 1`` means token ``t`` is a training target (predicted from tokens ``< t``),
and ``advantages[t]`` / ``old_logprobs[t]`` / ``ref_logprobs[t]`` belong to token ``t``.
``loss_mask[0]`` is ignored: nothing predicts the first token.

Packing rolls every per-token array by one *before* any context-parallel split: position ``t``
then carries ``labels[t] = tokens[t+1]`` and the loss inputs of token ``t+1``, and the last
position of every sequence and every pad get mask 0 (docs/algorithms.md §1.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from trainctl.api.models import LossKind


class LossOptions(TypedDict):
    """Keyword arguments of ``ops.loss.per_token_terms``."""

    kind: str
    clip_low: float
    clip_high: float
    kl_coef: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """Which per-token loss to compute (the normalisation is already in ``loss_scale``)."""

    kind: LossKind = LossKind.CROSS_ENTROPY
    clip_low: float = 0.2
    """PPO: lower ratio clip ``1 - clip_low``."""
    clip_high: float = 0.2
    """PPO: upper ratio clip ``1 + clip_high`` (decoupled from the lower one)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy; needs ``ref_logprobs``."""

    def options(self) -> LossOptions:
        """The keyword arguments of ``ops.loss.per_token_terms`` for this loss."""
        return {
            "kind": self.kind.value,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "kl_coef": self.kl_coef,
        }

    def needs(self) -> tuple[str, ...]:
        """The per-token inputs this loss reads besides the log-probs."""
        out: tuple[str, ...] = ()
        if self.kind is not LossKind.CROSS_ENTROPY:
            out += ("advantages", "old_logprobs")
        if self.kl_coef:
            out += ("ref_logprobs",)
        return out


LOSS_INPUTS = ("advantages", "old_logprobs", "ref_logprobs")
"""Optional per-token inputs of the RL losses, rolled and split like the loss mask."""


@dataclass(frozen=True, kw_only=True)
class HostSequence:
    """One request sequence, validated by the gateway."""

    tokens: np.ndarray  # [L] int64
    loss_mask: np.ndarray  # [L] float32, 1 where the token is a target
    weights: np.ndarray | None = None  # [L] float32 per-token loss weights; None = 1
    advantages: np.ndarray | None = None  # [L] float32
    old_logprobs: np.ndarray | None = None  # [L] float32
    ref_logprobs: np.ndarray | None = None  # [L] float32

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Targets that count in the loss: masked tokens after position 0."""
        return int(np.count_nonzero(self.loss_mask[1:]))

    def rolled(self, name: str) -> np.ndarray:
        """``tokens`` or a per-token array shifted so position ``t`` holds token ``t+1``'s value.

        The last position gets 0 (and the mask is 0 there, so it never counts).
        """
        x = getattr(self, name)
        out = np.zeros_like(x)
        out[:-1] = x[1:]
        return out


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """Sequences packed into 1-D arrays, each right-padded to the layout's pad multiple."""

    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, restarting at 0 for each sequence
    labels: np.ndarray  # [T] int64, next token (rolled before any split)
    loss_mask: np.ndarray  # [T] float32, 1 where the next token is a target; 0 at pads
    loss_scale: np.ndarray  # [T] float64, mask * weight / global normaliser
    seq_id: np.ndarray  # [T] int64, which packed sequence each position belongs to
    cu_seqlens: np.ndarray  # [B+1] int32, padded sequence boundaries
    seq_index: np.ndarray  # [B] int64, index in the request; -1 for a pad-only sequence
    seq_lens: np.ndarray  # [B] int64, unpadded lengths
    advantages: np.ndarray | None = None  # [T] float32, rolled
    old_logprobs: np.ndarray | None = None  # [T] float32, rolled
    ref_logprobs: np.ndarray | None = None  # [T] float32, rolled
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
    """Global count of loss tokens N."""
    num_loss_sequences: int
    """Sequences with at least one loss token (the sequence-mean normaliser)."""
    num_sequences: int
    num_tokens: int
    """Real (unpadded) tokens in the request."""
    loss: LossSpec = LossSpec()

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0])

    @property
    def num_dummies(self) -> int:
        return sum(mb.is_dummy for shard in self.microbatches for mb in shard)

    @property
    def padded_tokens(self) -> int:
        return sum(mb.num_tokens for shard in self.microbatches for mb in shard)
