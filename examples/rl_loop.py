"""A complete RL loop through trainctl alone: sample, reward, train, sync, with the SDK.

    trainctl serve --samplers 1          # in one shell
    python examples/rl_loop.py           # in another: prints one line per iteration

The toy task: the reward of a completion is the fraction of its tokens below 64, so a random
policy over the embedded model's 512-token vocabulary scores about 0.125. Each iteration
samples a group of completions per prompt from the service's vLLM samplers (with the
sampler's log-prob of every token), scores them, and takes one PPO step with group-relative
advantages (GRPO's). The samplers then hold the new weights: after the step itself (the
service's default, ``--sampler-sync after_step``), or when this loop asks (``manual``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from trainctl.clients import TrainctlClient

GOOD_TOKENS = 64
"""A completion token counts as good below this id."""


@dataclass
class Iteration:
    step: int
    reward: float
    sample_s: float
    train_s: float
    sync_s: float
    tokens: int


def reward(tokens: list[int]) -> float:
    return float(np.mean(np.asarray(tokens) < GOOD_TOKENS)) if tokens else 0.0


def iteration(
    tc: TrainctlClient,
    prompts: list[list[int]],
    *,
    group: int = 8,
    max_tokens: int = 8,
    lr: float = 2e-3,
    manual_sync: bool = False,
) -> Iteration:
    """One RL iteration; returns its mean reward (before the step) and where time went."""
    t0 = time.perf_counter()
    sampled = tc.sample(prompts, n=group, max_tokens=max_tokens, temperature=1.0)
    t1 = time.perf_counter()
    batch, rewards = [], []
    for prompt, s in zip(prompts, sampled.samples, strict=True):
        scores = np.array([reward(c.tokens) for c in s.completions])
        advantages = scores - scores.mean()  # group-relative: GRPO's baseline
        rewards.extend(scores)
        for c, a in zip(s.completions, advantages, strict=True):
            n, m = len(prompt), len(c.tokens)
            assert c.logprobs is not None
            batch.append({
                "tokens": prompt + c.tokens,
                "loss_mask": [0] * n + [1] * m,
                "advantages": [0.0] * n + [float(a)] * m,
                "old_logprobs": [0.0] * n + c.logprobs,  # the sampler's: the behaviour policy
            })  # fmt: skip
    tc.forward_backward(batch, loss={"kind": "ppo", "clip_low": 0.2, "clip_high": 0.28})
    stepped = tc.optim_step(lr=lr)
    t2 = time.perf_counter()
    if manual_sync:
        synced = tc.sync_weights()
        sync_s = synced.gather_s + synced.load_s
    else:  # synced inside optim_step, before it answered
        last = tc.info().samplers.last_sync  # type: ignore[union-attr]
        assert last is not None and last.step == stepped.step
        sync_s = last.gather_s + last.load_s
    t3 = time.perf_counter()
    tokens = sum(len(c.tokens) for s in sampled.samples for c in s.completions)
    train_s = (t2 - t1) - (0.0 if manual_sync else sync_s)
    return Iteration(
        step=stepped.step,
        reward=float(np.mean(rewards)),
        sample_s=t1 - t0,
        train_s=train_s,
        sync_s=sync_s if not manual_sync else t3 - t2,
        tokens=tokens,
    )


def run(
    tc: TrainctlClient,
    iterations: int,
    *,
    prompts: int = 8,
    seed: int = 0,
    quiet: bool = False,
    until: float | None = None,
) -> list[Iteration]:
    """``iterations`` of the loop; with ``until``, fewer: it stops once the mean reward of the
    last three reaches it."""
    rng = np.random.default_rng(seed)
    vocab = int(tc.info().model["vocab_size"])
    batch = [rng.integers(0, vocab, 4).tolist() for _ in range(prompts)]
    manual = tc.info().samplers.sync == "manual"  # type: ignore[union-attr]
    out = []
    if not quiet:
        print("iter  step  reward  sample_s  train_s  sync_s  tokens")
    for i in range(iterations):
        it = iteration(tc, batch, manual_sync=manual)
        out.append(it)
        if not quiet:
            print(f"{i:4d}  {it.step:4d}  {it.reward:6.3f}  {it.sample_s:8.3f}  "
                  f"{it.train_s:7.3f}  {it.sync_s:6.3f}  {it.tokens:6d}")  # fmt: skip
        if until is not None and len(out) >= 3 and np.mean([o.reward for o in out[-3:]]) >= until:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--iterations", type=int, default=30)
    args = p.parse_args()
    with TrainctlClient(args.url) as tc:
        its = run(tc, args.iterations)
    first, last = its[0].reward, np.mean([i.reward for i in its[-3:]])
    print(f"reward {first:.3f} -> {last:.3f} over {len(its)} iterations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
