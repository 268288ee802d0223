"""Fair shares between tenants, on one live service (``tenants_sampled``: three tenants and the
operator, so each party holds 16 sessions, 32 sampling clients, 8 parked requests and one
adapter). alice and bob train and sample through the real ``tinker`` SDK while carol floods
every table she can reach; carol meets her own share only. Then a finished session frees
its adapter slot, and a tenant deletes its own checkpoint through the SDK's own route.

The tests run in file order on one service; each says what it leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers import tenancy
from helpers.servicekit import Service
from helpers.tenancy import OPERATOR, post, settled, until

TOKENS = [5, 17, 3, 9, 22, 41, 7, 8]
PROBE = [{"tokens": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17, 33]}]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                        "weights": np.ones(len(tokens) - 1, np.float32)},
    )  # fmt: skip


class Run:
    """One tenant's LoRA run through the real SDK: a step, its state saved, a sampling
    client of its weights."""

    def __init__(self, svc: Service, tenant: str, state: str | None = None) -> None:
        self.tenant = tenant
        self.sc = tinker.ServiceClient(base_url=svc.url, api_key=f"tml-{tenancy.KEYS[tenant]}")
        if state is None:
            base = self.sc.get_server_capabilities().supported_models[0].model_name
            self.tc = self.sc.create_lora_training_client(base_model=base, rank=4).result()
            self.train()
            self.state = self.tc.save_state("final").result().path
        else:
            self.tc = self.sc.create_training_client_from_state(state).result()
            self.state = state
        self.model_id = self.tc.model_id
        self.session = self.model_id.split(":", 1)[0]
        self.adapter = f"{tenant}.{self.model_id.replace(':', '-')}"
        self.sampler = self.tc.save_weights_and_get_sampling_client().result()

    def train(self) -> int:
        self.tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        done = self.tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return int(done.metrics["step:max"])

    def sample(self) -> list[int]:
        prompt = types.ModelInput.from_ints(TOKENS[:4])
        params = types.SamplingParams(max_tokens=3, seed=1)
        r = self.sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
        return list(r.sequences[0].tokens)


@pytest.fixture(scope="module")
def runs(tenants_sampled: Service) -> Iterator[dict[str, Run]]:
    made = {t: Run(tenants_sampled, t) for t in ("alice", "bob")}
    yield made
    for r in made.values():
        r.sc.close("success").result()


def _operator(svc: Service) -> Any:
    return svc.client(api_token=OPERATOR)


def _steps(svc: Service) -> dict[str, int]:
    return {a.name: a.step for a in _operator(svc).list_adapters().adapters}


def _logprobs(svc: Service, adapter: str) -> np.ndarray:
    return np.asarray(_operator(svc).logprobs(PROBE, adapter=adapter).logprobs[0])


def _flood(call: Callable[[], httpx.Response], threads: int, each: int) -> list[httpx.Response]:
    """``call`` from ``threads`` threads at once, ``each`` times in each."""
    out: list[httpx.Response] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(each):
            r = call()
            with lock:
                out.append(r)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out


def test_a_tenant_flooding_every_table_meets_only_its_own_share(
    tenants_sampled: Service, runs: dict[str, Run]
) -> None:
    """carol floods sessions from 16 threads, makes sampling clients past her share, parks
    requests and asks for a second adapter: each is her own 429/409 naming her share, while
    alice's and bob's SDK runs answer every call, their adapters' steps and log-probs
    unchanged, and then train on. Leaves carol's session with her one LoRA model."""
    svc, url = tenants_sampled, tenants_sampled.url
    a, b = runs["alice"], runs["bob"]
    steps = _steps(svc)
    assert (steps[a.adapter], steps[b.adapter]) == (1, 1), steps
    before = {r.adapter: _logprobs(svc, r.adapter) for r in (a, b)}
    samples = {r.tenant: r.sample() for r in (a, b)}

    # carol: one session of her own with one LoRA model: her one adapter
    carol = post(url, "create_session", {}, "carol").json()["session_id"]
    base = a.sc.get_server_capabilities().supported_models[0].model_name
    lora = {"session_id": carol, "base_model": base, "lora_config": {"rank": 4}}
    made = settled(url, post(url, "create_model", {**lora, "model_seq_id": 0}, "carol").json(),
                   "carol")  # fmt: skip
    model = made["model_id"]

    # sessions, from 16 threads: 15 more fit her share of 16, the rest are her 429s
    flood = _flood(lambda: post(url, "create_session", {}, "carol"), threads=16, each=8)
    codes = [r.status_code for r in flood]
    assert (codes.count(200), codes.count(429)) == (15, 113), codes
    refusal = next(r.text for r in flood if r.status_code == 429)
    assert "tenant 'carol' holds 16 Tinker sessions" in refusal, refusal
    assert "share is 16 of --tinker-max-sessions 64 over 4 parties" in refusal, refusal

    # sampling clients past her share of 32: her own least recently used go, nobody else's
    for i in range(40):
        body = {"session_id": carol, "sampling_session_seq_id": i, "base_model": base}
        assert post(url, "create_sampling_session", body, "carol").status_code == 200
    prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:4]}]}

    def asample(sid: str) -> httpx.Response:
        body = {"sampling_session_id": sid, "prompt": prompt,
                "sampling_params": {"max_tokens": 2}}  # fmt: skip
        return post(url, "asample", body, "carol")

    assert asample(f"{carol}:sample:0").status_code == 404  # her oldest, evicted
    newest = asample(f"{carol}:sample:39")
    assert newest.status_code == 200 and "error" not in settled(url, newest.json(), "carol")

    # parked requests: 8 (her share) wait for seq_id 1, the next is a 429
    for seq in range(3, 11):
        r = post(url, "optim_step", {"model_id": model, "seq_id": seq}, "carol")
        assert r.status_code == 200, r.text
    r = post(url, "optim_step", {"model_id": model, "seq_id": 11}, "carol")
    assert r.status_code == 429, r.text
    assert "tenant 'carol' has 8 requests parked" in r.text
    assert "share is 8 of --tinker-max-parked 32 over 4 parties" in r.text

    # a second adapter: her quota is one (the SDK retries HTTP 409s, so the future says it)
    second = settled(url, post(url, "create_model", {**lora, "model_seq_id": 1}, "carol").json(),
                     "carol")  # fmt: skip
    assert second.get("category") == "user", second
    assert "tenant 'carol' holds 1 LoRA adapters" in second["error"], second
    assert "share is 1 of --max-adapters 4 over 4 parties" in second["error"], second

    # alice and bob: untouched, and still at work
    steps = _steps(svc)
    assert (steps[a.adapter], steps[b.adapter]) == (1, 1), steps
    for r in (a, b):
        assert np.abs(_logprobs(svc, r.adapter) - before[r.adapter]).max() == 0.0
        beat = post(url, "session_heartbeat", {"session_id": r.session}, r.tenant)
        assert beat.status_code == 200, beat.text
        assert r.sample() == samples[r.tenant]  # the same weights, the same seed
        assert r.train() == 2
    metrics = httpx.get(f"{url}/metrics", timeout=30, headers=_bearer()).text
    for line in (
        'trainctl_tenant_refusals_total{table="sessions",tenant="carol"} 113.0',
        'trainctl_tenant_refusals_total{table="parked",tenant="carol"} 1.0',
        'trainctl_tenant_refusals_total{table="adapters",tenant="carol"} 1.0',
        'trainctl_tenant_evictions_total{table="sampling_clients",tenant="carol"} 8.0',
    ):
        assert line in metrics, line
    assert 'tenant="alice"} ' not in metrics.split("trainctl_tenant_evictions_total", 1)[1]


