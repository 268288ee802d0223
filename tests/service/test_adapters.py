"""LoRA adapters through a real service (`trainctl serve --dp=2 --max-adapters=9
--adapters-in-memory=1 --api-keys FILE`, with an operator token: ZeRO-1, and idle adapters
beyond one wait on disk): the native API and SDK, the exports read back by transformers and
PEFT, the real ``tinker`` SDK's default LoRA client, and tenants: each tenant's Tinker clients
see only the tenant's own sessions, models, futures, checkpoints and sampling paths, another
tenant's being a 404 on every Tinker route that takes one (the route list comes from the
app); the native API is the operator's; the keys file is read again when it changes. The
tests run in file order on one service; each says what it leaves."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from trainctl.api import ConflictError, InvalidRequestError, NotFoundError
from trainctl.service.auth import Access, access_of
from trainctl.service.tinker.state import native_name

from helpers import tenancy
from helpers.fakes import FakeController
from helpers.servicekit import Service, running_service
from helpers.tenancy import OPERATOR, until

BATCH_A = [{"tokens": [5, 17, 3, 9, 22, 41, 7, 8, 30, 2, 11] * 2}, {"tokens": [1, 2, 3, 4, 5]}]
BATCH_B = [{"tokens": [40, 41, 42, 43, 44, 45, 46, 47] * 3}]
PROBE = [{"tokens": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17, 33]}]


KEYS = {t: tenancy.KEYS[t] for t in ("alice", "bob")}
"""Two tenants (the operator's token is ``OPERATOR``)."""


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenant-keys") / "api-keys"
    path.write_text(tenancy.keys_text(KEYS))
    return path


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, keys_file: Path) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("adapters-data")
    # One idle adapter in host memory: the others wait on disk between their calls. Nine
    # slots: each of the two tenants (and the operator's Tinker models) may hold three.
    flags = (
        "--dp=2",
        "--max-adapters=9",
        "--lora-max-rank=32",
        "--lr=0.01",
        "--adapters-in-memory=1",
        f"--api-keys={keys_file}",
    )
    with running_service(data, *flags, env={"TRAINCTL_API_TOKEN": OPERATOR}) as s:
        yield s


def _client(svc: Service) -> Any:
    """The operator's SDK client (the service's own token)."""
    return svc.client(api_token=OPERATOR)


def _lp(svc: Service, adapter: str | None, batch: list[dict] = PROBE) -> np.ndarray:
    return np.asarray(_client(svc).logprobs(batch, adapter=adapter).logprobs[0])


def test_adapters_train_apart_and_the_base_never_moves(svc: Service) -> None:
    """Leaves adapters a (3 steps) and b (untrained)."""
    c = _client(svc)
    digest, base_loss = c.info().weights_digest, c.eval_batch(BATCH_A).loss
    a = c.create_adapter("a", rank=4, alpha=8.0, seed=1)
    b = c.create_adapter("b", rank=8, alpha=16.0, targets=["attn"], seed=2)
    assert (a.rank, a.step, b.targets) == (4, 0, ["attn"]) and a.bytes > 0
    # B starts at zero: a new adapter is the base.
    assert c.eval_batch(BATCH_A, adapter="a").loss == pytest.approx(base_loss, rel=1e-6)
    b_before = c.eval_batch(BATCH_A, adapter="b").loss
    losses = [c.train_batch(BATCH_A, adapter="a").loss for _ in range(3)]
    assert c.eval_batch(BATCH_A, adapter="a").loss < losses[0]
    assert c.eval_batch(BATCH_A, adapter="b").loss == b_before
    assert c.eval_batch(BATCH_A).loss == base_loss
    assert c.info().weights_digest == digest
    steps = {x.name: x.step for x in c.list_adapters().adapters}
    assert steps == {"a": 3, "b": 0}


