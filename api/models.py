"""Request and response models of the HTTP API (pydantic; no torch, no Ray).

A batch is a list of token sequences. For each sequence:
    ``tokens``     token ids, each in ``[0, vocab_size)``;
    ``loss_mask``  one 0/1 per token, 1 where the token is a training target (predicted from
                   the tokens before it); defaults to all ones; position 0 is never a target;
    ``weights``    optional per-token loss weights (finite floats), applied where the mask is 1.
The reported loss is the global token mean ``sum(w * nll) / N`` over all ``N`` target tokens
of the batch, whatever the parallel layout.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model, model_validator

from trainctl.api.batch import SequenceBatch
from trainctl.api.errors import ConflictError, field_error
from trainctl.api.fields import OPTIONAL_FIELDS, PER_TOKEN_FIELDS, FieldKind, TokenField

API_VERSION = "v1"


class LossKind(str, Enum):
    """Per-token loss terms (``lp`` = log p of the target under the current policy)."""

    CROSS_ENTROPY = "cross_entropy"
    """``-lp``: supervised / SFT."""
    IMPORTANCE_SAMPLING = "importance_sampling"
    """``-exp(lp - old_lp) * A``: policy gradient corrected for the behaviour policy."""
    PPO = "ppo"
    """``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` with ``r = exp(lp - old_lp)``."""
    CISPO = "cispo"
    """``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * lp * A``: the clipped ratio weights the
    log-prob's gradient and is not differentiated (MiniMax-M1). ``clip_low`` / ``clip_high``
    are distances from 1 (epsilons), as for PPO."""
    DRO = "dro"
    """``-(lp * A - beta / 2 * (lp - old_lp)^2)``: policy gradient with a quadratic penalty on
    the drift from the sampler's log-probs (``old_logprobs``)."""


class Normalization(str, Enum):
    """How the summed per-token terms are divided, computed once for the global batch."""

    TOKEN_MEAN = "token_mean"
    """Divide by the number of loss tokens in the whole batch."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences (with a loss token) of each sequence's token mean."""
    SUM = "sum"
    """No division."""


def _annotation(f: TokenField) -> Any:
    if f.kind is FieldKind.TOKEN:
        return list[StrictInt]
    if f.kind is FieldKind.MASK:
        return list[Annotated[int, Field(ge=0, le=1, strict=True)]] | None
    return list[float] | None


_SEQUENCE_FIELDS: dict[str, Any] = {
    "tokens": (_annotation(PER_TOKEN_FIELDS[0]), Field(min_length=1, description="Token ids.")),
    **{
        f.name: (_annotation(f), Field(default=None, description=f.description))
        for f in OPTIONAL_FIELDS
    },
}
Sequence: type[BaseModel] = create_model(
    "Sequence",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One token sequence with its per-token fields (``api/fields.py``), as JSON.",
    **_SEQUENCE_FIELDS,
)
"""The JSON shape of one sequence: types are checked here (with field locations), values by
``SequenceBatch`` (lengths, 0/1 masks, finite floats), for JSON and binary bodies alike."""


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


class LossConfig(BaseModel):
    """Which loss the step computes. The normaliser is computed once on the global batch."""

    model_config = ConfigDict(extra="forbid")

    kind: LossKind = LossKind.CROSS_ENTROPY
    normalization: Normalization = Normalization.TOKEN_MEAN
    clip_low: float = Field(0.2, ge=0, le=1, description="PPO: lower ratio bound 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO: upper ratio bound 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference policy.")
    beta: float = Field(
        0.0, ge=0, description="DRO: weight of the quadratic penalty beta / 2 * (lp - old_lp)^2."
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Truncated importance sampling: each policy term times "
        "min(exp(old_logprobs - sampler_logprobs), tis_cap), correcting the train/sampler "
        "mismatch (needs sampler_logprobs; not for cross_entropy).",
    )

    @model_validator(mode="after")
    def _tis_needs_a_policy_loss(self) -> LossConfig:
        if self.tis_cap is not None and self.kind is LossKind.CROSS_ENTROPY:
            raise ValueError("tis_cap corrects a policy loss; cross_entropy has no ratio to cap")
        return self

    def required_inputs(self) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if self.kind is not LossKind.CROSS_ENTROPY:
            out += ("advantages", "old_logprobs")
        if self.kl_coef > 0:
            out += ("ref_logprobs",)
        if self.tis_cap is not None:
            out += ("sampler_logprobs",)
        return out

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``workers/ops/loss.per_token_terms`` for this loss (the
        normalisation is not among them: the host folds it into each token's loss scale)."""
        return {
            "kind": self.kind.value,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "kl_coef": self.kl_coef,
            "beta": self.beta,
            "tis_cap": self.tis_cap,
        }


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

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens


class _BatchRequest(_SequencesRequest):
    loss: LossConfig = Field(
        default_factory=lambda: LossConfig(), description="Default: token-mean cross-entropy."
    )

    @model_validator(mode="after")
    def _loss_inputs_present(self) -> _BatchRequest:
        for k in self.loss.required_inputs():
            if k not in self.sequences.present:
                raise ValueError(
                    f"sequences[0].{k} is required by the {self.loss.kind.value} loss"
                    + (" with kl_coef > 0" if k == "ref_logprobs" else "")
                )
        return self

    def check_limits(self, limits: ModelLimits) -> None:
        super().check_limits(limits)
        if not self.sequences.num_targets().any():
            raise field_error(
                "sequences",
                "no sequence has a target token (loss_mask = 1 at a position after the first)",
            )


class _ExpectedStep(BaseModel):
    """A call that steps the optimizer: ``expected_step`` guards it."""

    expected_step: int | None = Field(
        default=None,
        ge=0,
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
    a setting left out takes the server's. Per-step values let the client own the schedule."""

    model_config = ConfigDict(extra="forbid")

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
        return self.model_dump(exclude_none=True, exclude={"expected_step"})


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


class LogProbsResult(BaseModel):
    """Per sequence, in request order, one value per token: ``logprobs[i][t]`` is
    ``log p(tokens[t] | tokens[:t])``; position 0 has no prediction and holds 0.0."""

    step: int = Field(description="The policy version the log-probs were computed with.")
    logprobs: list[list[float]]
    entropy: list[list[float]] | None = Field(
        default=None, description="Entropy of the predictive distribution at each position."
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


class MemoryProfileStartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_entries: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="CUDA: ring-buffer size of the allocation history. CPU: the recording "
        "stops after 10 minutes instead (stop still writes it).",
    )


class MemoryProfileStarted(BaseModel):
    profile_id: str
    ranks: int


class ProfileFile(BaseModel):
    name: str = Field(description="Download: GET /v1/memory_profiles/{profile_id}/files/{name}.")
    rank: int
    coords: dict[str, int] = Field(description="dp/cp/tp/pp coordinates of the rank.")
    size_bytes: int
    picture: str | None = Field(
        default=None, description="File name of the PNG of allocated memory over time."
    )


class MemoryProfileResult(BaseModel):
    profile_id: str
    files: list[ProfileFile]


class MemoryProfileList(BaseModel):
    profiles: list[MemoryProfileResult] = Field(description="Oldest first.")


class RankInfo(BaseModel):
    rank: int
    coords: dict[str, int]
    weights_digest: str | None = Field(
        description="sha256 of this rank's shards; null while the workers are being rebuilt."
    )
    pid: int | None = Field(default=None, description="Process id of the rank actor.")
    node: str | None = Field(
        default=None, description="The node it runs on: '<address>/<Ray node id prefix>'."
    )


class CheckpointInfo(BaseModel):
    """A saved training state: weights, optimizer state, step and RNG of every rank."""

    checkpoint_id: str = Field(description="Load: POST /v1/checkpoints/{checkpoint_id}/load.")
    step: int
    created_at: float = Field(description="Unix seconds.")
    layout: dict[str, int] = Field(description="It loads into this parallel layout only.")
    weights_digest: str
    size_bytes: int
    sequence: int = Field(
        0, description="Save order: the highest is the latest, whatever its step."
    )


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointInfo] = Field(description="Oldest save first.")


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="Directory name under the server's export root; default: step-NNNNNN.",
    )
    overwrite: bool = Field(
        default=False, description="Replace an export of the same name (else 409)."
    )


class ExportResult(BaseModel):
    """A Hugging Face checkpoint of the model's family (config.json + model.safetensors) on the
    server."""

    name: str
    step: int
    path: str = Field(description="Server-side directory: load it with transformers or vLLM.")
    files: dict[str, int] = Field(description="File name -> size in bytes.")


class RecoveryInfo(BaseModel):
    """The last time the worker group was rebuilt after a failure."""

    at: float = Field(description="Unix seconds.")
    cause: str
    restored_checkpoint: str | None = Field(description="None: restarted from the start weights.")
    step_before: int = Field(description="The step the model had reached before the failure.")
    step_after: int = Field(description="The step restored.")

    @property
    def steps_lost(self) -> int:
        return self.step_before - self.step_after


class Info(BaseModel):
    """What is being served."""

    model_config = ConfigDict(protected_namespaces=())

    model_name: str = Field(
        default="trainctl-tiny",
        description="The served model's name: the Hugging Face directory's name when started "
        "from one (init_hf), 'trainctl-tiny' for the embedded default.",
    )
    model: dict[str, float | int | str]
    layout: dict[str, int]
    engine: dict[str, float | int | str]
    world_size: int
    step: int
    weights_digest: str | None = Field(
        description="sha256 over the DP-replica-0 shards: equal digests, equal weights. "
        "null only while the workers are being rebuilt (not ready)."
    )
    ranks: list[RankInfo]
    versions: dict[str, str]
    limits: ModelLimits
    recovery: RecoveryInfo | None = Field(
        default=None, description="Set once the workers were rebuilt after a failure."
    )
    steps_lost: int = Field(
        default=0, description="Steps undone by recoveries (0: nothing was ever lost)."
    )


class Health(BaseModel):
    status: str
    service: Literal["trainctl"] = Field(
        description="Always 'trainctl': a readiness check tells this service from whatever "
        "else may answer on its port."
    )
    instance: str = Field(
        "", description="This start of the service (--instance-id, else random per start)."
    )
