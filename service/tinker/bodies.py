"""What the SDK sends as JSON (only the fields read; the rest is ignored), and what
``create_model`` refuses rather than train something other than what was asked."""

import json
import zlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainctl.api import ConflictError, CreateAdapterRequest, Info, InvalidRequestError
from trainctl.api.bounds import MAX_LORA_RANK, Int64, Seed
from trainctl.api.operations import fingerprint


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class LoraConfig(Body):
    rank: int = Field(0, ge=0, le=MAX_LORA_RANK)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModelRequest(Body):
    session_id: str
    model_seq_id: Int64
    base_model: str
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class AdamParams(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    type: str = "adamw"


class ModelCall(Body):
    """A call on a model handle, in its ``seq_id`` order."""

    model_id: str
    seq_id: Int64


class OptimStep(ModelCall):
    adam_params: AdamParams | None = None
    optimizer_params: AdamParams | None = None


class SaveWeights(ModelCall):
    path: str | None = None
    overwrite: bool = False


class LoadWeights(Body):
    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: Int64 | None = None
    session_id: str | None = None
    model_seq_id: Int64 | None = None
    base_model: str | None = None
    optimizer_config: OptimizerConfig | None = None


class SaveForSampler(ModelCall):
    path: str | None = None
    sampling_session_seq_id: Int64 | None = None
    """Set (and ``path`` not) by ``save_weights_and_get_sampling_client``."""
    kind: str = "snapshot"
    ttl_seconds: int | None = Field(default=None, ge=1, lt=2**31)
    """How long the saved weights stay servable; past it, their sampling clients get a
    410. None: for as long as the samplers' window holds their step."""


def check_create_model(
    req: CreateModelRequest, info: Info, *, model_id: str, adapter_name: str, max_adapters: int
) -> CreateAdapterRequest | None:
    """Refuse what would train something other than what was asked; for a LoRA model, the
    adapter to create (alpha 32, Tinker's), else None (the full model trains)."""
    if req.base_model != info.model_name:
        raise InvalidRequestError(
            f"base_model: this service trains {info.model_name!r}, not {req.base_model!r}"
        )
    lora = req.lora_config or LoraConfig()
    if req.optimizer_config.type != "adamw":
        raise InvalidRequestError(
            f"optimizer_config.type: trainctl runs AdamW, not {req.optimizer_config.type!r}"
        )
    if max_adapters and lora.rank > 0:
        targets = [t for t, on in (("attn", lora.train_attn), ("mlp", lora.train_mlp),
                                   ("unembed", lora.train_unembed)) if on]  # fmt: skip
        if not targets:
            raise InvalidRequestError(
                "lora_config: train_attn, train_mlp and train_unembed are all false: the "
                "adapter would train nothing"
            )
        return CreateAdapterRequest(
            name=adapter_name, rank=lora.rank, alpha=32.0, targets=targets,
            # Tinker's seed None is "random": one of the handle's own, so adapters differ.
            seed=lora.seed if lora.seed is not None else zlib.crc32(model_id.encode()),
        )  # fmt: skip
    if max_adapters:
        raise InvalidRequestError(
            "lora_config.rank: this service trains LoRA adapters on a frozen base "
            f"(--max-adapters {max_adapters}); ask for a rank >= 1 "
            "(create_lora_training_client(base_model, rank=32))"
        )
    if lora.rank > 0:
        raise InvalidRequestError(
            f"lora_config.rank: this service trains the full model, so rank {lora.rank} would "
            "not be honoured: start it with --max-adapters N for LoRA, or ask for rank=0"
        )
    if not (lora.train_mlp and lora.train_attn and lora.train_unembed):
        raise InvalidRequestError(
            "lora_config: train_mlp, train_attn and train_unembed must be true (trainctl "
            "trains every parameter; freezing parts is not supported)"
        )
    if info.step > 0:
        raise ConflictError(
            f"the served model has been trained to step {info.step}: create_model would "
            f"present those weights as the base model {info.model_name!r}. Go on training them "
            "with create_training_client_from_state(<a save_state path>), or restore the base "
            "weights first (POST /v1/checkpoints/<a step-0 checkpoint>/load, or restart the "
            "service without resuming)",
            details={"step": info.step},
        )
    return None


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object, or a 422 saying what it is instead."""
    try:
        raw = json.loads(body or b"{}")
    except ValueError as e:
        raise InvalidRequestError(f"body: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"body: a JSON object is expected, not {type(raw).__name__}")
    return raw


def validated(raw: dict[str, Any], model: type[Body]) -> tuple[Any, str]:
    """``raw`` as ``model`` and its fingerprint (sha256 of the canonical JSON)."""
    req = model.model_validate(raw)
    return req, fingerprint(req)


def text_field(body: dict[str, Any], name: str) -> str:
    """``body[name]`` as a string, or a 422 naming it."""
    value = body.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name}: a string is required")
    return value
