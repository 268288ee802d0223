"""The one table of operations: each kind's request model, result model and route.

An operation is a call that touches the ranks: it is queued, run one at a time in arrival
order, and idempotent under a key (``workers/control/op_queue.py``). The SDK builds its
calls from this table, the gateway registers one route per entry, and the controller
dispatches on the kind; nothing else spells an operation's name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainctl.api.adapters import (
    ADAPTER_NAME,
    AdapterInfo,
    AdapterList,
    CreateAdapterRequest,
    DeleteAdapterRequest,
)
from trainctl.api.errors import ErrorBody
from trainctl.api.models import (
    CheckpointInfo,
    EvalBatchRequest,
    ExportRequest,
    ExportResult,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    Info,
    LogProbsRequest,
    LogProbsResult,
    MemoryProfileResult,
    MemoryProfileStarted,
    MemoryProfileStartRequest,
    OptimStepRequest,
    StepResult,
    TrainBatchRequest,
    owner_field,
)
from trainctl.api.sampling import SyncResult, SyncWeightsRequest


class OperationKind(str, Enum):
    """What an operation does; the value is its RPC name (and the route's ``operationId``)."""

    TRAIN_BATCH = "train_batch"
    EVAL_BATCH = "eval_batch"
    LOGPROBS = "logprobs"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    START_MEMORY_PROFILE = "start_memory_profile"
    STOP_MEMORY_PROFILE = "stop_memory_profile"
    SAVE_CHECKPOINT = "save_checkpoint"
    LOAD_CHECKPOINT = "load_checkpoint"
    EXPORT_HF = "export_hf"
    SYNC_WEIGHTS = "sync_weights"
    CREATE_ADAPTER = "create_adapter"
    DELETE_ADAPTER = "delete_adapter"
    """Routed by ``DELETE /v1/adapters/{name}`` (the table's routes are POSTs)."""
    DELETE_CHECKPOINT = "delete_checkpoint"
    """Routed by ``DELETE /v1/checkpoints/{checkpoint_id}`` and ``DELETE /v1/exports/{name}``."""
    RECOVER = "recover"
    """Internal: rebuild the workers after a failure (queued ahead of everything; no route)."""

    def __str__(self) -> str:  # logs and metric labels read the RPC name
        return self.value


class NoArguments(BaseModel):
    """An operation that takes no arguments (``stop_memory_profile``)."""

    model_config = ConfigDict(extra="forbid")


class SaveCheckpointRequest(BaseModel):
    """``save_checkpoint``: unnamed, the checkpoint is ``step-NNNNNN`` and counts against the
    server's ``keep_checkpoints``; named, it is kept until overwritten."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="The checkpoint's id (letters, digits, '.', '_', '-'; 'step-' is reserved "
        "for the automatic ones).",
    )
    overwrite: bool = Field(
        default=False, description="Replace a checkpoint of that name (409 otherwise)."
    )
    adapter: str | None = Field(
        default=None,
        pattern=ADAPTER_NAME,
        description="Save this LoRA adapter alone (its weights, AdamW state and step), not the "
        "whole training state.",
    )
    owner: str | None = owner_field()

    @field_validator("name")
    @classmethod
    def _not_automatic(cls, name: str | None) -> str | None:
        if name is not None and name.startswith("step-"):
            raise ValueError("'step-' names the automatic checkpoints: choose another name")
        return name


class LoadCheckpointRequest(BaseModel):
    """``load_checkpoint``: the id comes from the route's path."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str = Field(description="As listed by GET /v1/checkpoints.")
    optimizer: bool = Field(
        default=True,
        description="Also restore the optimizer state (Adam moments, fp32 masters). False: the "
        "weights and step only, and the optimizer starts afresh on them.",
    )
    adapter: str | None = Field(
        default=None,
        pattern=ADAPTER_NAME,
        description="Restore this LoRA adapter alone (its weights, AdamW state and step) from "
        "the checkpoint, creating it if it does not exist; every other adapter, and the base, "
        "stay as they are. A checkpoint that holds one adapter alone loads only this way.",
    )
    into: str | None = Field(
        default=None,
        pattern=ADAPTER_NAME,
        description="With adapter: restore it under this name (created if need be), leaving "
        "the adapter of the checkpoint's name as it is; default: its own name.",
    )
    owner: str | None = owner_field()

    @model_validator(mode="after")
    def _into_needs_adapter(self) -> LoadCheckpointRequest:
        if self.into is not None and self.adapter is None:
            raise ValueError("into: names where an adapter is restored; name the adapter")
        return self


class DeleteCheckpointRequest(BaseModel):
    """``delete_checkpoint``: one owner's checkpoint (or export) removed from disk, in the
    operation queue's turn (never under a load that reads it)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="As listed by GET /v1/checkpoints (an export: its name).",
    )
    owner: str | None = owner_field()
    export: bool = Field(
        default=False, description="Delete the Hugging Face export of that name instead."
    )


class Deleted(BaseModel):
    """What ``delete_checkpoint`` removed."""

    checkpoint_id: str
    owner: str | None = None
    export: bool = False
    size_bytes: int = Field(description="Bytes freed on disk.")


class OperationStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Operation(BaseModel):
    """A long call run in arrival order; poll ``GET /v1/operations/{id}`` until it finishes."""

    id: str
    kind: OperationKind
    status: OperationStatus
    phase: str | None = Field(default=None, description="While running: what it is doing now.")
    queue_position: int | None = Field(
        default=None, description="While queued: operations ahead of this one."
    )
    created_at: float = Field(description="Unix seconds.")
    started_at: float | None = None
    finished_at: float | None = None
    result: Any = Field(default=None, description="When done: the call's result body.")
    error: ErrorBody | None = Field(default=None, description="When failed: the error.")
    trace_id: str | None = Field(
        default=None,
        description="The trace its spans belong to (32 hex digits; GET /v1/timeline, OTLP): "
        "the caller's, from its W3C traceparent header, else one of its own once it runs.",
    )

    @property
    def finished(self) -> bool:
        return self.status in (OperationStatus.DONE, OperationStatus.FAILED)


@dataclass(frozen=True)
class OperationSpec:
    kind: OperationKind
    request: type[BaseModel]
    result: type[BaseModel]
    path: str
    """Route under ``/v1`` (always POST); ``{checkpoint_id}`` is filled from the request."""
    tag: str
    summary: str
    batch: bool = False
    """The body is a batch of sequences (JSON or the binary frame; ``api/wire.py``)."""


OPERATIONS: dict[OperationKind, OperationSpec] = {
    s.kind: s
    for s in (
        OperationSpec(
            OperationKind.TRAIN_BATCH, TrainBatchRequest, StepResult, "/train_batch", "training",
            "Forward/backward over the batch on every rank, then one optimizer step.",
            batch=True,
        ),
        OperationSpec(
            OperationKind.EVAL_BATCH, EvalBatchRequest, StepResult, "/eval_batch", "training",
            "The training loss, without backward or update.", batch=True,
        ),
        OperationSpec(
            OperationKind.LOGPROBS, LogProbsRequest, LogProbsResult, "/logprobs", "training",
            "Forward only: per-token log-probs (and entropy) of each sequence, in request order.",
            batch=True,
        ),
        OperationSpec(
            OperationKind.FORWARD_BACKWARD, ForwardBackwardRequest, ForwardBackwardResult,
            "/forward_backward", "training",
            "Split step, part: forward/backward over the batch; its gradients are added to those "
            "accumulated since the last optim_step. Returns the loss and per-token log-probs.",
            batch=True,
        ),
        OperationSpec(
            OperationKind.OPTIM_STEP, OptimStepRequest, StepResult, "/optim_step", "training",
            "Split step, end: reduce the accumulated gradients once and apply one AdamW step "
            "with the settings given (learning rate, betas, eps, weight decay, clip norm).",
        ),
        OperationSpec(
            OperationKind.START_MEMORY_PROFILE, MemoryProfileStartRequest, MemoryProfileStarted,
            "/memory_profile/start", "profiling", "Every rank starts recording its allocations.",
        ),
        OperationSpec(
            OperationKind.STOP_MEMORY_PROFILE, NoArguments, MemoryProfileResult,
            "/memory_profile/stop", "profiling",
            "Every rank stops recording; the controller stores one file and one picture per rank.",
        ),
        OperationSpec(
            OperationKind.SAVE_CHECKPOINT, SaveCheckpointRequest, CheckpointInfo,
            "/checkpoints", "checkpoints",
            "Save the whole training state (weights, optimizer, step, RNG) of every rank; the "
            "checkpoint appears only once complete.",
        ),
        OperationSpec(
            OperationKind.LOAD_CHECKPOINT, LoadCheckpointRequest, CheckpointInfo,
            "/checkpoints/{checkpoint_id}/load", "checkpoints",
            "Restore a checkpoint (reshardable ones from any layout): weights, optimizer state "
            "and step.",
        ),
        OperationSpec(
            OperationKind.EXPORT_HF, ExportRequest, ExportResult, "/export/hf", "checkpoints",
            "Write the full model as a Hugging Face checkpoint of its family (config.json and "
            "model.safetensors) under the server's export root.",
        ),
        OperationSpec(
            OperationKind.SYNC_WEIGHTS, SyncWeightsRequest, SyncResult, "/weights/sync",
            "sampling",
            "Send the current weights to every sampler engine, without disk; each finishes the "
            "requests it is serving first, so no response mixes two steps.",
        ),
        OperationSpec(
            OperationKind.CREATE_ADAPTER, CreateAdapterRequest, AdapterInfo, "/adapters",
            "adapters",
            "Create a LoRA adapter on the frozen base (a service started with --max-adapters): "
            "its own weights, AdamW state and step; batch calls name it in 'adapter'.",
        ),
        OperationSpec(
            OperationKind.DELETE_ADAPTER, DeleteAdapterRequest, AdapterList, "", "adapters",
            "Delete an adapter: its weights, optimizer state and window (DELETE "
            "/v1/adapters/{name}).",
        ),
        OperationSpec(
            OperationKind.DELETE_CHECKPOINT, DeleteCheckpointRequest, Deleted, "",
            "checkpoints",
            "Delete one owner's checkpoint or export from disk (DELETE "
            "/v1/checkpoints/{checkpoint_id}, DELETE /v1/exports/{name}).",
        ),
        OperationSpec(
            OperationKind.RECOVER, NoArguments, Info, "", "service",
            "Rebuild the workers and restore the latest checkpoint (internal).",
        ),
    )
}  # fmt: skip

ROUTED: tuple[OperationSpec, ...] = tuple(s for s in OPERATIONS.values() if s.path)
"""The operations callable over HTTP (all but ``recover``)."""


def fingerprint(req: BaseModel) -> str:
    """A request's idempotency fingerprint: the sha256 of its canonical JSON (the same key
    with another fingerprint is a 409)."""
    return hashlib.sha256(req.model_dump_json().encode()).hexdigest()


def route_of(kind: OperationKind, req: BaseModel) -> str:
    """The path under ``/v1`` that runs ``req``."""
    path = OPERATIONS[kind].path
    return path.format(**req.model_dump()) if "{" in path else path
