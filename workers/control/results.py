"""The ranks' reports merged into the API's results: one place for the controller and the
in-process engine (``workers/control/inprocess.py``), so both report the same keys."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainctl.api import LogProbsResult, StepResult, WorkerError
from trainctl.workers.engine.boundary import LogProbsPart
from trainctl.workers.rank.step_plan import StepPlan


def step_result(plan: StepPlan, reports: list[Any], *, step: int, t_plan: float) -> StepResult:
    """A ``StepResult`` from every rank's ``StepReport`` of one pass: the loss and metrics of
    the last pipeline stage, the plan's counts, and each timing's maximum over the ranks."""
    last = next(r for r in reports if r.is_last_stage)
    metrics = {
        "loss:mean": last.loss,
        **token_counts(plan),
        "loss_tokens:sum": float(plan.loss_normalizer),
        "sequences:sum": float(plan.num_sequences),
        "padded_tokens:sum": float(plan.padded_tokens),
        "microbatches_per_dp_rank:value": float(plan.num_microbatches),
        "dummy_microbatches:sum": float(plan.num_dummies),
    }
    metrics.update(last.metrics)
    timings = {"plan_s": t_plan}
    for key in reports[0].timings:
        timings[f"{key.removesuffix('_s')}_max_s"] = max(r.timings[key] for r in reports)
    return StepResult(loss=last.loss, step=step, metrics=metrics, timings=timings)


def nonfinite_norm_error(norms: list[float | None]) -> WorkerError | None:
    """The error of a step whose phase-1 grad norm is not finite on some rank (nothing may be
    applied then); None when every norm is finite."""
    if all(n is not None and math.isfinite(n) for n in norms):
        return None
    return WorkerError(
        f"the gradient norm is not finite ({norms[0]}); the step was not applied",
        details={"grad_norm": str(norms[0])},
    )


def logprobs_result(
    parts: list[LogProbsPart],
    plan: StepPlan,
    *,
    n: int,
    entropy: bool,
    step: int,
    routes: int | None = None,
) -> LogProbsResult:
    """The reporting ranks' per-sequence ``(log-probs, entropy)`` as the API's result; with
    ``routes`` (the model's layer count), every rank's route pieces put together."""
    ordered = in_request_order([p.per_sequence for p in parts], n)
    return LogProbsResult.model_construct(
        step=step,
        logprobs=[lp.tolist() for lp, _ in ordered],
        entropy=[ent.tolist() for _, ent in ordered] if entropy else None,
        routed_experts=None
        if routes is None
        else [r.tolist() for r in merge_routes(parts, [len(lp) for lp, _ in ordered], routes)],
        metrics=token_counts(plan),
    )


def merge_routes(parts: list[LogProbsPart], lengths: list[int], layers: int) -> list[np.ndarray]:
    """Each sequence's ``[tokens, layers, top_k]`` experts from the ranks' pieces (each token
    and layer comes from the rank that routed it); a hole is a worker error."""
    shards = [(i, s) for p in parts for i, s in p.routes.items()]
    top_k = shards[0][1].experts.shape[2] if shards else 0
    out = [np.full((n, layers, top_k), -1, np.int64) for n in lengths]
    for i, s in shards:
        out[i][s.positions[:, None], s.layers[None, :]] = s.experts
    holes = [i for i, r in enumerate(out) if r.size == 0 or (r < 0).any()]
    if holes:
        raise WorkerError(f"no rank reported the routes of sequences {holes[:10]}")
    return out


def in_request_order(parts: list[dict[int, Any]], n: int) -> list[Any]:
    """The reporting ranks' per-sequence results (each a ``{request index: value}``), merged
    into request order; a sequence no rank reported is a worker error."""
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    missing = [i for i in range(n) if i not in merged]
    if missing:
        raise WorkerError(f"no rank reported log-probs of sequences {missing[:10]}")
    return [merged[i] for i in range(n)]


def token_counts(plan: StepPlan) -> dict[str, float]:
    """The batch's tokens, and those the model computed (fewer where tries shared prefixes)."""
    return {
        "tokens:sum": float(plan.num_tokens),
        "computed_tokens:sum": float(plan.computed_tokens),
    }
