"""The README's RL loop (examples/rl_loop.py) learns its toy task through trainctl alone:
vLLM samples, the SDK scores and trains, the samplers get every step's weights."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.servicekit import Service

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import rl_loop  # noqa: E402


def test_the_reward_rises_from_random_to_above_0_8(sampled: Service) -> None:
    with sampled.client() as tc:
        start = tc.info().step
        its = rl_loop.run(tc, 40, until=0.8)  # stops once it gets there: CI minutes
    rewards = [i.reward for i in its]
    print("rewards:", " ".join(f"{r:.2f}" for r in rewards))
    assert rewards[0] < 0.3, "a random policy scores about 0.125"
    assert max(sum(rewards[k : k + 3]) / 3 for k in range(len(rewards) - 2)) >= 0.8
    assert [i.step for i in its] == list(range(start + 1, start + 1 + len(its)))
    assert all(i.sync_s > 0 and i.sample_s > 0 for i in its)