def test_refusals_name_the_field_and_the_limit(svc: Service) -> None:
    c = _client(svc)
    with pytest.raises(NotFoundError, match=r"adapter 'nope' does not exist"):
        c.train_batch(BATCH_A, adapter="nope")
    with pytest.raises(InvalidRequestError, match=r"rank: 33 exceeds.*--lora-max-rank \(32\)"):
        c.create_adapter("big", rank=33)
    with pytest.raises(ConflictError, match="exists already"):
        c.create_adapter("a")
    with pytest.raises(InvalidRequestError, match="frozen base"):
        c.train_batch(BATCH_A)
    for name in "cdefghi":
        c.create_adapter(name)
    with pytest.raises(ConflictError, match=r"at most 9 \(--max-adapters\)"):
        c.create_adapter("j")
    for name in "cdefghi":
        c.delete_adapter(name)
    with pytest.raises(NotFoundError):
        c.delete_adapter("d")
    assert sorted(x.name for x in c.list_adapters().adapters) == ["a", "b"]


def test_exports_load_in_transformers_and_peft(svc: Service) -> None:
    """The PEFT adapter on the exported base, and the merged model, give the service's
    log-probs under the adapter."""
    import transformers
    from peft import PeftModel

    c = _client(svc)
    base = svc.data_dir / c.export_hf("base").path  # paths are relative to the data dir
    peft_dir = svc.data_dir / c.export_hf("a-peft", adapter="a").path
    merged_dir = svc.data_dir / c.export_hf("a-merged", adapter="a", merged=True).path
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in peft_dir.iterdir()
    }
    want = _lp(svc, "a")
    assert np.abs(want - _lp(svc, None)).max() > 1e-4  # the adapter changes the model

    def logprobs(model: Any) -> np.ndarray:
        ids = torch.tensor([PROBE[0]["tokens"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].numpy()

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    np.testing.assert_allclose(logprobs(PeftModel.from_pretrained(hf, peft_dir)), want[1:],
                               atol=1e-5)  # fmt: skip
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    np.testing.assert_allclose(logprobs(merged), want[1:], atol=1e-5)


def test_deleting_one_leaves_the_other(svc: Service) -> None:
    """Leaves only b."""
    c = _client(svc)
    before = _lp(svc, "b")
    c.delete_adapter("a")
    assert [x.name for x in c.list_adapters().adapters] == ["b"]
    np.testing.assert_array_equal(_lp(svc, "b"), before)


# -- the real tinker SDK's default client: LoRA ---------------------------------------------

BASE = "trainctl-tiny"


def _datum(tokens: list[int]) -> Any:
    x, y = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(x),
        loss_fn_inputs={"target_tokens": np.asarray(y, np.int64)},
    )


def _train(client: Any, data: list[Any], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        out = client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        lp = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
        losses.append(float(-lp.mean()))
    return losses


def _forward(client: Any, data: list[Any]) -> np.ndarray:
    out = client.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_tinker_lora_clients_train_their_own_adapters(svc: Service) -> None:
    """Two default LoRA clients (rank 32) train concurrently on different data; each one's
    forward equals a third client's with the first one's seed trained alone on its data, so
    nothing of the other leaked in. save_state then create_training_client_from_state_with_
    optimizer restores the saved adapter as the new client's own, and leaves the saver's."""
    sc = tinker.ServiceClient(base_url=svc.url, api_key=f"tml-{OPERATOR}")
    data1 = [_datum(BATCH_A[0]["tokens"]), _datum(BATCH_A[1]["tokens"])]
    data2 = [_datum(BATCH_B[0]["tokens"])]
    one = sc.create_lora_training_client(base_model=BASE, rank=32, seed=11).result()
    two = sc.create_lora_training_client(base_model=BASE, rank=32, seed=12).result()
    info = one.get_info()
    assert info.is_lora is True and info.lora_rank == 32
    losses: dict[str, list[float]] = {}
    threads = [
        threading.Thread(target=lambda k=k, cl=cl, d=d: losses.__setitem__(k, _train(cl, d, 5)))
        for k, cl, d in (("one", one, data1), ("two", two, data2))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert losses["one"][-1] < losses["one"][0] and losses["two"][-1] < losses["two"][0]
    alone = sc.create_lora_training_client(base_model=BASE, rank=32, seed=11).result()
    assert _train(alone, data1, 5) == pytest.approx(losses["one"], rel=1e-6)
    np.testing.assert_allclose(_forward(one, data1), _forward(alone, data1), rtol=1e-6)
    assert np.abs(_forward(one, data2) - _forward(two, data2)).max() > 1e-3

    _client(svc).delete_adapter(native_name(alone.model_id, None))  # room for the restored one
    saved = one.save_state("lora-one").result().path
    at_save = _forward(one, data1)
    _train(one, data1, 2)
    assert np.abs(_forward(one, data1) - at_save).max() > 1e-4
    back = sc.create_training_client_from_state_with_optimizer(saved).result()
    np.testing.assert_allclose(_forward(back, data1), at_save, rtol=1e-6)
    assert np.abs(_forward(one, data1) - at_save).max() > 1e-4  # a new adapter: one's own moved on
    # One adapter active, one idle in memory: the others wait on disk, on each rank.
    n = len(_client(svc).list_adapters().adapters)
    assert n >= 3
    for rank in ("rank-00000", "rank-00001"):
        assert len(list((svc.data_dir / "adapters" / rank).glob("*.pt"))) == n - 2, rank
    sc.close("success").result()


def _step(c: Any, name: str) -> int:
    return next(a.step for a in c.list_adapters().adapters if a.name == name)


def test_an_adapter_saved_alone_loads_alone_under_its_owner(svc: Service) -> None:
    """The native API: an adapter's checkpoint holds that adapter alone, under its owner's
    names; loading it restores that adapter and nothing else: the base, and another adapter
    with a split step open, are the same to the bit. Leaves only b."""
    c = _client(svc)
    for a in c.list_adapters().adapters:
        if a.name != "b":
            c.delete_adapter(a.name)
    c.create_adapter("p", rank=4, seed=3)
    for _ in range(2):
        c.train_batch(BATCH_A, adapter="p")
    digest, b_step = c.info().weights_digest, _step(c, "b")
    saved = c.save_checkpoint("mine", adapter="p", owner="alice")
    assert (saved.owner, saved.adapter, saved.step) == ("alice", "p", 2)
    theirs = c.save_checkpoint("mine", adapter="b", owner="bob")  # the same name, its own
    assert (theirs.owner, theirs.adapter) == ("bob", "b")
    assert [x.checkpoint_id for x in c.list_checkpoints(owner="alice").checkpoints] == ["mine"]
    assert "mine" not in {x.checkpoint_id for x in c.list_checkpoints().checkpoints}
    p_at = _lp(svc, "p")

    c.train_batch(BATCH_A, adapter="p")
    assert np.abs(_lp(svc, "p") - p_at).max() > 1e-4
    c.forward_backward(BATCH_B, adapter="b")  # b's split step, open across the load
    b_mid = _lp(svc, "b")
    loaded = c.load_checkpoint("mine", owner="alice", adapter="p")
    assert loaded.step == 2 and _step(c, "p") == 2
    assert np.abs(_lp(svc, "p") - p_at).max() == 0.0
    assert np.abs(_lp(svc, "b") - b_mid).max() == 0.0 and _step(c, "b") == b_step
    assert c.info().weights_digest == digest
    assert c.optim_step(adapter="b").step == b_step + 1  # its window survived the load

    c.load_checkpoint("mine", owner="alice", adapter="p", into="p2")  # a copy beside it
    assert np.abs(_lp(svc, "p2") - p_at).max() == 0.0 and _step(c, "p2") == 2
    with pytest.raises(InvalidRequestError, match="adapter='p'"):
        c.load_checkpoint("mine", owner="alice")  # an adapter's state is no whole state
    with pytest.raises(NotFoundError, match="'mine'"):
        c.load_checkpoint("mine")  # not one of the service's own names
    with pytest.raises(ConflictError, match="exists"):
        c.save_checkpoint("mine", adapter="p", owner="alice")
    for name in ("p", "p2"):
        c.delete_adapter(name)


# -- tenants (--api-keys) ---------------------------------------------------------------------

TOKENS = [5, 17, 3, 9, 22, 41, 7, 8]


def _post(svc: Service, route: str, body: Any, tenant: str | None, **kw: Any) -> httpx.Response:
    return tenancy.post(svc.url, route, body, tenant, **kw)


def _settled(svc: Service, future: dict[str, Any], tenant: str) -> dict[str, Any]:
    return tenancy.settled(svc.url, future, tenant)


class Run:
    """One tenant's LoRA run through the real SDK: one step, then `final` saved twice (the
    state and the sampler weights), as every recipe ends."""

    def __init__(self, svc: Service, tenant: str) -> None:
        self.sc = tinker.ServiceClient(base_url=svc.url, api_key=f"tml-{KEYS[tenant]}")
        name = self.sc.get_server_capabilities().supported_models[0].model_name
        self.tc = self.sc.create_lora_training_client(base_model=name, rank=4).result()
        self.tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        self.tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        self.state = self.tc.save_state("final").result().path
        self.sampler = self.tc.save_weights_for_sampler("final").result().path
        self.model_id = self.tc.model_id
        self.session = self.model_id.split(":", 1)[0]


@pytest.fixture(scope="module")
def runs(svc: Service) -> Iterator[dict[str, Run]]:
    made = {t: Run(svc, t) for t in KEYS}
    yield made
    for r in made.values():
        r.sc.close("success").result()


def _probes(a: Run, future: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Each Tinker route that takes an id: bodies that name alice's (route path -> probes)."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    fwd = types.ForwardBackwardInput(data=[_datum(TOKENS)], loss_fn="cross_entropy")
    req = types.ForwardBackwardRequest(forward_backward_input=fwd, model_id=a.model_id, seq_id=900)
    proto = forward_backward_request_to_proto(req).SerializeToString()
    model = {"model_id": a.model_id}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}
    return {
        "/api/v1/session_heartbeat": [("session_heartbeat", {"session_id": a.session})],
        "/api/v1/sessions/{session_id}/finish": [(f"sessions/{a.session}/finish", {})],
        "/api/v1/sessions/{session_id}/trace_export": [
            (f"sessions/{a.session}/trace_export", {"__get__": True})
        ],
        "/api/v1/create_model": [("create_model", {"session_id": a.session, "model_seq_id": 9,
                                                   "base_model": "trainctl-tiny"})],
        "/api/v1/get_info": [("get_info", model)],
        "/api/v1/forward_backward": [("forward_backward", {"__bytes__": proto})],
        "/api/v1/optim_step": [("optim_step", {**model, "seq_id": 901})],
        "/api/v1/save_weights": [("save_weights", {**model, "seq_id": 902, "path": "x"})],
        "/api/v1/save_weights_for_sampler": [
            ("save_weights_for_sampler", {**model, "seq_id": 903, "path": "y"})
        ],
        "/api/v1/load_weights": [
            ("load_weights", {**model, "seq_id": 904, "path": a.state, "optimizer": True})
        ],
        "/api/v1/retrieve_future": [("retrieve_future", {"request_id": future})],
        "/api/v1/training_runs/{run}/checkpoints/{checkpoint_id:path}": [
            (f"training_runs/{a.model_id}/checkpoints/weights/final", {"__delete__": True}),
            (f"training_runs/{a.model_id}/checkpoints/sampler_weights/final",
             {"__delete__": True}),
        ],
        "/api/v1/create_sampling_session": [
            ("create_sampling_session", {"session_id": a.session, "sampling_session_seq_id": 0,
                                         "model_path": a.sampler}),
        ],
        "/api/v1/samplers/{sampler_id}": [(f"samplers/{a.session}:sample:0", {"__get__": True})],
        "/api/v1/asample": [
            ("asample", {"model_path": a.sampler, "prompt": prompt, "sampling_params": {}}),
            ("asample", {"sampling_session_id": f"{a.session}:sample:0", "prompt": prompt,
                         "sampling_params": {}}),
        ],
    }  # fmt: skip


NAMES_NOTHING = {
    "/api/v1/client/config", "/api/v1/create_session", "/api/v1/get_server_capabilities",
    "/api/v1/telemetry",
}  # fmt: skip
"""The Tinker routes that take no id: nothing of another tenant's to name."""


def _send(svc: Service, route: str, body: dict[str, Any], tenant: str) -> httpx.Response:
    key = {"X-API-Key": f"tml-{KEYS[tenant]}"}
    if body.get("__get__"):
        return httpx.get(f"{svc.url}/api/v1/{route}", headers=key, timeout=60)
    if body.get("__delete__"):
        return httpx.delete(f"{svc.url}/api/v1/{route}", headers=key, timeout=60)
    if "__bytes__" in body:
        return httpx.post(f"{svc.url}/api/v1/{route}", content=body["__bytes__"], timeout=60,
                          headers={**key, "content-type": "application/x-protobuf"})  # fmt: skip
    return _post(svc, route, body, tenant)


def test_each_tenant_gets_404_for_the_others_on_every_tinker_route(
    svc: Service, runs: dict[str, Run]
) -> None:
    """Both tenants saved `final`; bob names alice's session, model, future, state and
    sampler path on every Tinker route that takes one: 404 each time, and alice's adapter
    has the step and log-probs it had. Her own calls still answer (the ids are real)."""
    a, b = runs["alice"], runs["bob"]
    made = _post(svc, "create_model", {"session_id": a.session, "model_seq_id": 7,
                                       "base_model": "trainctl-tiny",
                                       "lora_config": {"rank": 4}}, "alice").json()  # fmt: skip
    assert _settled(svc, made, "alice").get("model_id"), made
    routes = [r.path for r in create_app_routes() if access_of(r) is Access.TINKER]
    probes = _probes(a, made["request_id"])
    assert set(routes) == set(probes) | NAMES_NOTHING, set(routes) ^ (set(probes) | NAMES_NOTHING)

    operator = svc.client(api_token=OPERATOR)
    adapters = {x.name: x.step for x in operator.list_adapters().adapters}
    mine = f"alice.{a.model_id.replace(':', '-')}"
    assert adapters[mine] == 1 and adapters[f"bob.{b.model_id.replace(':', '-')}"] == 1
    before = np.asarray(operator.logprobs([{"tokens": TOKENS}], adapter=mine).logprobs[0])

    seen = []
    for route, bodies in probes.items():
        for path, body in bodies:
            r = _send(svc, path, body, "bob")
            seen.append(route)
            assert r.status_code == 404, (route, r.status_code, r.text)
    assert len(seen) >= len(probes)

    # bob's own model loading alice's path: her names are not in his space
    load = {"model_id": b.model_id, "seq_id": 5, "path": a.state, "optimizer": True}  # its next
    failed = _post(svc, "load_weights", load, "bob")
    assert failed.status_code == 404 and "no saved state 'final'" in failed.text, failed.text
    assert {x.name: x.step for x in operator.list_adapters().adapters}[mine] == 1
    after = np.asarray(operator.logprobs([{"tokens": TOKENS}], adapter=mine).logprobs[0])
    assert np.abs(after - before).max() == 0.0

    # alice's own: the same ids answer her
    assert _post(svc, "get_info", {"model_id": a.model_id}, "alice").status_code == 200
    assert _post(svc, "session_heartbeat", {"session_id": a.session}, "alice").status_code == 200
    own = _post(svc, "retrieve_future", {"request_id": made["request_id"]}, "alice")
    assert own.status_code == 200, own.text
    path_probe = {"session_id": a.session, "sampling_session_seq_id": 0, "model_path": a.sampler}
    no_samplers = _post(svc, "create_sampling_session", path_probe, "alice")
    assert no_samplers.status_code == 409 and "no samplers" in no_samplers.text
    back = a.sc.create_training_client_from_state_with_optimizer(a.state).result()
    assert back.get_info().is_lora


def create_app_routes() -> list[Any]:
    """The routes the gateway serves (the same app the service runs)."""
    from trainctl.service.app import create_app

    return list(create_app(FakeController()).routes)


def test_the_native_api_is_the_operators_and_counts_each_tenant(
    svc: Service, runs: dict[str, Run]
) -> None:
    bearer = {"Authorization": f"Bearer {KEYS['alice']}"}
    r = httpx.get(f"{svc.url}/v1/info", headers=bearer, timeout=30)
    assert r.status_code == 403 and "tenant key reaches the Tinker API" in r.text, r.text
    info = svc.client(api_token=OPERATOR).info()
    assert info.tenants is not None and set(info.tenants) == {"alice", "bob"}
    for usage in info.tenants.values():
        assert usage.requests > 5 and usage.bytes > 0 and usage.adapters >= 1
    operator = {"Authorization": f"Bearer {OPERATOR}"}
    metrics = httpx.get(f"{svc.url}/metrics", headers=operator, timeout=30).text
    assert 'trainctl_tenant_requests_total{tenant="alice"}' in metrics
    assert 'trainctl_tenant_adapters{tenant="bob"}' in metrics
    # Open to anyone (Prometheus scrapes it): the counts, under pseudonyms, not the names.
    scraped = httpx.get(f"{svc.url}/metrics", timeout=30).text
    assert "alice" not in scraped and "bob" not in scraped
    assert scraped.count('trainctl_tenant_requests_total{tenant="t-') == 2


def test_the_keys_file_is_read_again_when_it_changes_and_fails_closed(
    svc: Service, runs: dict[str, Run], keys_file: Path
) -> None:
    """bob's key removed and carol's added: bob is refused (401) and carol let in within
    seconds, no restart. A reload fails closed: beside a typo, carol's removal takes effect
    and alice stays; a comment-only, an empty and a deleted file each revoke every key, the
    first request more than a second after the change a 401. Leaves the file as it was."""

    def status(key: str) -> int:
        r = httpx.post(f"{svc.url}/api/v1/create_session", json={}, timeout=30,
                       headers={"X-API-Key": f"tml-{key}"})  # fmt: skip
        return r.status_code

    def changed(text: str | None) -> None:
        if text is None:
            keys_file.unlink()
        else:
            keys_file.write_text(text)
        time.sleep(1.1)  # the gateway looks at the file once a second at most

    carol = "carol-key-1234567890abcdef"
    try:
        keys_file.write_text(tenancy.keys_text({"alice": KEYS["alice"], "carol": carol}))
        assert until(lambda: status(KEYS["bob"]) == 401 and status(carol) == 200)
        changed(tenancy.keys_text({"alice": KEYS["alice"]}) + "dave only-one-field\n")
        assert (status(carol), status(KEYS["alice"])) == (401, 200)  # the typo grants nothing
        for text in ("# every tenant withdrawn\n", "", None):
            changed(tenancy.keys_text(KEYS))
            assert until(lambda: status(KEYS["alice"]) == 200)
            changed(text)
            assert (status(KEYS["alice"]), status(KEYS["bob"])) == (401, 401), repr(text)
        metrics = httpx.get(f"{svc.url}/metrics", timeout=30).text
        assert 'trainctl_api_keys_reloads_total{outcome="revoked"} 3.0' in metrics
        assert 'trainctl_api_keys_reloads_total{outcome="partial"} 1.0' in metrics
    finally:
        keys_file.write_text(tenancy.keys_text(KEYS))
    assert until(lambda: status(KEYS["bob"]) == 200)
