"""The gateway's routes with a fake controller: validation, error model, status codes."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from helpers.fakes import FakeController

GOOD = {"sequences": [{"tokens": [1, 2, 3, 4]}, {"tokens": [5, 6], "loss_mask": [0, 1]}]}


def test_train_batch_reaches_controller(http: TestClient, fake: FakeController) -> None:
    r = http.post("/v1/train_batch", json=GOOD)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["step"] == 1 and body["metrics"]["tokens:sum"] == 6.0
    assert fake.calls == ["train_batch"]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"sequences": []}, "sequences", "at least 1"),
        ({}, "sequences", "required"),
        ({"sequences": [{"tokens": [1, 2, 100]}]}, "sequences[0].tokens[2]", "outside the vocab"),
        ({"sequences": [{"tokens": [1, -1]}]}, "sequences[0].tokens[1]", "outside the vocab"),
        (
            {"sequences": [{"tokens": [1, 2, 3], "loss_mask": [1, 1]}]},
            "sequences[0].loss_mask",
            "has 2 entries but tokens has 3",
        ),
        (
            {"sequences": [{"tokens": [1, 2], "weights": [1.0]}]},
            "sequences[0].weights",
            "has 1 entries",
        ),
        ({"sequences": [{"tokens": ["a", 2]}]}, "sequences[0].tokens[0]", "integer"),
        ({"sequences": [{"tokens": [1.5, 2]}]}, "sequences[0].tokens[0]", "integer"),
        ({"sequences": [{"tokens": "12"}]}, "sequences[0].tokens", "array"),
        (
            {"sequences": [{"tokens": [1, 2], "loss_mask": [0, 2]}]},
            "sequences[0].loss_mask[1]",
            "less than or equal to 1",
        ),
        ({"sequences": [{"tokens": list(range(17))}]}, "sequences[0].tokens", "max_seq_len 16"),
        ({"sequences": [{"tokens": [1, 2], "loss_mask": [1, 0]}]}, "sequences", "no sequence"),
        ({"sequences": [{"tokens": [1, 2], "extra": 1}]}, "sequences[0].extra", "not permitted"),
    ],
)
def test_bad_input_names_field_and_changes_nothing(
    http: TestClient, fake: FakeController, body: dict, field: str, words: str
) -> None:
    for route in ("/v1/train_batch", "/v1/eval_batch"):
        r = http.post(route, json=body)
        assert r.status_code == 422, r.text
        err = r.json()
        assert err["type"] == "invalid_request"
        assert err["message"].startswith(f"{field}:"), err["message"]
        assert words in err["message"], err["message"]
    assert fake.calls == [] and fake.step == 0


def test_malformed_json_is_422(http: TestClient, fake: FakeController) -> None:
    r = http.post(
        "/v1/train_batch", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["type"] == "invalid_request"
    assert fake.calls == []


def test_memory_profile_conflicts_are_409(http: TestClient) -> None:
    assert http.post("/v1/memory_profile/stop").status_code == 409
    assert http.post("/v1/memory_profile/start", json={"max_entries": 10}).status_code == 200
    r = http.post("/v1/memory_profile/start")
    assert r.status_code == 409 and "already recording" in r.json()["message"]
    stop = http.post("/v1/memory_profile/stop").json()
    assert stop["files"][0]["size_bytes"] == 19


def test_max_entries_bounds(http: TestClient) -> None:
    r = http.post("/v1/memory_profile/start", json={"max_entries": 0})
    assert r.status_code == 422 and r.json()["message"].startswith("max_entries:")


def test_ready_reflects_controller(http: TestClient, fake: FakeController) -> None:
    assert http.get("/v1/ready").status_code == 200
    fake.ready = False
    r = http.get("/v1/ready")
    assert r.status_code == 503 and r.json()["type"] == "not_ready"
    assert http.get("/v1/health").json() == {"status": "ok", "service": "trainctl", "instance": ""}


def test_openapi_documents_every_route(http: TestClient) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for p in (
        "/v1/train_batch",
        "/v1/eval_batch",
        "/v1/memory_profile/start",
        "/v1/memory_profile/stop",
        "/v1/info",
        "/v1/health",
        "/v1/ready",
    ):
        assert p in paths
    assert http.get("/docs").status_code == 200


def test_operation_ids_are_the_rpc_names(http: TestClient) -> None:
    """Generated clients get ``train_batch(...)``, not ``train_batch_v1_train_batch_post``."""
    paths = http.get("/openapi.json").json()["paths"]
    ids = {(m.upper(), p): op["operationId"] for p, ops in paths.items() for m, op in ops.items()}
    assert ids == {
        ("POST", "/v1/sample"): "sample",
        ("POST", "/v1/weights/sync"): "sync_weights",
        ("POST", "/v1/adapters"): "create_adapter",
        ("GET", "/v1/adapters"): "list_adapters",
        ("DELETE", "/v1/adapters/{name}"): "delete_adapter",
        ("DELETE", "/v1/checkpoints/{checkpoint_id}"): "delete_checkpoint",
        ("DELETE", "/v1/exports/{name}"): "delete_export",
        ("POST", "/v1/train_batch"): "train_batch",
        ("POST", "/v1/eval_batch"): "eval_batch",
        ("POST", "/v1/logprobs"): "logprobs",
        ("POST", "/v1/forward_backward"): "forward_backward",
        ("POST", "/v1/optim_step"): "optim_step",
        ("GET", "/v1/operations/{op_id}"): "get_operation",
        ("POST", "/v1/memory_profile/start"): "start_memory_profile",
        ("POST", "/v1/memory_profile/stop"): "stop_memory_profile",
        ("GET", "/v1/memory_profiles"): "list_memory_profiles",
        ("GET", "/v1/memory_profiles/{profile_id}"): "get_memory_profile",
        ("GET", "/v1/memory_profiles/{profile_id}/files/{name}"): "download_memory_profile_file",
        ("POST", "/v1/checkpoints"): "save_checkpoint",
        ("GET", "/v1/checkpoints"): "list_checkpoints",
        ("POST", "/v1/checkpoints/{checkpoint_id}/load"): "load_checkpoint",
        ("POST", "/v1/export/hf"): "export_hf",
        ("GET", "/v1/info"): "info",
        ("GET", "/v1/timeline"): "timeline",
        ("GET", "/v1/health"): "health",
        ("GET", "/v1/ready"): "ready",
    }


def _rl(n: int, **extra: object) -> dict:
    return {
        "tokens": list(range(1, n + 1)),
        "advantages": [0.5] * n,
        "old_logprobs": [-1.0] * n,
        **extra,
    }


def test_rl_loss_reaches_controller(http: TestClient, fake: FakeController) -> None:
    """The loss config and the per-token RL inputs arrive at the controller as sent."""
    seqs = [_rl(4, advantages=[0.0, 1.5, -2.0, 0.25]), _rl(3, old_logprobs=[-0.5, -1.25, -3.0])]
    body = {"sequences": seqs, "loss": {"kind": "ppo", "clip_low": 0.1, "clip_high": 0.28}}
    assert http.post("/v1/train_batch", json=body).status_code == 200
    assert fake.calls == ["train_batch"]
    (req,) = fake.requests
    assert req.loss.kind.value == "ppo"
    assert (req.loss.clip_low, req.loss.clip_high) == (0.1, 0.28)
    for got, sent in zip(req.sequences, seqs, strict=True):
        assert list(got.tokens) == sent["tokens"]
        assert list(got.advantages) == sent["advantages"]
        assert list(got.old_logprobs) == sent["old_logprobs"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            {"sequences": [{"tokens": [1, 2, 3]}], "loss": {"kind": "ppo"}},
            "sequences[0].advantages is required by the ppo loss",
        ),
        (
            {"sequences": [_rl(3)], "loss": {"kind": "ppo", "kl_coef": 0.1}},
            "sequences[0].ref_logprobs is required by the ppo loss with kl_coef > 0",
        ),
        (
            {"sequences": [_rl(3), {"tokens": [1, 2]}], "loss": {"kind": "cross_entropy"}},
            "sequences[1] carries no per-token loss inputs",
        ),
        ({"sequences": [_rl(3)], "loss": {"kind": "grpo"}}, "loss.kind:"),
        (
            {"sequences": [_rl(3)], "loss": {"kind": "stable_reinforce"}},
            "its objective is not published",
        ),
        ({"sequences": [_rl(3)], "loss": {"kind": "ppo", "clip_low": 2}}, "loss.clip_low:"),
        (
            {"sequences": [_rl(3, advantages=[1.0, "inf", 2.0])], "loss": {"kind": "ppo"}},
            "sequences[0].advantages: must be finite",
        ),
        (
            {"sequences": [_rl(3, sequence_ratio_mask=[0, 1])], "loss": {"kind": "gspo"}},
            "sequences[0].sequence_ratio_mask: has 2 entries but tokens has 3",
        ),
        (
            {
                "sequences": [
                    _rl(3, sequence_ratio_mask=[0, 1, 0]),
                    _rl(3, sequence_ratio_mask=[1, 0, 0]),  # position 0 predicts nothing
                ],
                "loss": {"kind": "gspo"},
            },
            "sequences[1].sequence_ratio_mask marks no token after the first",
        ),
        (
            {"sequences": [_rl(3, sequence_ratio_mask=[0, 1, 1])], "loss": {"kind": "ppo"}},
            "sequence_ratio_mask is read by the gspo loss only, not by ppo",
        ),
        (
            {
                "sequences": [_rl(3, sampler_logprobs=[-1.0] * 3)],
                "loss": {"kind": "gspo", "seq_tis_cap": -1},
            },
            "loss.seq_tis_cap:",
        ),
        (
            {"sequences": [_rl(3)], "loss": {"kind": "ppo", "geo_mask_high": 1.1}},
            "sequences[0].sampler_logprobs is required by the ppo loss",
        ),
    ],
)
def test_rl_loss_validation(http: TestClient, fake: FakeController, body: dict, words: str) -> None:
    """Each refusal's message says what is wrong, and its details name the field (never the
    whole body), as a client reading ``details`` finds it."""
    r = http.post("/v1/train_batch", json=body)
    assert r.status_code == 422 and words in r.json()["message"], r.json()
    details = r.json()["details"]
    field = details["field"] if isinstance(details, dict) else details[0]["field"]
    assert field != "body" and field in r.json()["message"], r.json()
    assert fake.calls == []


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/optim_step", {"lr": float("inf")}, "lr"),
        ("/v1/optim_step", {"lr": 1e-3, "eps": float("inf")}, "eps"),
        ("/v1/optim_step", {"lr": float("nan")}, "lr"),
        ("/v1/train_batch",
         {"sequences": [_rl(3)], "loss": {"kind": "ppo", "clip_high": float("inf")}},
         "loss.clip_high"),
    ],
)  # fmt: skip
def test_an_infinite_setting_is_refused_naming_it(
    http: TestClient, fake: FakeController, route: str, body: dict, field: str
) -> None:
    """JSON's Infinity and NaN reach the models as floats: a learning rate of infinity passes
    ``ge=0`` and would turn every weight to NaN. Each is a 422 naming the field, and nothing
    reaches the controller."""
    sent = json.dumps(body)  # Python's json writes Infinity and NaN, as many clients do
    r = http.post(route, content=sent, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["message"].startswith(f"{field}: "), r.json()
    assert "finite" in r.json()["message"], r.json()
    assert fake.calls == []


def test_bearer_auth_matrix(fake: FakeController, caplog: pytest.LogCaptureFixture) -> None:
    from trainctl.service.app import create_app

    with TestClient(create_app(fake, api_token="s3cret-token")) as http:
        _check_auth(http, fake)
    assert "s3cret" not in caplog.text


def _check_auth(http: TestClient, fake: FakeController) -> None:
    assert http.get("/v1/health").status_code == 200  # open
    assert http.get("/v1/ready").status_code == 200  # open
    r = http.post("/v1/train_batch", json=GOOD)
    assert r.status_code == 401 and r.json()["type"] == "unauthorized"
    r = http.post("/v1/train_batch", json=GOOD, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["type"] == "unauthorized"
    assert "s3cret" not in r.text and "wrong" not in r.text
    assert fake.calls == []
    r = http.post("/v1/train_batch", json=GOOD, headers={"authorization": "Bearer s3cret-token"})
    assert r.status_code == 200 and fake.calls == ["train_batch"]


# -- binary transport, operations, idempotency, profiles, metrics -----------------------------


def test_binary_body_and_answer_match_json(http: TestClient, fake: FakeController) -> None:
    from trainctl.api import wire

    body = wire.encode_sequences(GOOD["sequences"], {})
    headers = {"content-type": wire.CONTENT_TYPE, "accept": wire.CONTENT_TYPE}
    r = http.post("/v1/eval_batch", content=body, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == wire.CONTENT_TYPE
    fields, _ = wire.decode(r.content)
    assert fields == http.post("/v1/eval_batch", json=GOOD).json()
    bad = wire.encode_sequences([{"tokens": [1, 2, 100]}], {})
    r = http.post("/v1/eval_batch", content=bad, headers=headers)
    assert r.status_code == 422 and r.json()["message"].startswith("sequences[0].tokens[2]:")
    r = http.post("/v1/eval_batch", content=b"TCTB garbage", headers=headers)
    assert r.status_code == 422 and r.json()["type"] == "invalid_request"


def test_logprobs_binary_answer(http: TestClient) -> None:
    from trainctl.api import wire

    body = wire.encode_sequences([{"tokens": [1, 2, 3]}, {"tokens": [4]}], {"entropy": True})
    r = http.post(
        "/v1/logprobs",
        content=body,
        headers={"content-type": wire.CONTENT_TYPE, "accept": wire.CONTENT_TYPE},
    )
    assert r.status_code == 200, r.text
    fields, cols = wire.decode_per_sequence(r.content)
    assert [c.tolist() for c in cols["logprobs"]] == [
        pytest.approx([0.0, -0.02, -0.03]),
        [0.0],
    ]
    assert [len(c) for c in cols["entropy"]] == [3, 1] and fields == {"step": 0, "metrics": {}}


def test_oversize_and_unknown_media_type(fake: FakeController) -> None:
    from trainctl.service.app import create_app

    with TestClient(create_app(fake, max_body_bytes=50)) as http:
        r = http.post("/v1/train_batch", json={"sequences": [{"tokens": list(range(1, 15))}]})
        assert r.status_code == 413 and r.json()["type"] == "payload_too_large"
        r = http.post("/v1/train_batch", content=b"x", headers={"content-type": "text/csv"})
        assert r.status_code == 415 and "content-type 'text/csv'" in r.json()["message"]
    assert fake.calls == []


def test_retries_with_one_key_step_once(http: TestClient, fake: FakeController) -> None:
    headers = {"Idempotency-Key": "step-1"}
    bodies = [http.post("/v1/train_batch", json=GOOD, headers=headers).json() for _ in range(3)]
    assert bodies[0] == bodies[1] == bodies[2] and fake.step == 1
    other = {"sequences": [{"tokens": [1, 2]}]}
    r = http.post("/v1/train_batch", json=other, headers=headers)
    assert r.status_code == 409 and "different train_batch request" in r.json()["message"]


def test_expected_step_mismatch_is_409(http: TestClient, fake: FakeController) -> None:
    """The rule is ``TrainBatchRequest.check_expected_step``, which the controller calls."""
    r = http.post("/v1/train_batch", json={**GOOD, "expected_step": 3})
    assert r.status_code == 409 and fake.step == 0
    err = r.json()
    assert err["type"] == "conflict" and err["details"] == {"expected_step": 3, "step": 0}
    assert "nothing was applied" in err["message"]
    assert http.post("/v1/train_batch", json={**GOOD, "expected_step": 0}).status_code == 200
    assert http.post("/v1/train_batch", json={**GOOD, "expected_step": 0}).status_code == 409
    assert fake.step == 1


def test_respond_async_is_202_then_polled(http: TestClient, fake: FakeController) -> None:
    fake.delay_s = 0.2
    r = http.post("/v1/train_batch", json=GOOD, headers={"Prefer": "respond-async"})
    assert r.status_code == 202, r.text
    op = r.json()
    assert r.headers["location"] == f"/v1/operations/{op['id']}"
    assert op["status"] in ("queued", "running") and op["kind"] == "train_batch"
    done = http.get(r.headers["location"], params={"wait": 5}).json()
    assert done["status"] == "done" and done["result"]["step"] == 1
    missing = http.get("/v1/operations/op-nope")
    assert missing.status_code == 404 and missing.json()["type"] == "not_found"


def test_full_queue_is_429_with_retry_after(fake: FakeController) -> None:
    from trainctl.service.app import create_app

    fake.queue.max_queued = 1
    fake.delay_s = 0.3
    with TestClient(create_app(fake)) as http:
        prefer = {"Prefer": "respond-async"}
        codes = [
            http.post("/v1/eval_batch", json=GOOD, headers=prefer).status_code for _ in range(3)
        ]
        assert codes == [202, 202, 429]
        r = http.post("/v1/eval_batch", json=GOOD, headers=prefer)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["type"] == "rate_limited"


def test_profiles_list_and_download(http: TestClient) -> None:
    assert http.get("/v1/memory_profiles").json() == {"profiles": []}
    http.post("/v1/memory_profile/start")
    stop = http.post("/v1/memory_profile/stop").json()
    listed = http.get("/v1/memory_profiles").json()["profiles"]
    assert listed == [stop]
    f = stop["files"][0]
    r = http.get(f"/v1/memory_profiles/p1/files/{f['picture']}")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    r = http.get("/v1/memory_profiles/p1/files/other.json")
    assert r.status_code == 404 and r.json()["type"] == "not_found"


def test_every_error_uses_the_error_model(http: TestClient) -> None:
    for r in (http.get("/v1/nope"), http.delete("/v1/train_batch"), http.get("/nope")):
        assert r.status_code in (404, 405)
        assert set(r.json()) == {"type", "message", "details"}


def test_metrics_count_requests_errors_and_steps(http: TestClient) -> None:
    http.post("/v1/train_batch", json=GOOD)
    http.post("/v1/train_batch", json={"sequences": []})
    text = http.get("/metrics").text
    assert 'trainctl_http_requests_total{route="/v1/train_batch",status="200"} 1.0' in text
    assert 'trainctl_http_errors_total{type="invalid_request"} 1.0' in text
    assert "trainctl_steps_total 1.0" in text  # the (fake) controller's part
