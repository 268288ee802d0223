"""Asynchronous RL through trainctl: sampling and the environment overlap the training step.

    trainctl serve --samplers 1 --sampler-sync in_flight --max-staleness 2   # in one shell
    python examples/async_rl.py --mode async          # one run, a line per iteration
    python examples/async_rl.py --mode compare        # sync and async, 3 runs each: a table
    python examples/async_rl.py --timeline trace      # trace-sync.json, trace-async.json and
                                                      # trace.png: two iterations of each

The toy task of ``examples/rl_loop.py`` (a completion's reward is the fraction of its tokens
below 64; a random policy scores about 0.125), with an environment that takes time: each
rollout waits ``--delay`` seconds before its reward, as a tool call or a sandbox would.

- **sync**: sample every prompt's group, run the environment on all of them at once, train
  one PPO step, and only then sample again (the samplers idle while the trainer trains, and
  the trainer while the environment runs).
- **async**: ``Rollouts`` (``trainctl.clients.rollouts``) keeps one step's worth of groups
  (``--prompts``, in one request) sampling and in the environment while the trainer trains on
  the groups that finished: one step off-policy. Every sequence carries the steps that sampled it
  (``token_steps``); the service refuses data past its ``--max-staleness`` and paces sampling
  so that none is made, and ``--sampler-sync in_flight`` lets a step's sync land without
  waiting for the generations running.

Both start from the same weights (a checkpoint saved by the first run), take the same PPO step
with group-relative advantages and the sampler's log-probs as the behaviour policy's, and stop
once the mean reward of their last three iterations reaches ``--until``.

``--timeline PREFIX`` runs two iterations of each loop and writes the service's timeline of
each (``GET /v1/timeline``: open it in https://ui.perfetto.dev) and a picture of both side by
side (``examples/timeline_plot.py``): where the samplers sit idle in the synchronous loop, and
how the asynchronous one fills that time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from trainctl.api import Completion
from trainctl.clients import AsyncTrainctlClient, NotFoundError
from trainctl.clients.rollouts import Group, Rollouts

GOOD_TOKENS = 64
"""A completion token counts as good below this id."""
START = "async-rl-start"
"""The checkpoint every run starts from."""
LOSS = {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.28}
GROUP = 8
"""Completions per prompt."""
MAX_TOKENS = 8


@dataclass
class Run:
    """One run of a loop: where its time went, and how far it got."""

    mode: str
    rewards: list[float] = field(default_factory=list)
    sample_s: float = 0.0
    """Waiting for samples and the environment."""
    train_s: float = 0.0
    """The training calls (a step's sync included: it is synced before its call answers)."""
    sync_s: float = 0.0
    """Of ``train_s``: gathering the weights and loading them into the samplers."""
    wall_s: float = 0.0
    idle: float = 0.0
    """The samplers' idle share, as the client saw it."""
    stale_max: float = 0.0

    @property
    def iterations(self) -> int:
        return len(self.rewards)

    def reached(self, until: float) -> bool:
        return len(self.rewards) >= 3 and float(np.mean(self.rewards[-3:])) >= until


def make_environment(delay_s: float):  # type: ignore[no-untyped-def]
    async def environment(prompt: list[int], completion: Completion) -> float:
        await asyncio.sleep(delay_s)  # the tool call, the sandbox, the judge
        tokens = np.asarray(completion.tokens)
        return float(np.mean(tokens < GOOD_TOKENS)) if tokens.size else 0.0

    return environment


def prompt_stream(prompts: list[list[int]]) -> Iterator[list[int]]:
    while True:
        yield from prompts


async def _train(tc: AsyncTrainctlClient, groups: list[Group], lr: float, run: Run) -> None:
    batch = [s for g in groups for s in g.sequences(g.advantages())]
    t0 = time.perf_counter()
    part = await tc.forward_backward(batch, loss=LOSS)
    stepped = await tc.optim_step(lr=lr)
    run.train_s += time.perf_counter() - t0
    run.sync_s += stepped.timings.get("after_step_s", 0.0)  # the samplers' sync
    run.stale_max = max(run.stale_max, part.metrics.get("staleness:max", 0.0))


async def sync_loop(tc: AsyncTrainctlClient, prompts: list[list[int]], args: argparse.Namespace,
                    quiet: bool = False) -> Run:  # fmt: skip
    """Sample, score, train; again."""
    run, env = Run("sync"), make_environment(args.delay)
    t_start, busy = time.perf_counter(), 0.0
    while not run.reached(args.until) and run.iterations < args.max_iterations:
        t0 = time.perf_counter()
        result = await tc.sample(prompts, n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0)
        busy += time.perf_counter() - t0
        rewards = await asyncio.gather(*(  # every rollout's environment at once
            env(prompt, c)
            for prompt, ps in zip(prompts, result.samples, strict=True)
            for c in ps.completions
        ))  # fmt: skip
        groups = [
            Group(prompt, ps.completions, list(rewards[i * GROUP : (i + 1) * GROUP]), result.step)
            for i, (prompt, ps) in enumerate(zip(prompts, result.samples, strict=True))
        ]
        run.sample_s += time.perf_counter() - t0
        run.rewards.append(float(np.mean([r for g in groups for r in g.rewards])))
        await _train(tc, groups, args.lr, run)
        _report(run, quiet)
    run.wall_s = time.perf_counter() - t_start
    run.idle = 1.0 - busy / run.wall_s
    return run


async def async_loop(tc: AsyncTrainctlClient, prompts: list[list[int]], args: argparse.Namespace,
                     quiet: bool = False) -> Run:  # fmt: skip
    """Train on the groups that finished while the next ones sample."""
    run, env = Run(f"async, {args.in_flight} in flight"), make_environment(args.delay)
    t_start = time.perf_counter()
    stream = prompt_stream(prompts)
    async with Rollouts(
        tc, stream, env, in_flight=args.in_flight, per_request=len(prompts),
        n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0,
    ) as rollouts:  # fmt: skip
        while not run.reached(args.until) and run.iterations < args.max_iterations:
            t0 = time.perf_counter()
            groups = [await rollouts.next() for _ in prompts]
            run.sample_s += time.perf_counter() - t0
            run.rewards.append(float(np.mean([r for g in groups for r in g.rewards])))
            await _train(tc, groups, args.lr, run)
            _report(run, quiet)
        run.idle = rollouts.idle_fraction
    run.wall_s = time.perf_counter() - t_start
    return run


def _report(run: Run, quiet: bool) -> None:
    if not quiet:
        print(f"{run.mode} {run.iterations:4d}  reward {run.rewards[-1]:.3f}  "
              f"sample {run.sample_s:6.1f}s  train {run.train_s:6.1f}s", flush=True)  # fmt: skip


async def _from_the_start(tc: AsyncTrainctlClient) -> None:
    """Every run starts from the same weights and optimizer state: the first run's."""
    try:
        await tc.load_checkpoint(START)
    except NotFoundError:
        await tc.save_checkpoint(START)


async def one(url: str, mode: str, args: argparse.Namespace, quiet: bool = False) -> Run:
    rng = np.random.default_rng(args.seed)
    async with AsyncTrainctlClient(url) as tc:
        vocab = (await tc.info()).limits.vocab_size
        prompts = [rng.integers(0, vocab, 4).tolist() for _ in range(args.prompts)]
        await _from_the_start(tc)
        loop = sync_loop if mode == "sync" else async_loop
        return await loop(tc, prompts, args, quiet)


def table(runs: list[Run], until: float) -> str:
    """Per loop, medians over its runs; and each async loop's wall time over sync's."""
    rows = [f"| loop | runs | wall s to reward >= {until} (median) | iterations | sample s/it | "
            "train s/it | of which sync s/it | samplers idle | staleness max |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    walls: dict[str, float] = {}
    for mode in dict.fromkeys(r.mode for r in runs):
        rs = [r for r in runs if r.mode == mode]
        med = statistics.median
        walls[mode] = med(r.wall_s for r in rs)
        reached = sum(r.reached(until) for r in rs)
        rows.append(
            f"| {mode} | {len(rs)} ({reached} reached) | {walls[mode]:.1f} | "
            f"{med(r.iterations for r in rs):.0f} | "
            f"{med(r.sample_s / r.iterations for r in rs):.2f} | "
            f"{med((r.train_s - r.sync_s) / r.iterations for r in rs):.2f} | "
            f"{med(r.sync_s / r.iterations for r in rs):.3f} | "
            f"{med(r.idle for r in rs):.0%} | {max(r.stale_max for r in rs):.0f} |"
        )
    if "sync" in walls:
        rows.append("")
        rows += [f"{mode} / sync wall time: {wall / walls['sync']:.2f}x"
                 for mode, wall in walls.items() if mode != "sync"]  # fmt: skip
    return "\n".join(rows)


def compare(url: str, args: argparse.Namespace, in_flights: tuple[int, ...] = (1, 2)) -> list[Run]:
    """``args.runs`` runs of the sync loop and of the async loop at each ``in_flights``,
    interleaved (a slow minute hits every loop alike)."""
    runs = []
    for _ in range(args.runs):
        for mode, k in [("sync", 0), *(("async", k) for k in in_flights)]:
            r = asyncio.run(one(url, mode, argparse.Namespace(**{**vars(args), "in_flight": k}),
                                quiet=True))  # fmt: skip
            runs.append(r)
            print(f"{r.mode:20s} {r.wall_s:6.1f}s  {r.iterations} iterations  "
                  f"reward {np.mean(r.rewards[-3:]):.3f}", flush=True)  # fmt: skip
    return runs


def timelines(url: str, args: argparse.Namespace, prefix: str) -> None:
    """Two iterations of each loop, each one's timeline as ``PREFIX-<mode>.json``, and both
    side by side in ``PREFIX.png``."""
    import sys
    from pathlib import Path

    from trainctl.clients import TrainctlClient

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, or imported
    import timeline_plot

    traces = {}
    for mode in ("sync", "async"):
        short = argparse.Namespace(**{**vars(args), "max_iterations": 2, "until": 2.0})
        t0 = time.time()
        asyncio.run(one(url, mode, short, quiet=True))
        with TrainctlClient(url) as tc:
            traces[mode] = tc.timeline(since=t0, until=time.time())
        Path(f"{prefix}-{mode}.json").write_text(json.dumps(traces[mode]))
        print(f"wrote {prefix}-{mode}.json ({traces[mode]['otherData']['spans']} spans)")
    timeline_plot.draw(
        {"synchronous: sample, then train": traces["sync"],
         f"asynchronous: {args.in_flight} step(s) in flight": traces["async"]},
        Path(f"{prefix}.png"),
    )  # fmt: skip
    print(f"wrote {prefix}.png")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--mode", choices=("sync", "async", "compare"), default="async")
    p.add_argument("--runs", type=int, default=3, help="runs of each loop (compare)")
    p.add_argument("--delay", type=float, default=0.2, help="environment seconds per rollout")
    p.add_argument("--prompts", type=int, default=8, help="groups per training step")
    p.add_argument("--until", type=float, default=0.8, help="stop at this mean reward")
    p.add_argument("--max-iterations", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--in-flight", type=int, default=1,
        help="async: steps' worth of groups sampling at once (1: one step off-policy)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", metavar="PREFIX", help="write two iterations' timelines and a PNG")
    args = p.parse_args()
    if args.timeline:
        timelines(args.url, args, args.timeline)
        return 0
    if args.mode != "compare":
        run = asyncio.run(one(args.url, args.mode, args))
        print(table([run], args.until))
        return 0 if run.reached(args.until) else 1
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    runs = compare(args.url, args)
    print(table(runs, args.until))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
