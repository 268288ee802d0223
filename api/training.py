"""The training calls' bodies: ``train_batch``, ``eval_batch``, ``logprobs`` and the split
step (``forward_backward`` + ``optim_step``), and their results.

A batch is a list of token sequences. For each sequence:
    ``tokens``     token ids, each in ``[0, vocab_size)``;
    ``loss_mask``  one 0/1 per token, 1 where the token is a training target (predicted from
                   the tokens before it); defaults to all ones (a policy loss: the sampled
                   positions, below); position 0 is never a target;
    ``weights``    optional per-token loss weights (finite floats), applied where the mask is 1.
The reported loss is the global token mean ``sum(w * nll) / N`` over all ``N`` target tokens
of the batch, whatever the parallel layout.

**Sampled positions.** A policy loss (every kind but cross-entropy) trains on the tokens the
sampler produced. A batch that says which they are, with ``loss_mask`` or ``weights``, is
taken at its word. One that says neither marks them the way RL recipes build their data: the
prompt's ``old_logprobs`` and ``advantages`` are 0 placeholders, so a position is sampled
where either is non-zero (``sampled_positions``). The loss, GSPO's sequence ratio (unless
``sequence_ratio_mask`` names its tokens), the sequence-level corrections and every RL metric
then read those positions only. A sequence with no such position is refused for a
sequence-level loss (gspo, seq-TIS, seq-MIS, geometric-mean masking), naming
``sequence_ratio_mask``: its ratio would be a guess. (A sampled token whose log-prob and
advantage are both exactly 0 reads as a placeholder; it moves no gradient of any loss here.)
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainctl.api.adapters import ADAPTER_DOC, ADAPTER_NAME
from trainctl.api.batch import SequenceBatch
from trainctl.api.bounds import Int64
from trainctl.api.errors import ConflictError, field_error
from trainctl.api.loss import LOSSES, LossConfig


class ModelLimits(BaseModel):
    """What the served model accepts; the gateway checks every batch against it."""

    vocab_size: int
    max_seq_len: int
    max_sequences: int | None = Field(
        None, description="Sequences one request may carry (the gateway's --max-sequences)."
    )
    max_tokens_per_request: int | None = Field(
        None, description="Tokens one request may carry (--max-tokens-per-request)."
    )
    num_layers: int = Field(0, description="Decoder layers (each MoE layer routes tokens).")
    num_experts: int = Field(0, description="Experts per MoE layer; 0: a dense model.")
    moe_topk: int = Field(0, description="Experts each token is routed to.")
    tokenizer: bool = Field(
        False,
        description="The samplers hold the model's tokenizer (from the --init-hf directory): "
        "string stop sequences work.",
    )


class _SequencesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sequences: SequenceBatch = Field(description="The batch; at least one sequence.")
    packing: Literal["flat", "tree"] | None = Field(
        default=None,
        description="'tree': sequences sharing a prefix (a GRPO group, multi-turn siblings) are "
        "packed into prefix tries, so each shared token is computed once; each sequence keeps "
        "its own mask and loss inputs, and the results equal 'flat' packing. Default: the "
        "server's setting.",
    )
    adapter: str | None = Field(default=None, pattern=ADAPTER_NAME, description=ADAPTER_DOC)

    def check_limits(self, limits: ModelLimits) -> None:
        """Raise ``InvalidRequestError`` naming the first field that the model cannot take."""
        n, tokens = len(self.sequences), self.sequences.num_tokens
        if limits.max_sequences is not None and n > limits.max_sequences:
            raise field_error(
                "sequences",
                f"{n} sequences exceed this service's limit of {limits.max_sequences} per "
                "request: split the batch",
            )
        cap = limits.max_tokens_per_request
        if cap is not None and tokens > cap:
            raise field_error(
                "sequences",
                f"{tokens} tokens exceed this service's limit of {cap} per request: split "
                "the batch",
            )
        self.sequences.check_limits(vocab_size=limits.vocab_size, max_seq_len=limits.max_seq_len)
        self.sequences.check_routes(
            layers=limits.num_layers, top_k=limits.moe_topk, num_experts=limits.num_experts
        )

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens


def sampled_positions(batch: SequenceBatch) -> np.ndarray:
    """The positions a policy loss trains on when the batch gives no ``loss_mask`` or
    ``weights``: where ``old_logprobs`` or ``advantages`` is non-zero (the prompt carries 0
    placeholders), as a 0/1 ``loss_mask`` column; no sequence's position 0."""
    marked = np.zeros(batch.num_tokens, bool)
    for name in ("old_logprobs", "advantages"):
        col = batch.column(name)
        if col is not None:
            marked |= col != 0
    marked[batch.offsets[:-1]] = False
    return marked.astype(np.uint8)


