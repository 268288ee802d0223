"""Typed host-side batches: what the controller plans and the ranks consume.

numpy only (no torch): the controller builds these without loading the engine, and they travel
through Ray's object store zero-copy. A request's sequences arrive as ``api.SequenceBatch``
columns; ``batch[i]`` (an ``api.TokenSequence`` of views) is what the planner packs.

Conventions (one sequence of length ``L``): every per-token array is aligned with ``tokens``;
``loss_mask[t] = 1`` means token ``t`` is a training target (predicted from tokens ``< t``),
and each loss input (``api/fields.py``: ``advantages``, ``old_logprobs``, ...) at ``[t]``
belongs to token ``t``. ``loss_mask[0]`` is ignored: nothing predicts the first token.

Packing rolls every per-token array by one *before* any context-parallel split: position ``t``
then carries ``labels[t] = tokens[t+1]`` and the loss inputs of token ``t+1``, and the last
position of every sequence and every pad get mask 0 (docs/algorithms.md §1.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainctl.api.fields import LOSS_INPUTS
from trainctl.api.models import LossConfig

PACKED_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "loss_scale", "seq_id")
"""Per-token arrays every packed micro-batch has; the loss inputs present come after them."""


@dataclass(frozen=True, kw_only=True)
class TreeLayout:
    """What the model computes for a micro-batch packed as prefix tries (docs/algorithms.md
    §10), beside the micro-batch's flat per-token arrays, which stay per sequence.

    The model runs over ``N`` trie rows; the loss over the ``M`` flat positions of the member
    sequences, position ``j`` reading the hidden state of trie row ``rows[j]``: a shared token
    is computed once, and each sequence through it keeps its own labels, mask and loss inputs.
    """

    input_ids: np.ndarray  # [N] int64, tries depth-first, each padded to the pad multiple
    position_ids: np.ndarray  # [N] int64, each token's depth
    cu_seqlens: np.ndarray  # [tries + 1] int32, padded trie boundaries
    segments: np.ndarray
    """int64 segment table (``workers/control/trie.encode_segments``): who attends to whom."""
    rows: np.ndarray  # [M] int64, the trie row of each flat position (pads: row 0)
    computed_tokens: int
    """Real trie tokens (no pads): the tokens after sharing."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seqlen(self) -> int:
        """The longest trie, padded."""
        return _max_len(self.cu_seqlens)


def _max_len(cu_seqlens: np.ndarray) -> int:
    return int(np.diff(cu_seqlens).max()) if len(cu_seqlens) > 1 else 0


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """Sequences packed into 1-D arrays, each right-padded to the layout's pad multiple.

    ``per_token`` holds, each ``[T]``: ``input_ids`` (int64), ``position_ids`` (int64,
    restarting at 0 per sequence), ``labels`` (int64, the next token, rolled before any split),
    ``loss_mask`` (fp32, 1 where the next token is a target; 0 at pads), ``loss_scale`` (fp64,
    mask * weight / the global normaliser), ``seq_id`` (int64, the packed sequence of each
    position), then every loss input the batch carries (fp32, rolled).
    """

    per_token: dict[str, np.ndarray]
    cu_seqlens: np.ndarray  # [B+1] int32, padded sequence boundaries
    seq_index: np.ndarray  # [B] int64, index in the request; -1 for a pad-only sequence
    seq_lens: np.ndarray  # [B] int64, unpadded lengths
    is_dummy: bool = False
    """A placeholder that keeps this DP rank in step with its peers; contributes zero loss."""
    tree: TreeLayout | None = None
    """Set when the sequences are packed as prefix tries: the model computes the tries, and
    ``per_token`` (the flat arrays above) is the loss side, read through ``tree.rows``."""

    @property
    def input_ids(self) -> np.ndarray:
        return self.per_token["input_ids"]

    @property
    def position_ids(self) -> np.ndarray:
        return self.per_token["position_ids"]

    @property
    def labels(self) -> np.ndarray:
        return self.per_token["labels"]

    @property
    def loss_mask(self) -> np.ndarray:
        return self.per_token["loss_mask"]

    @property
    def loss_scale(self) -> np.ndarray:
        return self.per_token["loss_scale"]

    @property
    def seq_id(self) -> np.ndarray:
        return self.per_token["seq_id"]

    @property
    def loss_inputs(self) -> tuple[str, ...]:
        """Names of the per-token loss inputs this micro-batch carries, in field order."""
        return tuple(k for k in LOSS_INPUTS if k in self.per_token)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seqlen(self) -> int:
        return _max_len(self.cu_seqlens)

    @property
    def model_tokens(self) -> int:
        """Rows the model computes: the tries' (tree) or the flat tokens (padded)."""
        return self.tree.num_tokens if self.tree is not None else self.num_tokens

    @property
    def computed_tokens(self) -> int:
        """Real tokens the model computes (no pads; shared prefixes once); 0 for a dummy."""
        if self.is_dummy:
            return 0
        return self.tree.computed_tokens if self.tree is not None else int(self.seq_lens.sum())


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The dispatch plan of one step: micro-batches per DP rank plus global normalisers."""

    microbatches: tuple[tuple[PackedMicroBatch, ...], ...]  # [dp][num_microbatches]
    loss_normalizer: float
    """Global count of loss tokens N."""
    num_loss_sequences: int
    """Sequences with at least one loss token (the sequence-mean normaliser; a step that
    arrives in parts needs the per-part counts to normalise by sequence)."""
    num_sequences: int
    num_tokens: int
    """Real (unpadded) tokens in the request."""
    loss: LossConfig = field(default_factory=LossConfig)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0])

    @property
    def num_dummies(self) -> int:
        return sum(mb.is_dummy for shard in self.microbatches for mb in shard)

    @property
    def padded_tokens(self) -> int:
        return sum(mb.model_tokens for shard in self.microbatches for mb in shard)

    @property
    def computed_tokens(self) -> int:
        """Real tokens the model computes: ``num_tokens`` less what prefix sharing saved."""
        return sum(mb.computed_tokens for shard in self.microbatches for mb in shard)