def test_a_finished_session_frees_its_adapter_and_its_state_loads_again(
    tenants_sampled: Service, runs: dict[str, Run]
) -> None:
    """alice's ServiceClient closes (the SDK posts sessions/{id}/finish): her adapter slot is
    freed, her session and sampling client are gone (410), and a new session loads her saved
    state into her one slot again, with the weights she saved. Leaves alice on the new run."""
    svc, url = tenants_sampled, tenants_sampled.url
    a = runs["alice"]
    saved = a.tc.save_state("second").result().path
    trained = _logprobs(svc, a.adapter)
    a.sc.close("success").result()
    assert until(lambda: a.adapter not in _steps(svc)), _steps(svc)
    beat = post(url, "session_heartbeat", {"session_id": a.session}, "alice")
    assert beat.status_code == 410, beat.text
    r = post(url, "get_info", {"model_id": a.model_id}, "alice")
    assert r.status_code == 410 and "finished (success)" in r.text, r.text
    prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:4]}]}
    body = {"sampling_session_id": a.sampler._sampling_session_id, "prompt": prompt,
            "sampling_params": {"max_tokens": 2}}  # fmt: skip
    r = post(url, "asample", body, "alice")  # the SDK's closed client would not send it
    assert r.status_code == 410 and "which finished (success)" in r.text, r.text

    again = Run(svc, "alice", state=saved)
    runs["alice"] = again
    assert _steps(svc)[again.adapter] == 2
    assert np.abs(_logprobs(svc, again.adapter) - trained).max() == 0.0
    assert again.train() == 3