class _BatchRequest(_SequencesRequest):
    loss: LossConfig = Field(
        default_factory=lambda: LossConfig(), description="Default: token-mean cross-entropy."
    )
    staleness: Literal["refuse", "report"] = Field(
        default="refuse",
        description="With --max-staleness and sequences that carry their steps (token_steps, "
        "policy_step): 'refuse' answers 409 for sequences more than that many steps behind the "
        "trainer, nothing applied; 'report' trains on them and counts them in the metrics "
        "(stale_sequences:count).",
    )

    @model_validator(mode="after")
    def _loss_inputs_present(self) -> _BatchRequest:
        for k in self.loss.required_inputs():
            if k not in self.sequences.present:
                raise field_error(
                    f"sequences[0].{k}",
                    f"is required by the {self.loss.kind.value} loss"
                    + (" with kl_coef > 0" if k == "ref_logprobs" else ""),
                    sep=" ",
                )
        if self.loss.spec.policy and not ({"loss_mask", "weights"} & set(self.sequences.present)):
            self._train_on_sampled_positions()
        ratio_mask = self.sequences.column("sequence_ratio_mask")
        if ratio_mask is not None:
            if not self.loss.spec.sequence_ratio:
                readers = ", ".join(k.value for k, s in LOSSES.items() if s.sequence_ratio)
                raise field_error(
                    "sequences[0].sequence_ratio_mask",
                    f"is read by the {readers} loss only, not by {self.loss.kind.value}",
                    sep=" ",
                )
            # Position 0 predicts nothing: a mask there is no ratio token.
            counts = np.add.reduceat(ratio_mask.astype(np.int64), self.sequences.offsets[:-1])
            counts -= ratio_mask[self.sequences.offsets[:-1]]
            empty = np.flatnonzero(counts == 0)
            if empty.size:
                raise field_error(
                    f"sequences[{int(empty[0])}].sequence_ratio_mask",
                    f"marks no token after the first: {self.loss.kind.value}'s sequence ratio "
                    "is a mean over at least one token",
                    sep=" ",
                )
        return self

    def _train_on_sampled_positions(self) -> None:
        """No ``loss_mask`` and no ``weights``: the loss reads the sampled positions (the
        module docstring); a sequence-level loss refuses a sequence that marks none."""
        batch = self.sequences
        columns = {**batch.columns, "loss_mask": sampled_positions(batch)}
        self.sequences = SequenceBatch(batch.lengths, columns)
        ratio_tokens = self.loss.spec.sequence_ratio and "sequence_ratio_mask" not in columns
        if ratio_tokens or self.loss.sequence_correction:
            empty = np.flatnonzero(self.sequences.num_targets() == 0)
            if empty.size:
                raise field_error(
                    f"sequences[{int(empty[0])}]",
                    "no position is marked sampled (its old_logprobs and advantages are 0 at "
                    "every target), so its sequence ratio would be a guess: give "
                    "sequence_ratio_mask (or loss_mask / Tinker's weights) over the tokens the "
                    "sampler produced",
                )

    def check_limits(self, limits: ModelLimits) -> None:
        super().check_limits(limits)
        if not self.sequences.num_targets().any():
            raise field_error(
                "sequences",
                "no sequence has a target token (loss_mask = 1 at a position after the first)",
            )


class _ExpectedStep(BaseModel):
    """A call that steps the optimizer: ``expected_step`` guards it."""

    expected_step: Int64 | None = Field(
        default=None,
        description="Apply only if the model is at this step when the operation runs "
        "(409 otherwise, the model untouched): guards against a stale or duplicated update.",
    )

    def check_expected_step(self, step: int) -> None:
        """Raise a 409 ``ConflictError`` unless the model at ``step`` is the one asked for.

        The controller calls this when the operation runs, before touching any rank."""
        if self.expected_step is not None and self.expected_step != step:
            raise ConflictError(
                f"expected_step is {self.expected_step} but the model is at step {step}; "
                "nothing was applied",
                details={"expected_step": self.expected_step, "step": step},
            )


class TrainBatchRequest(_BatchRequest, _ExpectedStep):
    """Forward/backward over the batch and one optimizer step."""


class EvalBatchRequest(_BatchRequest):
    """The same loss as ``train_batch``, without backward or update."""


class ForwardBackwardRequest(_BatchRequest):
    """One part of a split step: forward/backward over the batch, its gradients added to those
    of the calls since the last ``optim_step``; nothing is applied. Several parts then one
    ``optim_step`` equal one ``train_batch`` of all their sequences (the normalisation is
    the union's: docs/algorithms.md §11)."""

    forward_only: bool = Field(
        default=False,
        description="Compute the same loss, log-probs and per-token losses without backward: "
        "no gradients accumulate and the waiting window is untouched (Tinker's forward).",
    )


