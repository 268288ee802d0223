"""The staleness bound (``workers/control/staleness.py``) and the steps training data carries
(``token_steps``, ``policy_step``): what is refused with which status and field, what is
reported, and sampling paced until a sync brings weights within the bound."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from trainctl.api import (
    Completion,
    ConflictError,
    InvalidRequestError,
    NotReadyError,
    TrainBatchRequest,
)
from trainctl.api.batch import SequenceBatch
from trainctl.api.wire import decode_sequences, encode_sequences
from trainctl.workers.control.staleness import Staleness


def _batch(*steps: list[int], mask_prompt: int = 2) -> SequenceBatch:
    """Sequences whose first ``mask_prompt`` tokens are a prompt (no loss), with these steps."""
    return SequenceBatch.from_sequences(
        [
            {
                "tokens": list(range(len(s))),
                "loss_mask": [0] * mask_prompt + [1] * (len(s) - mask_prompt),
                "token_steps": s,
            }
            for s in steps
        ]
    )


def _served(*steps: int, max_staleness: int | None = 1) -> Staleness:
    s = Staleness(max_staleness, tracks_samplers=True)
    for step in steps:
        asyncio.run(s.served(None, step))
    return s


def test_a_sequences_step_is_its_oldest_loss_tokens_and_the_metrics_say_how_stale() -> None:
    seen: list[np.ndarray] = []
    s = Staleness(2, tracks_samplers=True, observe=seen.append)
    for step in (3, 4, 5):
        asyncio.run(s.served(None, step))
    # prompts at -1; an in-flight completion spans steps 3 and 4: its step is 3
    batch = _batch([-1, -1, 3, 3, 4], [-1, -1, 5, 5], [-1, -1, 4, 4, 4])
    metrics = s.check(batch, step=5)
    assert metrics == {
        "staleness:max": 2.0,
        "staleness:mean": pytest.approx((2 + 0 + 1) / 3),
        "stale_sequences:count": 0.0,
    }
    assert [a.tolist() for a in seen] == [[2, 0, 1]]


def test_sequences_past_the_bound_are_a_409_naming_them_and_their_steps() -> None:
    s = _served(1, 2, 3, 4, max_staleness=1)
    batch = _batch([-1, -1, 4, 4], [-1, -1, 2, 3], [-1, -1, 1, 1])
    with pytest.raises(ConflictError) as e:
        s.check(batch, step=4)
    assert "sequences[1] (step 2), sequences[2] (step 1)" in e.value.message
    assert "--max-staleness 1" in e.value.message
    assert e.value.details["stale"] == [[1, 2], [2, 1]]
    assert e.value.details["step"] == 4


def test_report_mode_and_forward_only_calls_train_on_them_and_count_them() -> None:
    s = _served(1, 2, 3, 4, max_staleness=1)
    batch = _batch([-1, -1, 4, 4], [-1, -1, 2, 3], [-1, -1, 1, 1])
    for kwargs in ({"mode": "report"}, {"training": False}):
        metrics = s.check(batch, step=4, **kwargs)  # type: ignore[arg-type]
        assert metrics["stale_sequences:count"] == 2.0
        assert metrics["staleness:max"] == 3.0


def test_no_bound_checks_the_steps_and_refuses_nothing() -> None:
    s = _served(0, 1, max_staleness=None)
    metrics = s.check(_batch([-1, -1, 0, 0]), step=40)
    assert metrics == {"staleness:max": 40.0, "staleness:mean": 40.0}
    with pytest.raises(InvalidRequestError, match="in the future"):
        s.check(_batch([-1, -1, 41, 41]), step=40)


@pytest.mark.parametrize(
    ("steps", "field", "problem"),
    [
        ([-1, -1, 3, 6], "sequences[0].token_steps[3]", "step 6 is in the future"),
        ([-1, -1, 2, 2], "sequences[0].token_steps[2]", "step 2 of the model was never served"),
        ([-1, -1, 3, -1], "sequences[0].token_steps[3]", "a loss token with no step"),
    ],
)
def test_bad_steps_are_a_422_naming_the_token(steps: list[int], field: str, problem: str) -> None:
    s = _served(0, 1, 3, max_staleness=None)
    with pytest.raises(InvalidRequestError) as e:
        s.check(_batch(steps), step=3)
    assert e.value.details["field"] == field
    assert problem in e.value.message


def test_without_samplers_any_step_up_to_the_trainers_is_known() -> None:
    s = Staleness(None, tracks_samplers=False)
    assert s.check(_batch([-1, -1, 2, 2]), step=3)["staleness:max"] == 1.0


def test_a_new_line_of_training_forgets_the_steps_served_before() -> None:
    s = _served(0, 1, 2, max_staleness=None)
    asyncio.run(s.served(None, 1, new_line=True))  # a checkpoint of step 1 was loaded
    with pytest.raises(InvalidRequestError, match="never served"):
        s.check(_batch([-1, -1, 0, 0]), step=1)
    assert s.check(_batch([-1, -1, 1, 1]), step=1)["staleness:max"] == 0.0


def test_steps_below_minus_one_and_both_spellings_are_refused_at_the_gateway() -> None:
    with pytest.raises(InvalidRequestError, match=r"sequences\[0\].token_steps\[1\]: must be"):
        SequenceBatch.from_sequences([{"tokens": [1, 2], "token_steps": [0, -2]}])
    with pytest.raises(InvalidRequestError, match="policy_step or token_steps, not both"):
        SequenceBatch.from_sequences([{"tokens": [1, 2], "token_steps": [0, 0], "policy_step": 0}])
    for bad in (-3, 2**63, 10**30):  # past int64: a 422, not an overflow into a 500
        with pytest.raises(InvalidRequestError, match=r"sequences\[0\].policy_step: must be"):
            SequenceBatch.from_sequences([{"tokens": [1, 2], "policy_step": bad}])
    assert SequenceBatch.from_sequences([{"tokens": [1, 2], "policy_step": 2**63 - 1}])


def test_policy_step_is_every_tokens_step_in_json_and_token_steps_survive_the_wire() -> None:
    req = TrainBatchRequest.model_validate(
        {
            "sequences": [
                {"tokens": [5, 6, 7], "policy_step": 4},
                {"tokens": [1, 2], "policy_step": 2},
            ]
        }
    )
    assert req.sequences.column("token_steps").tolist() == [4, 4, 4, 2, 2]
    big = _batch([-1, -1, 2**33, 7])
    back = decode_sequences(encode_sequences(big, {}))["sequences"]
    assert back.column("token_steps").tolist() == [-1, -1, 2**33, 7]  # nothing wraps


def test_a_completion_becomes_a_sequence_with_its_steps_and_log_probs() -> None:
    c = Completion(tokens=[9, 8, 7], logprobs=[-0.5, -1.0, -2.0], finish_reason="length",
                   token_steps=[3, 3, 4])  # fmt: skip
    seq = c.sequence([1, 2], advantage=0.25)
    assert seq.tokens.tolist() == [1, 2, 9, 8, 7]
    assert seq.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert seq.token_steps.tolist() == [-1, -1, 3, 3, 4]
    assert seq.old_logprobs.tolist() == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert seq.advantages.tolist() == [0.0, 0.0, 0.25, 0.25, 0.25]
    assert _served(3, 4).check(SequenceBatch.from_sequences([seq]), step=4)["staleness:max"] == 1


def test_pacing_waits_for_a_sync_and_answers_503_past_its_wait() -> None:
    async def run() -> None:
        s = Staleness(1, tracks_samplers=True)
        await s.served(None, 0)
        trainer, newest = [3], [0]

        def lag() -> int:
            return trainer[0] - newest[0]

        waiting = asyncio.create_task(s.pace(lag, 10.0, None))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # 3 steps behind, the bound is 1
        newest[0] = 2
        await s.served(None, 2)
        await asyncio.wait_for(waiting, 1.0)  # released by the sync

        trainer[0] = 5
        t0 = time.monotonic()
        with pytest.raises(NotReadyError) as e:
            await s.pace(lag, 0.3, None)
        assert 0.25 < time.monotonic() - t0 < 2.0
        assert e.value.retry_after_s == 1.0
        assert "3 steps behind the trainer, more than --max-staleness 1" in e.value.message

        await s.pace(lambda: 1, 0.0, None)  # within the bound: at once
        await Staleness(None, tracks_samplers=True).pace(lambda: 99, 0.0, None)  # no bound

    asyncio.run(run())


def test_the_steps_served_are_a_bounded_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainctl.workers.control import staleness

    monkeypatch.setattr(staleness, "REMEMBERED", 3)
    s = _served(0, 1, 2, 3, 4, max_staleness=None)
    assert s.check(_batch([-1, -1, 2, 2]), step=4)["staleness:max"] == 2.0
    with pytest.raises(InvalidRequestError, match="the newest 3 are remembered"):
        s.check(_batch([-1, -1, 1, 1]), step=4)


def test_a_split_steps_parts_merge_their_staleness_for_optim_step() -> None:
    from trainctl.api import Normalization
    from trainctl.workers.control.steps import Window

    w = Window(Normalization.TOKEN_MEAN)
    for metrics in (
        {"staleness:max": 1.0, "staleness:mean": 1.0, "stale_sequences:count": 0.0},
        {},  # a part without steps
        {"staleness:max": 3.0, "staleness:mean": 2.0, "stale_sequences:count": 2.0},
    ):
        w.parts += 1
        w.add_staleness(metrics)
    assert w.staleness == {
        "staleness:max": 3.0, "staleness:mean": 1.5, "stale_sequences:count": 2.0
    }  # fmt: skip
