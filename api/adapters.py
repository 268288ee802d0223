"""LoRA adapters on the served base: create, list, delete; batch calls name one.

A service started with ``--max-adapters N`` holds up to N adapters on a frozen base. Each has
its own weights, AdamW state and step count; a batch call's ``adapter`` picks the adapter it
reads and trains. Without ``adapter`` a call reads the base alone (and cannot train it: the
base is frozen). A service with ``--max-adapters 0`` (the default) trains the full model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainctl.api.bounds import MAX_ALPHA_PER_RANK, MAX_LORA_RANK, Seed
from trainctl.api.errors import field_error

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Target = Literal["attn", "mlp", "unembed"]
ALL_TARGETS: list[Target] = ["attn", "mlp", "unembed"]


ADAPTER_DOC = (
    "The LoRA adapter this call reads and trains (POST /v1/adapters creates one); none: the "
    "base model."
)


class CreateAdapterRequest(BaseModel):
    """A new LoRA adapter: ``A`` drawn as PEFT draws it (from ``seed``), ``B`` zero, so it
    starts as the base model."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ADAPTER_NAME, description="The adapter's name in every call.")
    rank: int = Field(
        32,
        ge=1,
        le=MAX_LORA_RANK,
        description="LoRA rank r (at most the service's --lora-max-rank).",
    )
    alpha: float = Field(
        32.0,
        gt=0,
        allow_inf_nan=False,
        description=f"LoRA alpha: the update is (alpha / r) B A; at most {MAX_ALPHA_PER_RANK:g} "
        "x rank.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    targets: list[Target] = Field(
        default_factory=lambda: list(ALL_TARGETS),
        min_length=1,
        description="What it adapts: attention (q/k/v and out), the MLP (gate/up and down), "
        "the unembedding (LM head).",
    )
    seed: Seed = Field(0, description="Seed of A's initialisation.")

    @model_validator(mode="after")
    def _scale(self) -> CreateAdapterRequest:
        if self.alpha > MAX_ALPHA_PER_RANK * self.rank:
            raise field_error(
                "alpha",
                f"{self.alpha:g} exceeds {MAX_ALPHA_PER_RANK:g} x rank ({self.rank}): the "
                "update is scaled by alpha / rank, and past that scale it swamps the base "
                "(alpha 1e308 gave NaN outputs)",
            )
        return self


class DeleteAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=ADAPTER_NAME)


class AdapterInfo(BaseModel):
    name: str
    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    step: int = Field(description="Optimizer steps applied to this adapter.")
    bytes: int = Field(description="Its factors' bytes on one rank (AdamW state not counted).")
    last_used: float = Field(description="Unix seconds of the last call that named it.")


class AdapterList(BaseModel):
    adapters: list[AdapterInfo]
    max_adapters: int = Field(description="The service's --max-adapters (0: no adapters).")
    max_rank: int = Field(description="The service's --lora-max-rank.")