class OptimStepRequest(_ExpectedStep):
    """Apply the gradients accumulated by ``forward_backward`` with these AdamW settings;
    a setting left out takes the server's. Per-step values let the client own the schedule.
    Every value is finite: an infinite learning rate would turn the weights to NaN."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    adapter: str | None = Field(default=None, pattern=ADAPTER_NAME, description=ADAPTER_DOC)
    lr: float | None = Field(default=None, ge=0, description="Learning rate.")
    beta1: float | None = Field(default=None, ge=0, lt=1, description="Adam beta1.")
    beta2: float | None = Field(default=None, ge=0, lt=1, description="Adam beta2.")
    eps: float | None = Field(default=None, gt=0, description="Adam epsilon.")
    weight_decay: float | None = Field(default=None, ge=0, description="Decoupled weight decay.")
    clip_grad: float | None = Field(
        default=None, ge=0, description="Clip the global gradient norm to this; 0 disables."
    )

    def overrides(self) -> dict[str, float]:
        """The AdamW settings given, by the engine's optimizer-config names."""
        return self.model_dump(exclude_none=True, exclude={"expected_step", "adapter"})


class ForwardBackwardResult(BaseModel):
    """Result of ``forward_backward``."""

    loss: float = Field(
        description="This part's loss under its normalisation, over its own sequences."
    )
    step: int = Field(description="Optimizer steps applied so far (unchanged by this call).")
    logprobs: list[list[float]] = Field(
        description="Per sequence, in request order: log p(tokens[t] | tokens[:t]); 0 at t = 0."
    )
    elementwise_loss: list[list[float]] = Field(
        default_factory=list,
        description="Per sequence, in request order, per token: its loss term times its mask, "
        "weight and (seq_mean_token_mean) 1 / its sequence's target count; the part's loss "
        "is their sum divided by the part's normaliser. 0 where the token is no target.",
    )
    metrics: dict[str, float] = Field(
        description="'tokens:sum', 'computed_tokens:sum', 'loss_tokens:sum', and "
        "'accumulated_parts:value' (parts waiting for optim_step, this one included)."
    )
    timings: dict[str, float] = Field(description="Seconds per phase.")


class LogProbsRequest(_SequencesRequest):
    """Forward only: per-token log-probs of each sequence under the current weights.

    Only ``tokens`` of each sequence is read.
    """

    entropy: bool = Field(False, description="Also return the per-token entropy.")
    return_routes: bool = Field(
        False,
        description="MoE: also return the experts the trainer routed each token through "
        "(``routed_experts``, as the field of a sequence): the given ones where the sequences "
        "carry ``routed_experts`` (replay), else the router's own top-k.",
    )

    def check_limits(self, limits: ModelLimits) -> None:
        super().check_limits(limits)
        if self.return_routes and not limits.num_experts:
            raise field_error("return_routes", "needs a mixture-of-experts model; this is dense")


class LogProbsResult(BaseModel):
    """Per sequence, in request order, one value per token: ``logprobs[i][t]`` is
    ``log p(tokens[t] | tokens[:t])``; position 0 has no prediction and holds 0.0."""

    step: int = Field(description="The policy version the log-probs were computed with.")
    logprobs: list[list[float]]
    entropy: list[list[float]] | None = Field(
        default=None, description="Entropy of the predictive distribution at each position."
    )
    routed_experts: list[list[list[list[int]]]] | None = Field(
        default=None,
        description="With return_routes: per sequence, per token, [layers, top_k] expert ids, "
        "highest router score first.",
    )
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="'tokens:sum' (the batch's tokens) and 'computed_tokens:sum' (the tokens "
        "the model computed: fewer when packing 'tree' shares prefixes).",
    )


class StepResult(BaseModel):
    """Result of ``train_batch`` / ``eval_batch``."""

    loss: float = Field(description="Global token-mean loss over DP x CP (the same on any layout).")
    step: int = Field(description="Optimizer steps applied so far (the policy version).")
    metrics: dict[str, float] = Field(
        description="Named with their reduction, e.g. 'loss:mean', 'tokens:sum', 'grad_norm:value'."
    )
    timings: dict[str, float] = Field(description="Seconds per phase.")
    warnings: list[str] = Field(
        default_factory=list,
        description="What failed beside an applied step (e.g. its scheduled checkpoint): the "
        "step itself stands, so the call succeeds and a retry returns this result.",
    )
