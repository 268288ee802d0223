"""The sampling request's checks and the Tinker ``SampleResponse`` it becomes (fast tier)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from trainctl.api import (
    Completion,
    InvalidRequestError,
    ModelLimits,
    PromptSamples,
    SampleRequest,
    SampleResult,
)

LIMITS = ModelLimits(vocab_size=100, max_seq_len=32, max_sequences=4, max_tokens_per_request=200)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"prompts": [[1, 2], [3, 100]]}, r"prompts\[1\]\[1\]: token id 100"),
        ({"prompts": [[1], [2], [-3]]}, r"prompts\[2\]\[0\]: token id -3"),
        ({"prompts": [[1], []]}, r"prompts\[1\]: is empty"),
        ({"prompts": [[1] * 30], "max_tokens": 3}, r"prompts\[0\]: length 30 \+ max_tokens 3"),
        ({"prompts": [[1]], "max_tokens": 32}, "max_tokens: 32 leaves no room"),
        ({"prompts": [[1]] * 5}, "prompts: 5 prompts exceed the limit 4"),
        ({"prompts": [[1]] * 4, "n": 8, "max_tokens": 8}, "prompts: 260 tokens"),
        ({"prompts": [[1]], "stop_token_ids": [5, 100]}, r"stop_token_ids\[1\]"),
    ],
)
def test_limits_name_the_field(fields: dict, where: str) -> None:
    req = SampleRequest(**fields)
    with pytest.raises(InvalidRequestError, match=where):
        req.check_limits(LIMITS)


def test_a_request_inside_every_limit_passes() -> None:
    SampleRequest(prompts=[[0, 99], [5] * 20], n=2, max_tokens=12).check_limits(LIMITS)


@pytest.mark.parametrize(
    "fields", [{"max_tokens": 0}, {"n": 65}, {"n": 0}, {"top_k": 0}, {"top_p": 0}, {"prompts": []}]
)
def test_parameters_out_of_range_are_refused(fields: dict) -> None:
    with pytest.raises(ValidationError):
        SampleRequest(**{"prompts": [[1]], **fields})


def test_the_tinker_sample_response_decodes_in_the_sdk() -> None:
    """Our protobuf, read by the SDK's own decoder: tokens, log-probs, stop reasons, and the
    prompt log-probs with the first one absent."""
    response_conv = pytest.importorskip("tinker.proto.response_conv")
    from trainctl.service.tinker.sampling_sessions import sample_response

    result = SampleResult(
        samples=[
            PromptSamples(
                completions=[
                    Completion(tokens=[4, 5], logprobs=[-0.5, -1.25], finish_reason="stop"),
                    Completion(tokens=[6, 7, 8], logprobs=[-2.0, -0.25, -3.5],
                               finish_reason="length"),
                ],
                prompt_logprobs=[None, -1.5, -2.5],
            )
        ],
        step=3, sampler=0, seconds=0.1,
    )  # fmt: skip
    got = response_conv.deserialize_sample_response(sample_response(result))
    assert [s.tokens for s in got.sequences] == [[4, 5], [6, 7, 8]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -1.25], [-2.0, -0.25, -3.5]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.prompt_logprobs[0] is None and got.prompt_logprobs[1:] == [-1.5, -2.5]
    assert not any(isinstance(x, float) and math.isnan(x) for x in got.prompt_logprobs[1:])


def test_a_token_id_beyond_int32_is_a_422_not_an_overflow() -> None:
    """Found by the schemathesis fuzz: a 25-digit id overflowed numpy into a 500."""
    with pytest.raises(ValidationError, match=r"prompts\.0\.1"):
        SampleRequest(prompts=[[1, 1266925515068477836099584000]])
    with pytest.raises(ValidationError, match=r"stop_token_ids\.0"):
        SampleRequest(prompts=[[1]], stop_token_ids=[-(2**40)])


def test_sampling_sessions_are_bounded_and_their_evictions_counted() -> None:
    from trainctl.api import NotFoundError
    from trainctl.service.shares import Bounds, Shares
    from trainctl.service.tinker.sampling_table import (
        PinnedWeights,
        SamplingSession,
        SamplingSessions,
    )

    evicted: dict[str, int] = {}
    table = SamplingSessions(evicted, Shares(Bounds(sampling_clients=8)))
    for i in range(20):
        table.add(SamplingSession(f"s:sample:{i}", "m", None, step=i))
        table.remember_path(f"tinker://m/sampler_weights/{i}", PinnedWeights(None, i))
    assert len(table.sessions) == 8 and len(table.sampler_paths) == 8
    assert evicted["tinker_sampling_sessions"] == 12
    assert table.get("s:sample:19", None).step == 19
    with pytest.raises(NotFoundError, match="unknown or has expired"):
        table.get("s:sample:0", None)


def test_weights_saved_with_a_ttl_are_gone_once_it_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tinker's ``ttl_seconds``: a sampling client of weights saved with one samples until it
    passes, then gets a 410 naming it; one saved without keeps sampling."""
    import time

    from trainctl.api import GoneError
    from trainctl.service.tinker import sampling_table as ss

    table = ss.SamplingSessions({})
    now = time.time()
    monkeypatch.setattr(ss.time, "time", lambda: now)
    table.add(ss.SamplingSession("a:sample:0", "m", None, step=3, expiry=ss.Expiry.after(60)))
    table.add(ss.SamplingSession("a:sample:1", "m", None, step=3))
    path = "tinker://a:train:0/sampler_weights/final"
    table.remember_path(path, ss.PinnedWeights(None, 3, ss.Expiry.after(60)))
    assert table.get("a:sample:0", None).step == 3 and table.pinned(path, None).step == 3
    monkeypatch.setattr(ss.time, "time", lambda: now + 61)
    with pytest.raises(GoneError, match="ttl_seconds=60"):
        table.pinned(path, None)  # a client made from the path after its TTL
    with pytest.raises(GoneError, match="ttl_seconds=60, which have passed") as e:
        table.get("a:sample:0", None)
    assert e.value.status == 410
    assert table.get("a:sample:1", None).step == 3
    assert ss.Expiry.after(None) is None


def test_a_seed_whose_children_overflow_is_a_422_naming_it() -> None:
    """vLLM seeds completion i of a request with ``seed + i``: a seed in the last n - 1 values
    below 2^64 overflowed inside the engine's step (a 500 for the caller and every request
    in that step). Native and Tinker requests alike."""
    from trainctl.service.tinker.sampling_sessions import AsampleRequest

    top = 2**64 - 1
    with pytest.raises(ValidationError, match=r"seed\n.*with n = 2 the seed is at most 2\^64 - 2"):
        SampleRequest(prompts=[[1]], n=2, seed=top)
    assert SampleRequest(prompts=[[1]], n=2, seed=top - 1).seed == top - 1
    assert SampleRequest(prompts=[[1]], n=1, seed=top).seed == top
    body = {"prompt": {"chunks": []}, "sampling_params": {"seed": top}}
    with pytest.raises(ValidationError, match=r"sampling_params\n.*num_samples = 3"):
        AsampleRequest(**body, num_samples=3)
    assert AsampleRequest(**body, num_samples=1).sampling_params.seed == top
