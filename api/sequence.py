"""The JSON shape of one sequence, checked by pydantic (``SequenceBatch`` packs it)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model

from trainctl.api.fields import OPTIONAL_FIELDS, PER_TOKEN_FIELDS, FieldKind, TokenField


def _annotation(f: TokenField) -> Any:
    if f.kind in (FieldKind.TOKEN, FieldKind.STEP):
        return list[StrictInt]
    if f.kind is FieldKind.MASK:
        return list[Annotated[int, Field(ge=0, le=1, strict=True)]] | None
    if f.kind is FieldKind.ROUTES:
        return list[list[list[StrictInt]]] | None
    return list[float] | None


_SEQUENCE_FIELDS: dict[str, Any] = {
    "tokens": (_annotation(PER_TOKEN_FIELDS[0]), Field(min_length=1, description="Token ids.")),
    **{
        f.name: (_annotation(f), Field(default=None, description=f.description))
        for f in OPTIONAL_FIELDS
    },
    "policy_step": (
        Annotated[int, Field(ge=0, strict=True)] | None,
        Field(
            default=None,
            description="The weights step that sampled this sequence (every token): the "
            "shorthand for `token_steps`, whose prompt tokens it marks sampled too. Give one "
            "or the other.",
        ),
    ),
}
Sequence: type[BaseModel] = create_model(
    "Sequence",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One token sequence with its per-token fields (``api/fields.py``), as JSON.",
    **_SEQUENCE_FIELDS,
)
"""The JSON shape of one sequence: types are checked here (with field locations), values by
``SequenceBatch`` (lengths, 0/1 masks, finite floats), for JSON and binary bodies alike."""
