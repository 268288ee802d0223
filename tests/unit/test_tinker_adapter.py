"""The Tinker adapter's pure parts: data and loss mapping (``convert``), and per-model
ordering, deduplication and futures (``state``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from trainctl.api import (
    ConflictError,
    InvalidRequestError,
    LossKind,
    Normalization,
    RateLimitedError,
)
from trainctl.service.shares import Bounds, Shares
from trainctl.service.tinker import convert, proto
from trainctl.service.tinker.state import MAX_MODELS_PER_SESSION, TinkerState


def _request(tokens: list[int], targets: list[int], **inputs: Any) -> Any:
    msg = proto.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for key, values in {"target_tokens": targets, **inputs}.items():
        arr = np.asarray(values)
        t = d.loss_fn_inputs[key]
        t.dtype = proto.DTYPE_INT64 if arr.dtype.kind == "i" else proto.DTYPE_FLOAT32
        t.dense = arr.astype(np.int64 if arr.dtype.kind == "i" else np.float32).tobytes()
        t.shape.append(arr.size)
    return msg


def test_a_datum_becomes_the_sequence_shifted_by_one() -> None:
    msg = _request([4, 5, 6], [5, 6, 7], weights=[0.0, 2.0, 1.0])
    req = convert.forward_backward_request(msg)
    seq = req.sequences[0]
    assert seq.tokens.tolist() == [4, 5, 6, 7]
    assert seq.weights.tolist() == [0.0, 0.0, 2.0, 1.0]  # Tinker's t sits on token t + 1
    assert seq.loss_mask.tolist() == [0, 0, 1, 1]  # weight 0: no target
    assert req.loss.normalization is Normalization.SUM and not req.forward_only


def test_targets_that_are_not_the_input_shifted_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match=r"data\[0\].*shifted by one.*position 1"):
        convert.forward_backward_request(_request([4, 5, 6], [5, 9, 7]))


def test_sparse_tensors_image_chunks_and_unknown_keys_are_refused() -> None:
    msg = _request([4, 5], [5, 6])
    msg.data[0].loss_fn_inputs["target_tokens"].sparse_csr = b"\x0a\x00"
    with pytest.raises(InvalidRequestError, match="sparse"):
        convert.forward_backward_request(msg)
    msg = _request([4, 5], [5, 6])
    msg.data[0].model_input.add().image = b"\x0a\x01x"
    with pytest.raises(InvalidRequestError, match=r"chunks\[1\].*only text"):
        convert.forward_backward_request(msg)
    with pytest.raises(InvalidRequestError, match="advantages: not an input of cross_entropy"):
        convert.forward_backward_request(_request([4, 5], [5, 6], advantages=[1.0, 1.0]))


def test_ratio_thresholds_map_to_epsilons() -> None:
    cfg = convert.loss_config("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    assert cfg.kind is LossKind.PPO
    assert cfg.clip_low == pytest.approx(0.3) and cfg.clip_high == pytest.approx(0.3)
    assert convert.loss_config("dro", {"beta": 0.5}).beta == 0.5
    with pytest.raises(InvalidRequestError, match="beta: not read by ppo"):
        convert.loss_config("ppo", {"beta": 0.5})
    with pytest.raises(InvalidRequestError, match="ratio bounds"):
        convert.loss_config("cispo", {"clip_low_threshold": 1.2})


def test_metric_keys_get_one_colon_and_a_tinker_reduction() -> None:
    got = convert.metrics({"loss:mean": 1.0, "grad_norm:value": 2.0, "a:b:max": 3.0, "x": 1})
    assert got == {"grad_norm:mean": 2.0, "a_b:max": 3.0}


def _admit(log: list[int], seq: int) -> Any:
    async def admit() -> Any:
        log.append(seq)

        async def finish() -> int:
            return seq

        return finish()

    return admit


def test_requests_are_admitted_in_seq_id_order_and_retries_join() -> None:
    async def run() -> None:
        state = TinkerState(order_timeout_s=5)
        model = state.add_model(state.create_session(None), 0)
        log: list[int] = []
        f3 = state.submit(model, 3, "c", "x", _admit(log, 3))
        f2 = state.submit(model, 2, "b", "x", _admit(log, 2))
        await asyncio.sleep(0.05)
        assert log == []  # 1 has not arrived
        f1 = state.submit(model, 1, "a", "x", _admit(log, 1))
        assert state.submit(model, 2, "b", "x", _admit(log, 2)) is f2  # a retry joins
        with pytest.raises(ConflictError, match="different payload"):
            state.submit(model, 2, "other", "x", _admit(log, 2))
        for f in (f1, f2, f3):
            await asyncio.wait_for(f.done.wait(), 5)
        assert log == [1, 2, 3] and [f.result for f in (f1, f2, f3)] == [1, 2, 3]

    asyncio.run(run())


def test_a_missing_predecessor_fails_the_request_after_the_timeout() -> None:
    async def run() -> None:
        state = TinkerState(order_timeout_s=0.2)
        model = state.add_model(state.create_session(None), 0)
        f = state.submit(model, 2, "b", "x", _admit([], 2))
        await asyncio.wait_for(f.done.wait(), 5)
        assert f.error is not None
        message, category = f.error
        assert category == "user" and "waited 0.2 s for seq_id 1" in message

    asyncio.run(run())


def test_a_failed_admission_still_passes_the_turn() -> None:
    async def run() -> None:
        state = TinkerState(order_timeout_s=5)
        model = state.add_model(state.create_session(None), 0)

        async def bad() -> Any:
            raise InvalidRequestError("data[0]: bad")

        f1 = state.submit(model, 1, "a", "x", bad)
        f2 = state.submit(model, 2, "b", "x", _admit([], 2))
        await asyncio.wait_for(f2.done.wait(), 5)
        assert f1.error == ("data[0]: bad", "user") and f2.result == 2

    asyncio.run(run())


def test_any_tml_key_passes_on_a_service_without_a_token(http: Any) -> None:
    assert http.post("/api/v1/client/dynamic_config", json={}).json() == {}  # no key at all
    ok = http.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-x"})
    assert ok.status_code == 200 and ok.json()["session_id"]
    for headers in ({}, {"X-API-Key": "sk-123"}):
        r = http.post("/api/v1/create_session", json={"tags": []}, headers=headers)
        assert r.status_code == 401 and "tml-" in r.json()["message"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"base_model": "Qwen/Qwen3-8B"}, "this service trains 'trainctl-tiny'"),
        ({"lora_config": {"rank": 16}}, "trains the full model, so rank 16.*--max-adapters"),
        ({"lora_config": {"rank": 0, "train_attn": False}}, "must be true"),
        ({"optimizer_config": {"type": "dimuon"}}, "AdamW, not 'dimuon'"),
    ],
)
def test_create_model_refuses_what_it_would_not_honour(change: dict, words: str) -> None:
    from trainctl.api import Info
    from trainctl.service.tinker.bodies import CreateModelRequest, check_create_model

    req = CreateModelRequest.model_validate(
        {"session_id": "s", "model_seq_id": 0, "base_model": "trainctl-tiny", **change}
    )

    def check(r: Any, step: int = 0, max_adapters: int = 0) -> Any:
        info = Info.model_construct(model_name="trainctl-tiny", step=step)
        return check_create_model(
            r, info, model_id="s:train:0", adapter_name="s-train-0", max_adapters=max_adapters
        )

    with pytest.raises(InvalidRequestError, match=words):
        check(req)
    fine = CreateModelRequest(session_id="s", model_seq_id=0, base_model="trainctl-tiny")
    assert check(fine) is None
    with pytest.raises(ConflictError, match="trained to step 2"):
        check(fine, step=2)


def test_create_model_on_an_adapters_service() -> None:
    """With --max-adapters, a LoRA model is an adapter named after its handle, with Tinker's
    targets; rank 0 (full fine-tuning of a frozen base) is refused, and so is an adapter that
    trains nothing. A trained base does not matter: it is frozen."""
    from trainctl.api import Info
    from trainctl.service.tinker.bodies import CreateModelRequest, check_create_model

    def req(**lora: Any) -> Any:
        return CreateModelRequest.model_validate(
            {"session_id": "s", "model_seq_id": 3, "base_model": "trainctl-tiny",
             "lora_config": lora}
        )  # fmt: skip

    info = Info.model_construct(model_name="trainctl-tiny", step=5)
    got = check_create_model(
        req(rank=16, seed=4, train_mlp=False),
        info,
        model_id="s:train:3",
        adapter_name="s-train-3",
        max_adapters=2,
    )
    assert got is not None
    assert (got.name, got.rank, got.targets, got.seed) == ("s-train-3", 16, ["attn", "unembed"], 4)
    with pytest.raises(InvalidRequestError, match=r"--max-adapters 2.*rank >= 1"):
        check_create_model(
            req(rank=0), info, model_id="s:train:3", adapter_name="s-train-3", max_adapters=2
        )
    off = {"train_mlp": False, "train_attn": False, "train_unembed": False}
    with pytest.raises(InvalidRequestError, match="would train nothing"):
        check_create_model(
            req(rank=4, **off), info, model_id="s:train:3", adapter_name="s-train-3", max_adapters=2
        )


TML = {"X-API-Key": "tml-x"}


def _tinker_model(http: Any) -> str:
    session = http.post("/api/v1/create_session", json={}, headers=TML).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "trainctl-tiny"}
    made = http.post("/api/v1/create_model", json=body, headers=TML).json()
    done = http.post("/api/v1/retrieve_future", json={"request_id": made["request_id"]},
                     headers=TML)  # fmt: skip
    assert done.status_code == 200 and done.json()["model_id"], done.text
    return str(made["model_id"])


def test_requests_refused_before_they_queue_do_not_block_the_next_seq_id(
    fake: Any,
) -> None:
    """The review's case: a request refused before it was queued (a bad field, a bad save
    name) held its model's later requests for the 60 s order timeout."""
    from fastapi.testclient import TestClient

    from trainctl.service.app import create_app

    with TestClient(create_app(fake, tinker_order_timeout_s=60)) as http:
        http.app.state.tinker_long_poll_s = 5
        model_id = _tinker_model(http)
        bad_field = {"model_id": model_id, "seq_id": 1, "overwrite": "sometimes"}
        r = http.post("/api/v1/save_weights", json=bad_field, headers=TML)
        assert r.status_code == 422, r.text
        bad_name = {"model_id": model_id, "seq_id": 2, "path": "../../etc"}
        f2 = http.post("/api/v1/save_weights", json=bad_name, headers=TML).json()
        third = {"model_id": model_id, "seq_id": 3, "path": None}
        f3 = http.post("/api/v1/save_weights_for_sampler", json=third, headers=TML).json()
        t0 = time.monotonic()
        for f, words in ((f2, "name"), (f3, "path: name the weights")):
            r = http.post("/api/v1/retrieve_future", json={"request_id": f["request_id"]},
                          headers=TML)  # fmt: skip
            assert r.json().get("category") == "user" and words in r.json()["error"], r.text
        assert time.monotonic() - t0 < 4  # not the order timeout
    assert fake.calls == []


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"session_id": 5}',
                                  b'{"request_id": null}', b'{"model_id": ["x"]}'])  # fmt: skip
