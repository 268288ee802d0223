"""Request and response models of the HTTP API (pydantic; no torch, no Ray): the service's
own (info, health, checkpoints, exports, memory profiles) here, and every model of the API
by name, from the modules of its family: ``loss.py``, ``sequence.py``, ``training.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainctl.api.adapters import ADAPTER_NAME
from trainctl.api.loss import LossConfig, LossKind, Normalization
from trainctl.api.sampling import SamplersInfo
from trainctl.api.sequence import Sequence
from trainctl.api.training import (
    EvalBatchRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LogProbsRequest,
    LogProbsResult,
    ModelLimits,
    OptimStepRequest,
    StepResult,
    TrainBatchRequest,
)

API_VERSION = "v1"

__all__ = [
    "API_VERSION", "EvalBatchRequest", "ForwardBackwardRequest", "ForwardBackwardResult",
    "LogProbsRequest", "LogProbsResult", "LossConfig", "LossKind", "ModelLimits",
    "Normalization", "OptimStepRequest", "Sequence", "StepResult", "TrainBatchRequest",
]  # fmt: skip


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


def owner_field() -> Any:
    """The ``owner`` field of the calls that name checkpoints and exports."""
    return Field(
        default=None,
        pattern=ADAPTER_NAME,
        description="Whose names: the model (a Tinker model_id, ':' written '-') or adapter "
        "they belong to. Each owner has its own names, so two owners can both save 'final'; "
        "default: the service's own names.",
    )


class CheckpointFile(BaseModel):
    """One rank file of a checkpoint as the save wrote it; a load checks the file against it."""

    size_bytes: int
    sha256: str = Field(description="Of the file's bytes, hashed as they were written.")
    moments: int = Field(
        0, description="AdamW moment tensors it holds (a load with optimizer needs them all)."
    )


class CheckpointInfo(BaseModel):
    """A saved training state: weights, optimizer state and step of every rank (or, with
    ``adapter``, one adapter's)."""

    checkpoint_id: str = Field(description="Load: POST /v1/checkpoints/{checkpoint_id}/load.")
    owner: str | None = Field(
        default=None, description="Whose name checkpoint_id is; None: the service's own."
    )
    adapter: str | None = Field(
        default=None,
        description="It holds this adapter alone (load it with adapter); None: the whole state.",
    )
    step: int
    created_at: float = Field(description="Unix seconds.")
    layout: dict[str, int] = Field(
        description="The parallel layout that wrote it: a per_rank checkpoint loads into it only."
    )
    format: Literal["per_rank", "reshardable"] = Field(
        "per_rank",
        description="reshardable: loads into any layout of the same model (every whole-state "
        "save since --checkpoint-format reshardable); per_rank: only into its own layout.",
    )
    precision: str | None = Field(
        None, description="The writer's parameter precision (bf16 or fp32); either loads either."
    )
    model: dict[str, Any] | None = Field(
        None, description="The writer's model shape; a reshardable load needs the same one."
    )
    weights_digest: str
    size_bytes: int
    sequence: int = Field(
        0, description="Save order: the highest is the latest, whatever its step."
    )
    save_id: str | None = Field(
        None,
        description="This save's id, which every rank file carries (null: saved before "
        "checkpoints carried digests; such a checkpoint loads unverified).",
    )
    files: dict[str, CheckpointFile] | None = Field(
        None,
        description="Each rank file by name. A load verifies every file against it, "
        "whatever the layout it loads into, before any rank changes state.",
    )


class SkippedCheckpoint(BaseModel):
    """A checkpoint a start or a recovery passed over: it does not verify or load here."""

    checkpoint_id: str
    reason: str


class RestoreInfo(BaseModel):
    """The checkpoint a start restored (``--resume``), and the newer ones it passed over."""

    checkpoint_id: str | None = Field(description="None: started from the start weights.")
    skipped: list[SkippedCheckpoint] = Field(
        default_factory=list, description="Newest first, each with why it was passed over."
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
    adapter: str | None = Field(
        default=None,
        pattern=ADAPTER_NAME,
        description="Export this LoRA adapter in PEFT's format (adapter_config.json, "
        "adapter_model.safetensors) instead of the base model.",
    )
    merged: bool = Field(
        default=False,
        description="With adapter: the full model with the adapter folded in, as a Hugging "
        "Face checkpoint of its family.",
    )
    owner: str | None = owner_field()

    @model_validator(mode="after")
    def _merged_needs_adapter(self) -> ExportRequest:
        if self.merged and self.adapter is None:
            raise ValueError("merged: folds an adapter into the base; name the adapter")
        return self


class ExportResult(BaseModel):
    """A Hugging Face checkpoint of the model's family (config.json + model.safetensors) on the
    server."""

    name: str
    owner: str | None = Field(default=None, description="Whose name it is; None: the service's.")
    step: int
    path: str = Field(
        description="Its directory on the server, relative to the service's data directory "
        "(--data-dir), e.g. exports/step-000010: load it with transformers or vLLM there."
    )
    files: dict[str, int] = Field(description="File name -> size in bytes.")


class SaveInFlight(BaseModel):
    """A checkpoint being written in the background (``--async-save``): listed once every
    rank's file is written and the checkpoint committed."""

    step: int
    started_at: float = Field(description="Unix seconds.")
    stall_s: float = Field(description="Seconds the step waited while the ranks copied the state.")
    seconds: float = Field(description="Seconds since it started.")


RecoverySource = Literal["peer", "checkpoint", "start"]


class RecoveryInfo(BaseModel):
    """The last time the worker group was rebuilt after a failure."""

    at: float = Field(description="Unix seconds.")
    cause: str
    source: RecoverySource = Field(
        "checkpoint",
        description="Where the new ranks' state came from: 'peer' (the surviving ranks' "
        "memory: no step lost), 'checkpoint' (the newest one that loads) or 'start' (the "
        "start weights: no checkpoint loaded).",
    )
    peer_fallback: str | None = Field(
        None,
        description="Why the state did not come from the surviving ranks (None: it did, or "
        "recovery from peers is off).",
    )
    restored_checkpoint: str | None = Field(
        description="The checkpoint loaded; None: from the surviving ranks or the start weights."
    )
    step_before: int = Field(description="The step the model had reached before the failure.")
    step_after: int = Field(
        description="The step restored: the survivors' (one more than step_before when they "
        "had applied the update in flight), else the checkpoint's."
    )
    skipped: list[SkippedCheckpoint] = Field(
        default_factory=list,
        description="Newer checkpoints passed over (damaged, or not loadable here), newest first.",
    )
    layout: dict[str, int] | None = Field(
        default=None,
        description="The layout the new ranks run: fewer DP replicas than configured when the "
        "live nodes could not hold it (--on-node-loss shrink).",
    )

    @property
    def steps_lost(self) -> int:
        return max(0, self.step_before - self.step_after)


class TenantUsage(BaseModel):
    """One tenant's use of the service, counted by the gateway since it started."""

    requests: int = Field(0, description="Requests authenticated with the tenant's key.")
    bytes: int = Field(0, description="Request body bytes the tenant sent (as declared).")
    adapters: int = Field(0, description="LoRA adapters in the tenant's space now.")


class Info(BaseModel):
    """What is being served."""

    model_config = ConfigDict(protected_namespaces=())

    model_name: str = Field(
        default="trainctl-tiny",
        description="The served model's name: the Hugging Face directory's name when started "
        "from one (init_hf), 'trainctl-tiny' for the embedded default.",
    )
    model: dict[str, float | int | str | list[str]]
    layout: dict[str, int] = Field(
        description="The layout the ranks run now: the configured one, or fewer DP replicas "
        "while the live nodes cannot hold it (--on-node-loss shrink)."
    )
    configured_layout: dict[str, int] | None = Field(
        default=None, description="The layout asked for at start (--dp, --tp, ...)."
    )
    engine: dict[str, float | int | str]
    world_size: int = Field(description="Ranks running now (the current layout's).")
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
    save_in_flight: SaveInFlight | None = Field(
        default=None, description="The checkpoint being written in the background (--async-save)."
    )
    last_save_error: str | None = Field(
        default=None,
        description="Why the last background save failed (null: it did not); cleared by the "
        "next one that succeeds.",
    )
    resumed: RestoreInfo | None = Field(
        default=None,
        description="What this start restored (null: started with --resume none).",
    )
    samplers: SamplersInfo | None = Field(
        default=None, description="The sampler engines (null: started with --samplers 0)."
    )
    tenants: dict[str, TenantUsage] | None = Field(
        default=None,
        description="Each tenant of --api-keys: what it sent and holds (null: no tenant keys).",
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
    samplers: dict[str, int] | None = Field(
        None,
        description="In GET /v1/ready of a service with samplers: its engines counted by "
        "status ('ready', 'restarting', ...). The service is ready while its ranks are; an "
        "engine restarting only slows sampling.",
    )
