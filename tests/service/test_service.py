"""The spine end to end: real `trainctl serve` (dp=2), real Ray Serve, real HTTP, the SDK.

Tests run in file order on one service; the reference comparisons run first, at step 0: the
layout checks of ``test_layouts.py`` at dp2 with prefix tries (the default packing), then the
service's first step.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from trainctl.clients import ConflictError, InvalidRequestError, TrainctlClient

from helpers import layout_checks
from helpers.batches import sft_batch
from helpers.servicekit import RAY_AUTH_VARS, SHARED_RING_SPANS, Service, Squatter, digest
from helpers.single_process import single_process


def test_started_as_on_a_fresh_machine(service: Service) -> None:
    """An empty HOME and no RAY_AUTH_* variables: trainctl made its own token, owner-only,
    under its data directory, ran Ray in token mode, and wrote nothing into HOME."""
    env = service.env
    assert all(env[k] is None for k in RAY_AUTH_VARS)
    token = service.data_dir / "ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert len(token.read_text().strip()) == 64
    assert not (Path(str(env["HOME"])) / ".ray").exists()
    assert f"Ray token authentication: token from {token.resolve()}" in service.log()
    # The head really runs in token mode: a driver with that token connects, one with another
    # token is refused.
    port = re.search(r"starting a local Ray head on port (\d+)", service.log())
    assert port is not None
    probe = f"import ray; ray.init(address='127.0.0.1:{port[1]}'); print(ray.is_initialized())"

    def connect(**auth: str) -> subprocess.CompletedProcess[str]:
        env_ = {"HOME": str(env["HOME"]), "PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "token"}
        return subprocess.run(
            [sys.executable, "-c", probe],
            env={**env_, **auth},
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = connect(RAY_AUTH_TOKEN_PATH=str(token))
    assert ok.returncode == 0 and ok.stdout.strip() == "True", ok.stderr[-2000:]
    refused = connect(RAY_AUTH_TOKEN="0" * 64)
    assert refused.returncode != 0 and "Failed to connect" in refused.stderr


def test_info_describes_the_dp2_service(service: Service) -> None:
    info = service.client().info()
    assert info.world_size == 2 and info.layout["dp"] == 2 and info.step == 0
    assert sorted(r.coords["dp"] for r in info.ranks) == [0, 1]
    # DP replicas hold identical weights.
    assert digest(info.ranks[0].weights_digest) == digest(info.ranks[1].weights_digest)
    assert info.versions["megatron-core"] == "0.16.1"


def test_eval_equals_single_process_reference(service: Service) -> None:
    client = service.client()
    assert client.info().step == 0, "this test needs the untrained model; it must run first"
    batch = sft_batch(seed=1)
    got = client.eval_batch(batch).loss
    want = single_process("eval", batch)["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_logprobs_at_dp2_match_a_single_process_computation(service: Service) -> None:
    layout_checks.logprobs_match_a_single_process_computation(service, "tree")


def test_the_first_step_at_dp2_matches_single_rank(service: Service) -> None:
    layout_checks.train_step_matches_single_rank(service, {"dp": 2}, "tree")


def test_a_request_chooses_its_packing(service: Service) -> None:
    layout_checks.a_request_chooses_its_packing(service)


ROUTED_TWICE = "sequences[0].routed_experts[1]"
BAD_BODIES = [
    ({"sequences": []}, "sequences"),
    ({"sequences": [{"tokens": [1, 2, 512]}]}, "sequences[0].tokens[2]"),
    ({"sequences": [{"tokens": [1, 2, 3], "loss_mask": [1, 1]}]}, "sequences[0].loss_mask"),
    ({"sequences": [{"tokens": ["x", 1]}]}, "sequences[0].tokens[0]"),
    ({"sequences": [{"tokens": list(range(2, 2000))}]}, "sequences[0].tokens"),
    ({"sequences": [{"tokens": [1, 2], "weights": [1.0, "nan"]}]}, "sequences[0].weights"),
    # token 1 routed twice through expert 3; then well-formed routes, but the model is dense
    ({"sequences": [{"tokens": [1, 2], "routed_experts": [[[0, 1]], [[3, 3]]]}]}, ROUTED_TWICE),
    ({"sequences": [{"tokens": [1, 2], "routed_experts": [[[0, 1]], [[2, 3]]]}]}, "routed_experts"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_input_is_rejected_and_changes_nothing(
    service: Service, body: dict, field: str
) -> None:
    client = service.client()
    before = client.info()
    r = httpx.post(f"{service.url}/v1/train_batch", json=body, timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["type"] == "invalid_request" and err["message"].startswith(f"{field}:"), err
    after = client.info()
    assert (after.step, digest(after.weights_digest)) == (
        before.step,
        digest(before.weights_digest),
    )


def test_sdk_raises_bad_request(service: Service) -> None:
    with pytest.raises(InvalidRequestError, match=r"sequences\[0\]\.tokens\[1\]"):
        service.client().train_batch([[1, 99999]])


def test_sampling_without_samplers_is_refused_saying_how_to_start_them(
    service: Service,
) -> None:
    with service.client() as tc:
        assert tc.info().samplers is None
        with pytest.raises(ConflictError, match="--samplers N"):
            tc.sample([[1, 2, 3]])
        with pytest.raises(ConflictError, match="--samplers N"):
            tc.sync_weights()


def test_five_train_batches_lower_the_loss(service: Service) -> None:
    client = service.client()
    batch = sft_batch(seed=2)
    start = client.info().step
    results = [client.train_batch(batch) for _ in range(5)]
    losses = [r.loss for r in results]
    assert [r.step for r in results] == list(range(start + 1, start + 6))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert client.eval_batch(batch).loss < losses[-1]
    r = results[-1]
    assert r.metrics["loss:mean"] == r.loss and r.metrics["grad_norm:value"] > 0
    assert r.metrics["tokens:sum"] == sum(len(s["tokens"]) for s in batch)
    assert {"plan_s", "total_s", "forward_backward_max_s", "optimizer_max_s"} <= set(r.timings)
    info = client.info()
    assert info.step == start + 5 and digest(info.ranks[0].weights_digest) == digest(
        info.ranks[1].weights_digest
    )


def test_memory_profile_round_trip(service: Service) -> None:
    client = service.client()
    started = client.start_memory_profile(max_entries=1000)
    client.train_batch(sft_batch(seed=4))
    result = client.stop_memory_profile()
    assert result.profile_id == started.profile_id
    assert sorted(f.rank for f in result.files) == [0, 1]
    directory = service.data_dir / "profiles" / result.profile_id
    for f in result.files:
        c = f.coords
        assert f.name == (
            f"snapshot_rank{f.rank:02d}_p{c['pp']}d{c['dp']}c{c['cp']}t{c['tp']}.trace.json"
        )
        path = directory / f.name
        assert path.stat().st_size == f.size_bytes > 0
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("name") == "[memory]" for e in events), "no allocation events recorded"
        # The same file and its picture, fetched over HTTP.
        assert client.download_profile_file(result.profile_id, f.name) == path.read_bytes()
        assert f.picture is not None
        png = client.download_profile_file(result.profile_id, f.picture)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    listed = {p.profile_id: p for p in client.list_memory_profiles().profiles}
    assert listed[result.profile_id] == result


@pytest.mark.parametrize(
    "path",
    [
        "/v1/memory_profiles/..%2F..%2F/files/serve.log",
        "/v1/memory_profiles/%2E%2E/files/serve.log",
        "/v1/memory_profiles/x/files/..%2F..%2Fserve.log",
        "/v1/memory_profiles/.hidden/files/a",
        "/v1/memory_profiles/x/files/%2Fetc%2Fpasswd",
    ],
)
def test_profile_paths_cannot_leave_the_profile_root(service: Service, path: str) -> None:
    r = httpx.get(service.url + path, timeout=30)
    assert r.status_code in (404, 422), (r.status_code, r.text[:200])
    assert set(r.json()) == {"type", "message", "details"}
    assert "drained" not in r.text and "INFO" not in r.text  # never the log file's content


# -- operations: idempotency, ordering, asynchronous calls, metrics -------------------------


def test_three_retries_with_one_key_step_once(service: Service) -> None:
    client = service.client()
    before = client.info()
    batch = sft_batch(seed=7)
    results = [client.train_batch(batch, idempotency_key="retry-me") for _ in range(3)]
    after = client.info()
    assert after.step == before.step + 1
    assert results[0] == results[1] == results[2]
    assert digest(after.weights_digest) != digest(before.weights_digest)
    # A further retry changes nothing either.
    client.train_batch(batch, idempotency_key="retry-me")
    assert digest(client.info().weights_digest) == digest(after.weights_digest)


def test_a_retry_while_the_first_call_runs_joins_it(service: Service) -> None:
    client = service.client()
    start = client.info().step
    batch = sft_batch(seed=8)
    first = client.submit("train_batch", batch, idempotency_key="in-flight")
    second = client.submit("train_batch", batch, idempotency_key="in-flight")
    assert second.id == first.id
    assert client.wait(second).step == start + 1 and client.info().step == start + 1


def test_eight_concurrent_callers_are_served_in_order(service: Service) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = service.client()
    start = client.info().step
    batch = sft_batch(seed=9)

    def call(_: int) -> int:
        with service.client() as c:
            return c.train_batch(batch).step

    with ThreadPoolExecutor(8) as pool:
        steps = list(pool.map(call, range(8)))
    assert sorted(steps) == list(range(start + 1, start + 9))
    assert client.info().step == start + 8


def test_respond_async_operation_is_polled_to_completion(service: Service) -> None:
    r = httpx.post(
        f"{service.url}/v1/train_batch",
        json={"sequences": sft_batch(seed=10)},
        headers={"Prefer": "respond-async"},
        timeout=60,
    )
    assert r.status_code == 202, r.text
    op = r.json()
    seen = {op["status"]}
    while op["status"] not in ("done", "failed"):
        op = httpx.get(service.url + r.headers["location"], timeout=60).json()
        seen.add(op["status"])
    assert op["status"] == "done", op
    assert op["result"]["step"] == service.client().info().step
    assert seen <= {"queued", "running", "done"}


def test_expected_step_guards_against_stale_updates(service: Service) -> None:
    client = service.client()
    step = client.info().step
    with pytest.raises(ConflictError, match=f"model is at step {step}"):
        client.train_batch(sft_batch(seed=11), expected_step=step - 1)
    assert client.info().step == step
    assert client.train_batch(sft_batch(seed=11), expected_step=step).step == step + 1


def test_split_step_parts_then_one_optim_step(service: Service) -> None:
    """forward_backward twice, then optim_step with the client's learning rate: one step,
    whose loss is the union's eval loss at the same weights; each part's log-probs are
    /v1/logprobs's; nothing else can step the model while parts wait, and a second
    optim_step finds nothing to apply."""
    client = service.client()
    a, b = sft_batch(seed=21), sft_batch(seed=22)
    with pytest.raises(ConflictError, match="call forward_backward first"):
        client.optim_step()
    step = client.info().step
    union = client.eval_batch(a + b).loss
    want = client.logprobs(a)
    first = client.forward_backward(a)
    assert first.step == step and first.metrics["accumulated_parts:value"] == 1
    for got, w in zip(first.logprobs, want.logprobs, strict=True):
        assert np.allclose(got, w, rtol=1e-6, atol=1e-6)
    # per-token losses: token-mean parts, so they sum to the part's loss times its tokens
    n_a = first.metrics["loss_tokens:sum"]
    assert abs(sum(map(sum, first.elementwise_loss)) / n_a - first.loss) <= 1e-5 * first.loss
    peek = client.forward_backward(b, forward_only=True)  # no gradients: the window is as is
    assert peek.metrics["accumulated_parts:value"] == 1
    eval_b = client.eval_batch(b).loss
    assert abs(peek.loss - eval_b) <= 1e-5 * abs(eval_b), (peek.loss, eval_b)
    with pytest.raises(ConflictError, match="waiting for optim_step"):
        client.train_batch(a)
    with pytest.raises(ConflictError, match="normalises one way"):
        client.forward_backward(b, {"normalization": "sum"})
    second = client.forward_backward(b)
    assert second.metrics["accumulated_parts:value"] == 2
    assert client.info().step == step  # nothing applied yet
    result = client.optim_step(lr=5e-4, clip_grad=1.0)
    assert result.step == step + 1 == client.info().step
    assert abs(result.loss - union) <= 1e-5 * abs(union), (result.loss, union)
    assert result.metrics["lr:value"] == 5e-4 and result.metrics["grad_norm:value"] > 0
    with pytest.raises(ConflictError, match="call forward_backward first"):
        client.optim_step()
    assert client.train_batch(a).step == step + 2  # the window is closed


def test_binary_and_json_give_the_same_eval(service: Service) -> None:
    batch = sft_batch(seed=12)
    with service.client() as binary, TrainctlClient(service.url, binary=False) as plain:
        assert binary.eval_batch(batch).loss == plain.eval_batch(batch).loss
        a, b = binary.logprobs(batch), plain.logprobs(batch)
        assert a.logprobs == b.logprobs  # float32 from the engine, either way


def test_metrics_report_steps_tokens_latency_and_errors(service: Service) -> None:
    client = service.client()
    text = client.metrics()
    step = client.info().step

    def value(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[-1])

    assert value("trainctl_steps_total") == step
    assert value("trainctl_queue_depth") == 0
    # Steps come from train_batch and from optim_step (the split step).
    stepping = value('trainctl_operation_seconds_count{kind="train_batch"}') + value(
        'trainctl_operation_seconds_count{kind="optim_step"}'
    )
    assert stepping >= step
    assert value('trainctl_http_errors_total{type="invalid_request"}') >= len(BAD_BODIES)
    assert value('trainctl_tokens_total{kind="train_batch"}') > 0
    # Computed tokens are counted beside them (fewer where tries shared prefixes).
    computed = value('trainctl_computed_tokens_total{kind="train_batch"}')
    assert 0 < computed <= value('trainctl_tokens_total{kind="train_batch"}')


def test_every_log_line_of_an_operation_carries_its_id(service: Service) -> None:
    op = service.client().submit("eval_batch", sft_batch(seed=13))
    service.client().wait(op)
    deadline = time.monotonic() + 30  # actor logs reach the driver's output in batches
    while True:
        lines = [ln for ln in service.log().splitlines() if op.id in ln]
        if any("eval_batch started" in ln for ln in lines) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any("eval_batch started" in ln for ln in lines), lines
    # Every worker line that names the operation carries its id in the tag - and there are such
    # lines, or the check below would pass on nothing.
    workers = [ln for ln in lines if "trainctl.workers" in ln]
    assert workers, lines
    assert all(f"[op={op.id}]" in ln for ln in workers), workers


def test_the_home_directory_is_left_empty(service: Service) -> None:
    """After start-up, training, memory profiles (whose pictures use matplotlib) and the rest of
    this module, the service has written nothing into its (fresh) home directory: its caches
    live under the data directory."""
    home = Path(str(service.env["HOME"]))
    assert service.client().list_memory_profiles().profiles, "a profile was rendered first"
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == []
    assert (service.data_dir / "cache" / "matplotlib").is_dir()


def test_a_port_that_is_not_its_own_ends_in_a_clear_error(service: Service, tmp_path: Path) -> None:
    from trainctl.local import LocalService

    squatter = Squatter()
    try:
        with TrainctlClient(f"http://127.0.0.1:{squatter.port}") as c:
            assert not c.is_ready()  # a 200 that is not trainctl's is not ready
        # A service whose port is taken stops at once, before Ray, with one line.
        taken = LocalService(tmp_path / "squatted", start_timeout_s=60)
        taken.port, taken.url = squatter.port, f"http://127.0.0.1:{squatter.port}"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{squatter.port}"):
            taken.start()
        assert time.monotonic() - t0 < 30
    finally:
        squatter.close()
    # A second service on the first one's port: the same one-line error, exit 2.
    r = subprocess.run(
        [sys.executable, "-m", "trainctl.service.cli", "serve", "--port", str(service.port),
         "--data-dir", str(tmp_path / "second")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{service.port}" in r.stderr
    # The running service answers as itself, and only as itself.
    with service.client() as c:
        assert c.is_ready(instance=service.instance)
        assert not c.is_ready(instance="someone-else")


def test_the_timeline_shows_one_step_on_the_gateway_the_controller_and_both_ranks(
    service: Service,
) -> None:
    """One train step, then ``trainctl``'s timeline: the gateway's request, the controller's
    operation with its queue wait and phases, and each rank's part of it, all carrying the
    operation's id and the trace the SDK's call started, on one clock, in a Chrome trace
    Perfetto opens."""
    with service.client() as tc:
        t0 = time.time()
        op = tc.submit("train_batch", [[1, 2, 3, 4, 5, 6]])
        sent = tc.last_trace_id
        step = tc.wait(op)
        trace = tc.timeline(since=t0 - 1)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rows = {
        e["args"]["name"]: e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert {"gateway", "controller", "rank 0", "rank 1"} <= set(rows), rows
    mine = [e for e in events if e["args"].get("op") == op.id]
    where = {(e["pid"], e["name"]) for e in mine}
    for row, name in [
        ("controller", "train_batch"),
        ("controller", "queued"),
        ("rank 0", "accumulate"),
        ("rank 1", "accumulate"),
        ("rank 0", "apply"),
    ]:
        assert (rows[row], name) in where, (row, name, sorted(where))
    assert sent is not None and op.trace_id == sent
    assert {e["args"]["trace_id"] for e in mine} == {sent}, "one call, one trace"
    run = next(e for e in mine if e["name"] == "train_batch")
    for e in mine:  # every part of the operation lies within it, on the gateway's clock
        if e["name"] != "queued":
            assert (
                run["ts"] - 50_000 <= e["ts"]
                and e["ts"] + e["dur"] <= run["ts"] + run["dur"] + 50_000
            ), e
    assert step.step >= 1 and json.loads(json.dumps(trace)) == trace  # plain JSON


def test_every_processs_ring_stays_at_its_bound_and_counts_what_it_dropped(
    service: Service,
) -> None:
    """A short run past the rings' bound (``--trace-spans 400`` on this service): no process
    holds more spans than its ring's size, the oldest went, and the drops are counted."""
    with service.client() as tc:
        for _ in range(60):  # each step leaves about 10 spans on each rank
            tc.train_batch([[1, 2, 3, 4, 5, 6]])
        trace = tc.timeline(since=time.time() - 3600)
    meta = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    rows = {e["pid"]: e["args"]["name"] for e in meta}
    held = Counter(rows[e["pid"]] for e in trace["traceEvents"] if e["ph"] == "X")
    assert {"gateway", "controller", "rank 0", "rank 1"} <= set(held), held
    assert max(held.values()) <= SHARED_RING_SPANS, held
    assert held["rank 0"] == SHARED_RING_SPANS, held  # full, its oldest spans dropped ...
    assert trace["otherData"]["dropped"] > 0  # ... and counted
