"""What crosses the controller-to-rank boundary, in both directions: typed and torch-free.

The controller plans a step on the host with numpy and hands each rank its micro-batches
(``PackedMicroBatch``); a rank answers with typed records (``StepReport``, ``Applied``,
``RankMeta``, ...), never dicts or tuples. The engine depends on this module; the control
room imports it too, so the arrows run one way: control -> engine -> ops.

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
from typing import Any

import numpy as np

from trainctl.api.fields import LOSS_INPUTS

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
    """int64 segment table (``workers/control/trie.py:encode_segments``): who attends to whom."""
    rows: np.ndarray  # [M] int64, the trie row of each flat position (pads: row 0)
    computed_tokens: int
    """Real trie tokens (no pads): the tokens after sharing."""
    routes: np.ndarray | None = None
    """``[N, layers, top_k]`` int64: each trie row's replayed experts (``routed_experts``)."""

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
class RankCoords:
    """Where a rank sits in the parallel layout."""

    rank: int
    dp: int
    cp: int
    tp: int
    pp: int
    ep: int = 0

    def file_stem(self) -> str:
        return f"snapshot_rank{self.rank:02d}_p{self.pp}d{self.dp}c{self.cp}t{self.tp}"

    def grid(self) -> dict[str, int]:
        """The dense coordinates, as logs and profile records name them."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp}


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one rank reports for a pass; the controller merges the reports of all ranks."""

    coords: RankCoords
    is_last_stage: bool
    loss: float
    """Global token-mean loss (already reduced over DP x CP); meaningful on the last stage."""
    grad_norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


PerSequence = dict[int, tuple[np.ndarray, np.ndarray | None]]
"""Per-token arrays of each real sequence, by its index in the request: ``(log-probs, loss
shares)`` from a ``forward_backward`` part, ``(log-probs, entropy or None)`` from
``logprobs``. Reported by TP rank 0, CP rank 0 of the last stage; empty on every other rank."""


@dataclass(frozen=True, kw_only=True)
class RouteShard:
    """The experts one rank's routers chose for some tokens of one sequence, at some layers:
    ``experts[p, l]`` are token ``positions[p]``'s top-k ids at layer ``layers[l]``."""

    positions: np.ndarray  # [p] int64
    layers: np.ndarray  # [l] int64, global layer indices
    experts: np.ndarray  # [p, l, top_k] int16


@dataclass(frozen=True, kw_only=True)
class LogProbsPart:
    """One rank's answer to ``logprobs``."""

    per_sequence: PerSequence
    routes: dict[int, RouteShard] = field(default_factory=dict)
    """Asked for routes: this rank's pieces, by request index (every rank may have some)."""


@dataclass(frozen=True, kw_only=True)
class PartResult:
    """One rank's answer to a ``forward_backward`` part."""

    report: StepReport
    per_sequence: PerSequence


@dataclass(frozen=True, kw_only=True)
class Applied:
    """One rank's optimizer update (phase 2 of a step)."""

    grad_norm: float
    """The pre-clip global gradient norm the update used."""
    seconds: float


@dataclass(frozen=True, kw_only=True)
class RankMeta:
    """What a rank says of itself once its shard is built."""

    coords: RankCoords
    parameters: int
    """Parameters this rank holds (tied copies once)."""
    pid: int
    node: str
    """``address/node-id`` of the Ray node it runs on."""


@dataclass(frozen=True, kw_only=True)
class PeerStep:
    """What a surviving rank of a lost group holds: the base's optimizer step and each
    adapter's (``workers/control/peers.py`` restores from survivors only if they agree)."""

    step: int
    adapters: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class WrittenFile:
    """A file a rank wrote (a checkpoint shard, an export file): its name, size and, for a
    checkpoint shard, the sha256 of its bytes and the AdamW moment tensors it holds."""

    name: str
    size_bytes: int
    sha256: str = ""
    moments: int = 0
    weights_digest: str = ""
    """A background checkpoint write: this rank's ``weights_digest`` at the copied step,
    hashed by the writing thread (a synchronous save asks the ranks for it instead)."""


@dataclass(frozen=True, kw_only=True)
class RankProfile:
    """One rank's memory profile, as bytes: the controller stores it."""

    name: str
    coords: RankCoords
    data: bytes


@dataclass(frozen=True, kw_only=True)
class OwnedShards:
    """The parameters a rank adds to one full copy of the model, by canonical name, with its
    TP coordinate: what an export merges."""

    tp: int
    shards: dict[str, Any]
    """Canonical name -> tensor (a ``torch.Tensor``; typed loosely to keep this torch-free)."""


LORA_TARGETS = ("attn", "mlp", "unembed")
"""What an adapter may adapt (Tinker's ``train_attn``, ``train_mlp``, ``train_unembed``)."""


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """One LoRA adapter as created: PEFT's rank, alpha and dropout, what it adapts, its seed."""

    name: str
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterSpec:
        return cls(**{**d, "targets": tuple(d["targets"])})


@dataclass(frozen=True, kw_only=True)
class AdapterInfo:
    """An adapter as one rank holds it: its spec, optimizer steps, bytes and last use."""

    spec: AdapterSpec
    step: int
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class OpRef:
    """The operation a rank call works for: its id (the rank's log lines and spans carry it)
    and the W3C ``traceparent`` of the controller's span for it, so that the rank's spans
    join the operation's trace."""

    id: str = "-"
    traceparent: str | None = None
