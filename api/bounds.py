"""The numeric bounds of what the engines accept, in one place: a request past one is a 422
naming the field at the gateway, never an error inside an engine."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, Strict

MAX_SEED = 2**64 - 1
"""The largest seed a torch generator takes (an unsigned 64-bit integer): sampling seeds and
an adapter's initialisation seed. vLLM reads a negative sampling seed as "unseeded"."""

Seed = Annotated[int, Strict(), Field(ge=0, le=MAX_SEED)]
"""A seed (sampling, an adapter's initialisation): equal seeds, equal results. Strict: ``"1"``,
``true`` and ``1.0`` are refused, not read as 1."""

Int64 = Annotated[int, Field(ge=0, lt=2**63)]
"""A count or a step a request names (a Tinker ``seq_id``, an ``expected_step``): at most
int64's, as numpy and torch hold it, so a larger one is a 422 here, never an overflow later."""

MAX_TEMPERATURE = 2.0
"""The largest sampling temperature: vLLM's own limit (and OpenAI's), so a request past it is
a 422 here, never a refusal inside an engine's step."""

MAX_ALPHA_PER_RANK = 1e4
"""An adapter's ``alpha`` is at most this times its rank: its update is scaled by
``alpha / rank``, and past this scale it swamps the base (an alpha of 1e30 gave sampler
log-probs of -5e26; 1e308 gave NaN)."""

MAX_LORA_RANK = 2**16
"""The largest adapter rank a request may name (a service's --lora-max-rank is smaller)."""