def test_malformed_tinker_json_is_a_4xx(http: Any, body: bytes) -> None:
    for route in ("session_heartbeat", "retrieve_future", "get_info", "optim_step",
                  "save_weights", "create_model", "load_weights", "sessions/x/finish"):  # fmt: skip
        r = http.post(f"/api/v1/{route}", content=body,
                      headers={**TML, "content-type": "application/json"})  # fmt: skip
        assert 400 <= r.status_code < 500, (route, body, r.status_code, r.text)


def test_a_full_controller_queue_is_waited_out_and_429_is_a_server_error() -> None:
    from trainctl.service.tinker.state import category

    assert category(RateLimitedError("queue full")) == "server"
    assert category(InvalidRequestError("bad")) == "user"

    async def run() -> None:
        state = TinkerState(order_timeout_s=5)
        model = state.add_model(state.create_session(None), 0)
        tries: list[int] = []

        async def admit() -> Any:
            tries.append(1)
            if len(tries) < 3:
                err = RateLimitedError("64 operations are queued")
                err.retry_after_s = 0.01
                raise err
            return asyncio.sleep(0, 7)

        f = state.submit(model, 1, "a", "x", admit)
        await asyncio.wait_for(f.done.wait(), 5)
        assert f.result == 7 and len(tries) == 3

    asyncio.run(run())


