"""vLLM's outputs as trainctl's results: the chosen tokens' log-probs, the routed experts."""

from __future__ import annotations

import json
from typing import Any

from trainctl.api import Completion, PromptSamples, SampleRequest


def chosen_logprobs(entries: Any, tokens: Any) -> list[float | None]:
    """The log-prob of each token actually there, from vLLM's per-position dictionaries."""
    return [
        None if d is None else float(d[t].logprob) for d, t in zip(entries, tokens, strict=True)
    ]


def routes_of(c: Any, prompt_len: int) -> list[list[list[int]]]:
    """A completion's routed experts as vLLM captured them (``[tokens, layers, top_k]``, one
    row per token fed through the model), checked to cover exactly those tokens."""
    import numpy as np

    if c.routed_experts is None:
        raise RuntimeError("return_routes: the sampler engine captured no routes")
    routes = np.asarray(c.routed_experts)
    fed = prompt_len + len(c.token_ids) - 1
    if routes.ndim != 3 or routes.shape[0] != fed:
        raise RuntimeError(
            f"return_routes: the sampler captured routes of shape {routes.shape}, not "
            f"[{fed}, layers, top_k]"
        )
    out: list[list[list[int]]] = routes.astype(np.int64).tolist()
    return out


def version_label(base: int | None, adapters: dict[str, int]) -> str:
    """The engine's label for its steps (vLLM's weight version): the base's step and each
    adapter's newest slot's, as JSON."""
    return json.dumps([base, adapters], separators=(",", ":"))


def _labelled_step(label: str, adapter: str | None) -> int:
    """The step a label gives the base (``adapter`` None) or an adapter's newest slot."""
    try:
        base, adapters = json.loads(label)
        step = base if adapter is None else adapters[adapter]
    except (ValueError, TypeError, KeyError):
        step = None
    if not isinstance(step, int):  # the engine's label before its first load, or another's
        raise RuntimeError(f"the sampler labelled tokens with weight version {label!r}")
    return step


def token_steps(c: Any, step: int, labelled: bool, adapter: str | None = None) -> list[int]:
    """The step of each of a completion's tokens: from vLLM's weight-version spans where the
    engine's labels give it (``labelled``: a base request, or one on ``adapter``'s newest
    slot); otherwise, or where vLLM reported no span, ``step`` (a pinned adapter version is
    fixed for a request)."""
    spans = getattr(c, "weight_versions", None) if labelled else None
    if not spans:
        return [step] * len(c.token_ids)
    out: list[int] = []
    for span in spans:
        out += [_labelled_step(str(span.version), adapter)] * (span.end - span.start)
    if len(out) != len(c.token_ids):
        raise RuntimeError(
            f"the sampler's weight-version spans cover {len(out)} tokens of {len(c.token_ids)}"
        )
    return out


def prompt_samples(out: Any, req: SampleRequest, step: int, labelled: bool) -> PromptSamples:
    """One prompt's completions and log-probs, from vLLM's ``RequestOutput``; ``step``: the
    version the request was admitted to (the base's, or its adapter's); ``labelled``: each
    token's step is in the engine's labels (``token_steps``)."""
    completions = []
    for c in out.outputs:
        tokens = [int(t) for t in c.token_ids]
        lps = chosen_logprobs(c.logprobs, tokens) if req.logprobs else None
        completions.append(
            Completion(
                tokens=tokens,
                logprobs=None if lps is None else [float(x) for x in lps if x is not None],
                finish_reason="stop" if c.finish_reason == "stop" else c.finish_reason or "length",
                token_steps=token_steps(c, step, labelled, req.adapter),
                routed_experts=routes_of(c, len(out.prompt_token_ids))
                if req.return_routes
                else None,
            )
        )
    prompt_lps = None
    if req.prompt_logprobs:
        prompt_lps = chosen_logprobs(out.prompt_logprobs, out.prompt_token_ids)
        prompt_lps[0] = None
    return PromptSamples(completions=completions, prompt_logprobs=prompt_lps)
