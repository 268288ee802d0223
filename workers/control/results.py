"""The ranks' reports merged into the API's results: one place for the controller and the
in-process engine (``workers/control/inprocess.py``), so both report the same keys."""

from __future__ import annotations

from typing import Any

from trainctl.api import StepResult, WorkerError
from trainctl.workers.control.batch import StepPlan


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