def test_waiting_requests_and_sessions_are_bounded() -> None:
    async def run() -> None:
        shares = Shares(Bounds(parked=2, parked_bytes=100, sessions=3))
        state = TinkerState(order_timeout_s=5, shares=shares)
        model = state.add_model(state.create_session(None), 0)
        state.submit(model, 3, "c", "x", _admit([], 3), nbytes=10)
        state.submit(model, 4, "d", "x", _admit([], 4), nbytes=10)
        await asyncio.sleep(0.01)
        assert (state.waiting, state.waiting_bytes) == (2, 20)
        with pytest.raises(RateLimitedError, match=r"2 requests parked.*share is 2 of"):
            state.submit(model, 5, "e", "x", _admit([], 5))
        other = state.add_model(state.create_session(None), 0)
        with pytest.raises(RateLimitedError, match="bytes parked"):
            state.submit(other, 2, "b", "x", _admit([], 2), nbytes=90)
        f1 = state.submit(model, 1, "a", "x", _admit([], 1))  # its turn: never limited
        await asyncio.wait_for(f1.done.wait(), 5)
        f2 = state.submit(model, 2, "b", "x", _admit([], 2))
        await asyncio.wait_for(f2.done.wait(), 5)
        await asyncio.sleep(0.05)
        assert f1.result == 1 and (state.waiting, state.waiting_bytes) == (0, 0)

        state.session_ttl_s = 0.05
        await asyncio.sleep(0.1)
        state.create_session(None)  # sweeps the silent ones
        assert len(state.sessions) == 1 and state.models == {}
        state.silent_s = 0.0  # every session counts as silent: the oldest make room
        for _ in range(5):
            state.create_session(None)
        assert len(state.sessions) == 3

    asyncio.run(run())