def test_a_tenant_deletes_its_own_checkpoint_and_no_other_tenant_can(
    tenants_sampled: Service, runs: dict[str, Run]
) -> None:
    """bob's delete of alice's saved state is a 404 and deletes nothing; alice's own delete
    (``RestClient.delete_checkpoint_from_tinker_path``) removes it, and her next
    ``load_state`` of it is a 404; her sampler weights likewise. Leaves both deleted."""
    svc = tenants_sampled
    a, b = runs["alice"], runs["bob"]
    owner = f"alice.{a.state.removeprefix('tinker://').split('/')[0].replace(':', '-')}"

    def names() -> list[str]:
        return [c.checkpoint_id for c in _operator(svc).list_checkpoints(owner).checkpoints]

    assert "second" in names()
    with pytest.raises(tinker.NotFoundError):
        b.sc.create_rest_client().delete_checkpoint_from_tinker_path(a.state).result()
    assert "second" in names()
    a.sc.create_rest_client().delete_checkpoint_from_tinker_path(a.state).result()
    assert "second" not in names()
    with pytest.raises(tinker.NotFoundError, match="no saved state 'second'"):
        a.tc.load_state(a.state).result()
    assert a.train() == 4  # the refused load passed its turn on

    # sampler weights (a Hugging Face export) go the same way, from disk
    export = a.tc.save_weights_for_sampler("shared").result().path
    on_disk = next(svc.data_dir.glob("exports/_owners/alice.*/shared"))
    with pytest.raises(tinker.NotFoundError):
        b.sc.create_rest_client().delete_checkpoint_from_tinker_path(export).result()
    assert on_disk.is_dir()
    a.sc.create_rest_client().delete_checkpoint_from_tinker_path(export).result()
    assert not on_disk.exists()


def _bearer() -> dict[str, str]:
    """The operator's: ``/metrics`` shows the tenants' names to it alone."""
    return {"Authorization": f"Bearer {OPERATOR}"}


def test_a_session_trace_export_holds_its_own_calls_and_no_other_tenants(
    tenants_sampled: Service, runs: dict[str, Run], tmp_path: Path
) -> None:
    """``tinker session export-trace`` (the real SDK's command) as alice writes a trace that
    Perfetto opens: her session's training and sampling on the gateway, the controller, the
    rank and the engine, and nothing of bob's, who trained meanwhile; bob's export of her
    session is refused. Leaves one more step on each."""
    svc = tenants_sampled
    a, b = runs["alice"], runs["bob"]
    for r in (a, b):
        r.train()
        r.sampler = r.tc.save_weights_and_get_sampling_client().result()  # of this step
        r.sample()
    tinker_cli = Path(sys.executable).parent / "tinker"

    def export(tenant: str, session: str, out: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "TINKER_BASE_URL": svc.url,
               "TINKER_API_KEY": f"tml-{tenancy.KEYS[tenant]}"}  # fmt: skip
        return subprocess.run(
            [str(tinker_cli), "session", "export-trace", session, "--output", str(out)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = export("alice", a.session, tmp_path / "alice.pftrace")
    assert done.returncode == 0, done.stdout + done.stderr
    trace = json.loads((tmp_path / "alice.pftrace").read_text())
    meta = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    rows = {e["pid"]: e["args"]["name"] for e in meta}
    events = [{**e, "row": rows[e["pid"]]} for e in trace["traceEvents"] if e["ph"] == "X"]
    seen = {(e["row"], e["name"]) for e in events}
    for row, name in [("gateway", "POST /api/v1/forward_backward"),
                      ("controller", "forward_backward"), ("controller", "optim_step"),
                      ("rank 0", "forward_backward"), ("rank 0", "optimizer"),
                      ("controller", "sample"), ("engine 0", "sample"),
                      ("engine 0", "decode")]:  # fmt: skip
        assert (row, name) in seen, (row, name, sorted(seen))
    tenants = {e["args"]["tenant"] for e in events if "tenant" in e["args"]}
    assert tenants == {"alice"}, tenants
    adapters = {e["args"]["adapter"] for e in events if "adapter" in e["args"]}
    assert adapters and all(x.startswith("alice.") for x in adapters), adapters
    assert b.session not in json.dumps(trace) and a.adapter in adapters

    refused = export("bob", a.session, tmp_path / "bob.pftrace")
    assert refused.returncode != 0 and not (tmp_path / "bob.pftrace").exists()
