"""The numeric bounds of what the engines accept, in one place: a request past one is a 422
naming the field at the gateway, never an error inside an engine."""

from __future__ import annotations

MAX_SEED = 2**64 - 1
"""The largest seed a torch generator takes (an unsigned 64-bit integer): sampling seeds and
an adapter's initialisation seed. vLLM reads a negative sampling seed as "unseeded"."""

MAX_TEMPERATURE = 1e4
"""The largest sampling temperature: far past where sampling is already uniform; a larger one
only overflows the logits."""

MAX_ALPHA_PER_RANK = 1e4
"""An adapter's ``alpha`` is at most this times its rank: its update is scaled by
``alpha / rank``, and past this scale it swamps the base (an alpha of 1e30 gave sampler
log-probs of -5e26; 1e308 gave NaN)."""

MAX_LORA_RANK = 2**16
"""The largest adapter rank a request may name (a service's --lora-max-rank is smaller)."""