def test_a_session_makes_a_bounded_number_of_model_handles(http: Any) -> None:
    """Handles are never evicted while their session lives (a client holds them), so a
    session past ``MAX_MODELS_PER_SESSION`` is refused with a 409 that says what to do, and
    nothing is added; an existing handle's ``model_seq_id`` is still fine."""
    state = TinkerState()
    session = state.create_session(None)
    for i in range(MAX_MODELS_PER_SESSION):
        state.add_model(session, i)
    with pytest.raises(ConflictError, match="start another session"):
        state.add_model(session, MAX_MODELS_PER_SESSION)
    assert len(state.models) == MAX_MODELS_PER_SESSION
    state.add_model(session, 0)
    state.add_model(state.create_session(None), MAX_MODELS_PER_SESSION)  # another session: room
    # Through the route: refused at once (not in a future), and no creation is remembered.
    app_state = http.app.state.tinker
    sid = app_state.create_session(None)
    app_state.sessions[sid].model_seqs.update(range(MAX_MODELS_PER_SESSION))
    before = dict(app_state.created)
    r = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 999,
                  "base_model": "trainctl-tiny"}, headers={"X-API-Key": "tml-x"})  # fmt: skip
    assert r.status_code == 409 and "start another session" in r.text, r.text
    assert app_state.created == before


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
def test_a_forward_backward_refused_as_too_large_passes_its_turn(fake: Any, encoding: str) -> None:
    """A 413 names no seq_id in its body's fields, but protobuf writes model_id and seq_id
    first: the gateway reads them from the body's head, and the model's next request does
    not wait out the order timeout."""
    import zstandard
    from fastapi.testclient import TestClient

    from trainctl.service.app import create_app

    with TestClient(create_app(fake, max_body_bytes=1 << 18)) as http:
        http.app.state.tinker_long_poll_s = 5
        model_id = _tinker_model(http)
        tokens = np.random.default_rng(0).integers(0, 2**31 - 1, 200_000)
        msg = _request(tokens.tolist(), tokens.tolist())  # 2.4 MB, > 256 KiB compressed
        msg.model_id, msg.seq_id = model_id, 1
        body = msg.SerializeToString()
        headers = {**TML, "content-type": "application/x-protobuf"}
        if encoding == "zstd":
            body = zstandard.ZstdCompressor().compress(body)
            headers["content-encoding"] = "zstd"
        r = http.post("/api/v1/forward_backward", content=body, headers=headers)
        assert r.status_code == 413, r.text
        nxt = {"model_id": model_id, "seq_id": 2, "path": None}
        f2 = http.post("/api/v1/save_weights_for_sampler", json=nxt, headers=TML).json()
        t0 = time.monotonic()
        r = http.post("/api/v1/retrieve_future", json={"request_id": f2["request_id"]},
                      headers=TML)  # fmt: skip
        assert "name the weights" in r.json().get("error", ""), r.text
        assert time.monotonic() - t0 < 4


