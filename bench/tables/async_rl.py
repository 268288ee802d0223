"""The ``async_rl`` table of ``bench/run.py``: the synchronous RL loop against the asynchronous
one (``examples/async_rl.py``), wall time to the same reward, split into sample, train and
sync, with the samplers' idle share."""

from __future__ import annotations

from bench.tables.common import measure


def section(quick: bool) -> str:
    r = measure("async_rl_case", "async_rl_cases", runs=1 if quick else 3, delay=0.2)
    return (
        "### Asynchronous RL: `examples/async_rl.py --mode compare` against `trainctl serve "
        "--samplers 1 --sampler-sync in_flight --max-staleness 2` (embedded model, dp=1, CPU)\n\n"
        f"The toy task to a mean reward of 0.8 over the last three iterations; 8 prompts x 8 "
        f"completions x 8 tokens a step, PPO; every rollout waits {r['delay']:g} s in its "
        "environment (all of a step's at once, in both loops). Loops interleaved, "
        f"{r['runs']} run(s) each, medians. sample s/it: waiting for rollouts; train s/it: the "
        "training calls less the samplers' sync; idle: the share of the time no sample request "
        "was in flight, as the client saw it. Load average "
        f"{r['load_before']:.2f} before, {r['load_after']:.2f} after.\n\n" + str(r["table"])
    )
