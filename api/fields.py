"""The per-token fields of a sequence, declared once.

Everything that handles per-token data derives from ``PER_TOKEN_FIELDS``: the pydantic
``Sequence`` model (``api/models.py``), the binary codec (``api/wire.py``), the columnar batch
and its validation (``api/batch.py``), the host-side packing and the context-parallel split
(``workers/``). Adding a per-token input is one line here plus the loss code that reads it
(and, if a loss kind requires it, one line in ``LossConfig.required_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FieldKind(str, Enum):
    TOKEN = "token"
    """Integer token ids; travel as int32 or int64."""
    MASK = "mask"
    """0/1 per token; travels as uint8."""
    FLOAT = "float"
    """Finite floats; travel in the caller's float dtype (fp16, bf16, fp32, fp64)."""
    ROUTES = "routes"
    """Per token, ``[layers, top_k]`` expert ids (MoE routing replay); travel as int32."""
    STEP = "step"
    """Integer weights steps (>= 0), or -1 for none; travel as int32 or int64."""


@dataclass(frozen=True)
class TokenField:
    name: str
    kind: FieldKind
    description: str
    default_one: bool = False
    """Absent means 1 for every token; a batch may carry it for some sequences only."""
    loss_input: bool = False
    """Read by a loss on the last pipeline stage: rolled, CP-split and broadcast with it."""


PER_TOKEN_FIELDS: tuple[TokenField, ...] = (
    TokenField("tokens", FieldKind.TOKEN, "Token ids, each in [0, vocab_size)."),
    TokenField(
        "loss_mask",
        FieldKind.MASK,
        "0/1 per token; 1 = train on this token (predicted from the tokens before it). "
        "Default: all ones.",
        default_one=True,
    ),
    TokenField("weights", FieldKind.FLOAT, "Per-token loss weights; default 1.", default_one=True),
    TokenField(
        "advantages",
        FieldKind.FLOAT,
        "Per-token advantages (importance_sampling and ppo losses).",
        loss_input=True,
    ),
    TokenField(
        "old_logprobs",
        FieldKind.FLOAT,
        "Per-token log-probs of each token under the behaviour (sampling) policy.",
        loss_input=True,
    ),
    TokenField(
        "ref_logprobs",
        FieldKind.FLOAT,
        "Per-token log-probs under the reference policy (KL term).",
        loss_input=True,
    ),
    TokenField(
        "sampler_logprobs",
        FieldKind.FLOAT,
        "Per-token log-probs the inference engine reported when it sampled, where they differ "
        "from old_logprobs (the trainer's recomputed behaviour log-probs): truncated "
        "importance sampling (loss.tis_cap) corrects the policy gradient by "
        "min(exp(old - sampler), tis_cap).",
        loss_input=True,
    ),
    TokenField(
        "sequence_ratio_mask",
        FieldKind.MASK,
        "0/1 per token, read by the gspo loss only: the tokens whose log-ratios make their "
        "sequence's ratio (its geometric mean). Default: the loss tokens. Every sequence needs "
        "at least one.",
        loss_input=True,
    ),
    TokenField(
        "token_steps",
        FieldKind.STEP,
        "The weights step that sampled each token (a sample's `Completion.token_steps`; the "
        "base's step, or with an adapter the adapter's), -1 for a token no sampler produced (the "
        "prompt). Every loss token needs one. The service checks them (a step in the future, "
        "or one its samplers never served, is a 422) and, with --max-staleness, refuses "
        "sequences too far behind the trainer. JSON may give `policy_step` per sequence "
        "instead.",
    ),
    TokenField(
        "routed_experts",
        FieldKind.ROUTES,
        "MoE routing replay: per token, [layers, top_k] expert ids the sampler routed it "
        "through (one row per decoder layer, top_k distinct ids). The trainer routes each "
        "token through these experts instead of choosing its own, in forward and backward; "
        "the router still learns from the replayed experts' scores.",
    ),
)

NO_STEP = -1
"""``token_steps`` of a token no sampler produced (a prompt's, an environment's)."""

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in PER_TOKEN_FIELDS)
OPTIONAL_FIELDS: tuple[TokenField, ...] = PER_TOKEN_FIELDS[1:]
"""Every field but ``tokens``."""
LOSS_INPUTS: tuple[str, ...] = tuple(f.name for f in PER_TOKEN_FIELDS if f.loss_input)
"""Per-token inputs of the RL losses, in a fixed order."""
BY_NAME: dict[str, TokenField] = {f.name: f for f in PER_TOKEN_FIELDS}