def test_evictions_are_counted_on_metrics(fake: Any) -> None:
    from fastapi.testclient import TestClient

    from trainctl.service.app import create_app
    from trainctl.service.shares import Bounds

    with TestClient(create_app(fake, tinker_bounds=Bounds(sessions=2))) as http:
        for _ in range(2):
            http.post("/api/v1/create_session", json={}, headers=TML)
        refused = http.post("/api/v1/create_session", json={}, headers=TML)
        assert refused.status_code == 429, refused.text  # none silent yet: refused
        assert "holds 2 Tinker sessions" in refused.text
        http.app.state.tinker.silent_s = 0.0  # all silent now: the oldest make room
        for _ in range(3):
            http.post("/api/v1/create_session", json={}, headers=TML)
        text = http.get("/metrics").text
    assert 'trainctl_gateway_evictions{table="tinker_sessions"} 3.0' in text, text
    assert text.count("# HELP trainctl_gateway_evictions ") == 1
    assert 'trainctl_tenant_evictions_total{table="sessions",tenant="_operator"} 3.0' in text
    assert 'trainctl_tenant_refusals_total{table="sessions",tenant="_operator"} 1.0' in text


def _gspo(ratio_mask: list[float], inputs: dict[str, Any] | None = None, **config: float) -> Any:
    msg = _request(
        [4, 5, 6, 7], [5, 6, 7, 8], logprobs=[-1.0] * 4, advantages=[1.0] * 4,
        sequence_ratio_mask=ratio_mask, **(inputs or {}),
    )  # fmt: skip
    msg.loss_fn = "gspo"
    for k, v in config.items():
        msg.loss_fn_config[k] = v
    return msg


def test_gspo_takes_its_ratio_mask_and_clip_thresholds() -> None:
    req = convert.forward_backward_request(
        _gspo([0.0, 0.5, 1.0, 0.0], clip_low_threshold=0.9, clip_high_threshold=1.1)
    )
    assert req.loss.kind is LossKind.GSPO
    assert req.loss.clip_low == pytest.approx(0.1) and req.loss.clip_high == pytest.approx(0.1)
    # Tinker's "!= 0", on trainctl's positions (token t + 1)
    assert req.sequences[0].sequence_ratio_mask.tolist() == [0, 0, 1, 1, 0]
    sampler = {"sampler_logprobs": [-1.1] * 4}
    geo = convert.forward_backward_request(_gspo([1.0] * 4, sampler, geo_mask_high=1.2))
    assert geo.loss.band("geo_mask") == (0.0, 1.2)


def test_a_policy_loss_without_weights_trains_on_the_sampled_positions() -> None:
    """The cookbook's rl/train.py datum: 0 placeholders over the prompt, no weights, no mask.
    Its loss tokens are the completion's, for every policy loss, natively alike; weights and
    a ratio mask say otherwise and win; cross-entropy counts every target."""
    from trainctl.api import ForwardBackwardRequest, SequenceBatch
    from trainctl.api.training import sampled_positions

    prompt = {"logprobs": [0.0, 0.0, -0.7, -1.2], "advantages": [0.0, 0.0, 0.0, 1.0]}
    for loss in ("gspo", "ppo", "importance_sampling", "cispo", "dro"):
        msg = _request([4, 5, 6, 7], [5, 6, 7, 8], **prompt)
        msg.loss_fn = loss
        req = convert.forward_backward_request(msg)
        assert req.sequences[0].loss_mask.tolist() == [0, 0, 0, 1, 1], loss
    native = ForwardBackwardRequest(
        sequences=SequenceBatch.from_sequences(
            [{"tokens": [4, 5, 6, 7, 8], "old_logprobs": [0.0, *prompt["logprobs"]],
              "advantages": [0.0, *prompt["advantages"]]}]
        ),
        loss={"kind": "gspo"},
    )  # fmt: skip
    assert native.sequences[0].loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert sampled_positions(native.sequences).tolist() == [0, 0, 0, 1, 1]
    weighted = _request([4, 5, 6, 7], [5, 6, 7, 8], weights=[1.0] * 4, **prompt)
    weighted.loss_fn = "gspo"
    assert convert.forward_backward_request(weighted).sequences[0].loss_mask.tolist() == [
        0, 1, 1, 1, 1,
    ]  # fmt: skip
    masked_msg = _request([4, 5, 6, 7], [5, 6, 7, 8], sequence_ratio_mask=[1.0, 1.0, 0, 0],
                          **prompt)  # fmt: skip
    masked_msg.loss_fn = "gspo"
    masked = convert.forward_backward_request(masked_msg)
    assert masked.sequences[0].sequence_ratio_mask.tolist() == [0, 1, 1, 0, 0]
    assert masked.sequences[0].loss_mask.tolist() == [0, 0, 0, 1, 1]
    sft = convert.forward_backward_request(_request([4, 5, 6, 7], [5, 6, 7, 8]))
    assert sft.sequences[0].num_loss_tokens == 4


