"""The dispatch plan of one step: every DP rank's micro-batches and the global normalisers.

numpy only (no torch): the controller builds plans without loading the engine, and they travel
through Ray's object store zero-copy. The micro-batches themselves are the engine's input type
(``workers/engine/boundary.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainctl.api.models import LossConfig
from trainctl.workers.engine.boundary import PackedMicroBatch


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
    adapter: str | None = None
    """The LoRA adapter the ranks compute with (None: the base)."""

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