def test_a_sequence_loss_refuses_a_datum_with_no_sampled_position() -> None:
    """Placeholders everywhere: a sequence ratio over them would be a guess (gspo, or a
    sequence-level correction), refused naming sequence_ratio_mask; a token-level loss takes
    the datum (its terms are 0 there)."""
    from pydantic import ValidationError

    zeros = {"logprobs": [0.0] * 4, "advantages": [0.0] * 4}
    for loss, extra, config in (
        ("gspo", {}, {}),
        ("ppo", {"sampler_logprobs": [-1.0] * 4}, {"seq_tis_cap": 2.0}),
    ):
        msg = _request([4, 5, 6, 7], [5, 6, 7, 8], **zeros, **extra)
        msg.loss_fn = loss
        for k, v in config.items():
            msg.loss_fn_config[k] = v
        with pytest.raises(ValidationError, match=r"sequences\[0\]: no position is marked "
                           r"sampled.*give sequence_ratio_mask"):  # fmt: skip
            convert.forward_backward_request(msg)
    ppo = _request([4, 5, 6, 7], [5, 6, 7, 8], **zeros)
    ppo.loss_fn = "ppo"
    assert convert.forward_backward_request(ppo).sequences[0].num_loss_tokens == 0


def test_bad_gspo_input_is_refused_naming_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"sequences\[0\].sequence_ratio_mask marks no"):
        convert.forward_backward_request(_gspo([0.0] * 4))
    with pytest.raises(InvalidRequestError, match=r"sequence_ratio_mask: must be 1-D with one"):
        convert.forward_backward_request(_gspo([1.0] * 3))
    with pytest.raises(ValidationError, match="seq_tis_cap") as e:
        convert.forward_backward_request(
            _gspo([1.0] * 4, {"sampler_logprobs": [-1.1] * 4}, seq_tis_cap=-1.0)
        )
    assert "greater than 0" in str(e.value)
    msg = _request([4, 5], [5, 6], sequence_ratio_mask=[1.0, 1.0])
    msg.loss_fn = "ppo"
    with pytest.raises(InvalidRequestError, match="sequence_ratio_mask: not an input of ppo"):
        convert.forward_backward_request(msg)


def test_stable_reinforce_is_refused_in_one_line_naming_the_nearest_losses() -> None:
    with pytest.raises(InvalidRequestError) as e:
        convert.loss_config("stable_reinforce", {})
    text = str(e.value)
    assert "\n" not in text and "not published" in text
    assert "'gspo'" in text and "'importance_sampling'" in text


def test_a_sampling_client_from_before_a_restart_is_gone_not_unknown() -> None:
    """Session ids carry the gateway's start: after a restart (a new ``TinkerState``), a
    sampling client made before it gets a 410 that says the restart emptied the window; an
    id this start could have issued but did not is a 404."""
    from fastapi import FastAPI

    from trainctl.api import GoneError, NotFoundError
    from trainctl.service.tinker import routes

    before, after = FastAPI(), FastAPI()
    routes.install(before)
    routes.install(after)
    old = before.state.tinker.create_session(None)
    new = after.state.tinker.create_session(None)
    assert len(old) == len(new) == 16 and old[:6] != new[:6]
    sessions = after.state.tinker_sampling
    with pytest.raises(GoneError, match="made before the service restarted") as e:
        sessions.get(f"{old}:sample:0", None)
    assert e.value.status == 410 and e.value.details["restarted"] is True
    with pytest.raises(GoneError):
        sessions.get(f"{old}:train:0:sample:3", None)  # a LoRA model's sampling client
    with pytest.raises(NotFoundError):
        sessions.get(f"{new}:sample:0", None)
    with pytest.raises(NotFoundError):
        sessions.get("not-one-of-ours:sample:0", None)


def test_a_refused_batch_reads_as_the_apis_own_words_in_a_tinker_future() -> None:
    """A batch the API refuses while it is built (the loss needs an input the datums lack)
    fails its future with the API's message, naming the field: no pydantic "Value error,"
    prefix and no status code folded into the text."""
    from pydantic import ValidationError

    from trainctl.api import TrainBatchRequest
    from trainctl.service.tinker.state import describe

    with pytest.raises(ValidationError) as e:
        TrainBatchRequest(sequences=[{"tokens": [1, 2, 3]}], loss={"kind": "ppo"})
    said = describe(e.value)
    assert said == "request: sequences[0].advantages is required by the ppo loss", said
