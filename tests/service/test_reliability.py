"""Reliability and security with the real service: auth, checkpoints, failing and killed ranks,
Hugging Face export/import, and a checkpoint on SIGTERM. One service (dp=2, bearer token,
fault injection on) for the module; tests run in file order."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from trainctl.clients import (
    NotReadyError,
    RetryPolicy,
    ServerError,
    TrainctlClient,
)

from helpers.batches import sft_batch
from helpers.servicekit import Service, digest, running_service

TOKEN = "tok-" + "x" * 24


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("reliability")
    flags = ("--enable-fault-injection=true", "--checkpoint-on-exit=true", "--max-body-mb=2",
             "--metrics-log=tensorboard:tb")  # fmt: skip
    with running_service(data, *flags, env={"TRAINCTL_API_TOKEN": TOKEN}) as s:
        yield s
        final_step = client(s).info().step
    # After the SIGTERM (running_service checked the clean exit): a checkpoint of the last step.
    manifests = sorted((data / "checkpoints").glob("step-*/manifest.json"))
    assert json.loads(manifests[-1].read_text())["step"] == final_step
    assert TOKEN not in s.log()


def client(s: Service) -> TrainctlClient:
    return TrainctlClient(s.url, api_token=TOKEN, timeout=300)


def _copy_checkpoint(root: Path, src: str, dst: str, **manifest: object) -> Path:
    """Checkpoint ``src`` of the checkpoint directory ``root`` copied as ``dst``, saved after
    every other (the newest), with ``manifest``'s fields changed: what a damaged checkpoint
    looks like on disk."""
    import shutil

    shutil.copytree(root / src, root / dst)
    m = json.loads((root / dst / "manifest.json").read_text())
    newest = max(json.loads(p.read_text())["sequence"] for p in root.glob("*/manifest.json"))
    m |= {"checkpoint_id": dst, "sequence": newest + 1, **manifest}
    (root / dst / "manifest.json").write_text(json.dumps(m))
    return root / dst


def _rewrite(path: Path, change: Any, *, fix_digest: bool = False) -> None:
    """Rank file ``path`` loaded, changed by ``change(state)`` and saved again by hand;
    ``fix_digest``: its manifest entry made to match (only the content checks are left)."""
    import hashlib

    import torch

    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    if fix_digest:
        mpath = path.parent / "manifest.json"
        m = json.loads(mpath.read_text())
        data = path.read_bytes()
        m["files"][path.name] |= {
            "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        mpath.write_text(json.dumps(m))


def _first_piece(state: dict[str, Any]) -> dict[str, Any]:
    return next(iter(state["pieces"].values()))


def _arm_fault(svc: Service, *, rank: int, phase: str) -> TrainctlClient:
    """Make ``rank`` fail once in ``phase``; a client that does not retry, to see the error
    (the SDK would retry a 5xx by default)."""
    r = httpx.post(
        f"{svc.url}/v1/debug/faults",
        json={"rank": rank, "phase": phase},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return TrainctlClient(svc.url, api_token=TOKEN, retry=RetryPolicy(max_retries=0))


def test_auth_matrix(svc: Service) -> None:
    for path in ("/v1/health", "/v1/ready"):
        assert httpx.get(svc.url + path).status_code == 200
    r = httpx.get(svc.url + "/v1/info")
    assert r.status_code == 401 and r.json()["type"] == "unauthorized"
    r = httpx.get(svc.url + "/v1/info", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and TOKEN not in r.text and "wrong" not in r.text
    r = httpx.post(svc.url + "/v1/train_batch", json={"sequences": sft_batch(seed=1)})
    assert r.status_code == 401
    assert client(svc).info().step == 0


def test_step_metrics_are_written_to_tensorboard(svc: Service) -> None:
    """--metrics-log tensorboard:tb: each applied step's loss, read back with TensorBoard's
    own reader at the step the service reports."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = client(svc).train_batch(sft_batch(seed=5))
    deadline = time.monotonic() + 30
    while True:
        events = EventAccumulator(str(svc.data_dir / "tb"))
        events.Reload()
        if "train/loss" in events.Tags()["scalars"]:
            found = {e.step: e.value for e in events.Scalars("train/loss")}
            if result.step in found:
                break
        assert time.monotonic() < deadline, "no train/loss event for the step"
        time.sleep(0.5)
    assert abs(found[result.step] - result.loss) <= 1e-6 * abs(result.loss)
    assert "train/tokens_per_s" in events.Tags()["scalars"]


def test_an_oversize_body_is_413_and_changes_nothing(svc: Service) -> None:
    before = client(svc).info()
    body = json.dumps({"sequences": [{"tokens": [511] * 1000}] * 600}).encode()
    assert len(body) > 2 * 2**20  # the service runs with --max-body-mb=2
    r = httpx.post(
        f"{svc.url}/v1/train_batch",
        content=body,
        headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["type"] == "payload_too_large", r.text[:300]
    assert digest(client(svc).info().weights_digest) == digest(before.weights_digest)


def test_checkpoint_round_trip_is_bit_for_bit(svc: Service) -> None:
    c = client(svc)
    batch = sft_batch(seed=21)
    c.train_batch(batch)
    saved = c.save_checkpoint()
    assert saved.step == c.info().step and saved.checkpoint_id in {
        ck.checkpoint_id for ck in c.list_checkpoints().checkpoints
    }
    assert digest(saved.weights_digest) == digest(c.info().weights_digest)
    first = c.train_batch(batch)  # the step right after the checkpoint...
    c.train_batch(batch)
    assert digest(c.info().weights_digest) != digest(saved.weights_digest)
    loaded = c.load_checkpoint(saved.checkpoint_id)
    info = c.info()
    assert loaded.step == info.step == saved.step
    assert digest(info.weights_digest) == digest(saved.weights_digest)  # weights bit for bit
    again = c.train_batch(batch)  # ...is taken again identically: optimizer state restored
    assert (again.loss, again.metrics["grad_norm:value"]) == (
        first.loss,
        first.metrics["grad_norm:value"],
    )


def test_damaged_checkpoints_are_refused_naming_the_file_and_change_nothing(svc: Service) -> None:
    """The probe's five damages (issue 65, M7), each loaded at run time: a 409 naming the file
    and why; the service's step and weights stay as they were."""
    import shutil

    c = client(svc)
    c.train_batch(sft_batch(seed=41))
    a = c.save_checkpoint("pristine", overwrite=True)
    c.train_batch(sft_batch(seed=42))
    b = c.save_checkpoint("later", overwrite=True)
    c.train_batch(sft_batch(seed=43))
    before = c.info()
    ckpts = svc.data_dir / "checkpoints"
    nan = _copy_checkpoint(ckpts, "pristine", "bad-nan")  # NaN weights, saved by hand
    _rewrite(nan / "rank-00000.pt", lambda s: _first_piece(s)["param"].fill_(float("nan")))
    mixed = _copy_checkpoint(ckpts, "pristine", "bad-mixed")  # one file of the later save
    shutil.copy(svc.data_dir / "checkpoints" / "later" / "rank-00001.pt", mixed)
    foreign = _copy_checkpoint(ckpts, "pristine", "bad-foreign")  # ...with its digest too
    shutil.copy(svc.data_dir / "checkpoints" / "later" / "rank-00001.pt", foreign)
    m = json.loads((foreign / "manifest.json").read_text())
    m["files"]["rank-00001.pt"] = json.loads(
        (svc.data_dir / "checkpoints" / "later" / "manifest.json").read_text()
    )["files"]["rank-00001.pt"]
    (foreign / "manifest.json").write_text(json.dumps(m))
    _copy_checkpoint(ckpts, "pristine", "bad-step", step=999)  # a forged manifest step
    bare = _copy_checkpoint(ckpts, "pristine", "bad-moments")  # AdamW moments dropped
    drop = lambda s: [p.pop(k) for p in s["pieces"].values() for k in ("exp_avg", "exp_avg_sq")]  # noqa: E731
    _rewrite(bare / "rank-00000.pt", drop, fix_digest=True)
    expected = {
        "bad-nan": ("rank-00000.pt", "the save wrote"),
        "bad-mixed": ("rank-00001.pt", "the save wrote"),
        "bad-foreign": ("rank-00001.pt", f"belongs to save {b.save_id}"),
        "bad-step": ("rank-00000.pt", f"written at step {a.step}, the manifest says 999"),
        "bad-moments": ("rank-00000.pt", "AdamW moment tensors"),
    }
    headers = {"authorization": f"Bearer {TOKEN}"}
    for name, (file, why) in expected.items():
        r = httpx.post(f"{svc.url}/v1/checkpoints/{name}/load", json={}, headers=headers,
                       timeout=180)  # fmt: skip
        error = r.json()
        assert r.status_code == 409 and error["type"] == "conflict", (name, r.text)
        assert file in error["message"] and why in error["message"], (name, error)
        assert error["details"]["file"] == file, error
        info = c.info()
        assert info.step == before.step, name
        assert digest(info.weights_digest) == digest(before.weights_digest), name
    c.load_checkpoint("bad-moments", optimizer=False)  # no moments asked for: it loads
    assert c.info().step == a.step
    for name in expected:
        shutil.rmtree(svc.data_dir / "checkpoints" / name)


def test_a_failing_rank_applies_nothing_on_any_rank(svc: Service) -> None:
    c = client(svc)
    before = c.info()
    once = _arm_fault(svc, rank=1, phase="accumulate_end")
    with pytest.raises(ServerError) as e:
        once.train_batch(sft_batch(seed=22), idempotency_key="fault-1")
    assert e.value.status == 500 and e.value.type == "worker_error"
    assert "rank 1" in e.value.message and "injected fault" in e.value.message
    after = c.info()
    assert after.step == before.step
    assert [digest(rk.weights_digest) for rk in after.ranks] == [
        digest(rk.weights_digest) for rk in before.ranks
    ]
    # The failure applied nothing, so the same key may run again, and succeeds.
    assert c.train_batch(sft_batch(seed=22), idempotency_key="fault-1").step == before.step + 1


def test_a_forward_backward_part_failing_on_one_rank_is_taken_back_on_all(
    svc: Service,
) -> None:
    """Rank 1 fails the second part after its peers finished it: every rank takes the part
    back, so the window holds the first part only - the optim_step's loss is the first batch's
    eval loss at the same weights - and the part may be sent again."""
    c = client(svc)
    a, b = sft_batch(seed=31), sft_batch(seed=32)
    step = c.info().step
    want_a, want_ab = c.eval_batch(a).loss, c.eval_batch(a + b).loss
    c.forward_backward(a)
    once = _arm_fault(svc, rank=1, phase="forward_backward_end")
    with pytest.raises(ServerError, match="injected fault"):
        once.forward_backward(b)
    assert c.info().step == step
    only_a = c.optim_step(lr=0.0)  # lr 0: the weights stay, the window is emptied
    assert abs(only_a.loss - want_a) <= 1e-5 * abs(want_a), (only_a.loss, want_a)
    c.forward_backward(a)
    c.forward_backward(b)  # sent again, it counts
    both = c.optim_step(lr=0.0)
    assert abs(both.loss - want_ab) <= 1e-5 * abs(want_ab), (both.loss, want_ab)
    assert both.step == step + 2


def test_a_rank_failing_in_the_optimizer_update_rolls_back_to_the_checkpoint(
    svc: Service,
) -> None:
    """The service runs dp=2, so ZeRO-1 is on: the update is local to each rank's shard and
    the all-gather starts only once every rank updated. Rank 1 fails its update after rank 0
    has updated its shard: no rank waits in the all-gather (the error comes at once, not after
    the collective timeout), and the restore leaves both at the checkpoint."""
    c = client(svc)
    saved = c.save_checkpoint()
    stepped = c.train_batch(sft_batch(seed=27))
    assert "parameter_gather_max_s" in stepped.timings  # the ZeRO-1 path
    once = _arm_fault(svc, rank=1, phase="optimizer")
    t0 = time.monotonic()
    with pytest.raises(NotReadyError, match="rank 1 failed in apply"):
        once.train_batch(sft_batch(seed=28))
    # No wait for the collective timeout (120 s): the error comes once the group is rebuilt,
    # inside the call.
    assert time.monotonic() - t0 < 90
    c.wait_ready(timeout=180)
    info = c.info()
    # Rank 0 had applied the update, rank 1 had not: both are back at the checkpoint (ZeRO-1
    # keeps one copy of each optimizer range, so the survivors cannot stand in).
    assert info.recovery is not None and info.recovery.source == "checkpoint"
    assert info.recovery.peer_fallback is not None and "ZeRO-1" in info.recovery.peer_fallback
    assert info.step == saved.step and digest(info.weights_digest) == digest(saved.weights_digest)
    assert len({digest(rk.weights_digest) for rk in info.ranks}) == 1
    assert info.recovery is not None and info.recovery.step_before == saved.step + 1


def test_export_loads_in_transformers_and_imports_back(svc: Service, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    c = client(svc)
    batch = sft_batch(seed=23)
    exported = c.export_hf()
    assert set(exported.files) == {"config.json", "model.safetensors"}
    assert exported.path == f"exports/{exported.name}"  # no server path shown
    path = svc.data_dir / exported.path
    ours = c.logprobs(batch).logprobs
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        for seq, lp in zip(batch, ours, strict=True):
            ids = torch.tensor([seq["tokens"]])
            logits = model(ids).logits[0, :-1]
            ref = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            assert np.allclose(lp[1:], ref.numpy(), rtol=1e-4, atol=1e-4)
    want = c.eval_batch(batch).loss
    with running_service(tmp_path, "--dp=1", f"--init-hf={path}") as other:
        got = other.client().eval_batch(batch).loss
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_a_tp2_service_resumes_the_dp2_runs_checkpoint(svc: Service, tmp_path: Path) -> None:
    """The dp2 run's data dir (its checkpoint copied alone) opened by a tp2 service: it
    resumes at the saved step (the default resume: the latest that loads), and its next two
    steps and the log-probs after them equal the dp2 run's (issue 49)."""
    import shutil

    c = client(svc)
    c.train_batch(sft_batch(seed=31))
    saved = c.save_checkpoint("handoff", overwrite=True)
    assert saved.format == "reshardable" and saved.layout["dp"] == 2
    batches = [sft_batch(seed=32), sft_batch(seed=33)]
    want = [c.train_batch(b).loss for b in batches]
    want_lp = c.logprobs(sft_batch(seed=34)).logprobs
    shutil.copytree(svc.data_dir / "checkpoints" / "handoff", tmp_path / "checkpoints" / "handoff")
    # A newer checkpoint with a torn file: the start passes over it (issue 65, M8).
    torn = _copy_checkpoint(tmp_path / "checkpoints", "handoff", "torn")
    (torn / "rank-00001.pt").write_bytes((torn / "rank-00001.pt").read_bytes()[:4096])
    with running_service(tmp_path, "--dp=1", "--tp=2") as other:
        tc = other.client()
        info = tc.info()
        assert info.step == saved.step and info.layout["tp"] == 2 and info.layout["dp"] == 1
        assert info.resumed is not None and info.resumed.checkpoint_id == "handoff", info.resumed
        assert [k.checkpoint_id for k in info.resumed.skipped] == ["torn"], info.resumed
        assert "rank-00001.pt" in info.resumed.skipped[0].reason
        assert "passing over checkpoint torn" in other.log()
        got = [tc.train_batch(b).loss for b in batches]
        got_lp = tc.logprobs(sft_batch(seed=34)).logprobs
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    for g, w in zip(got_lp, want_lp, strict=True):
        assert np.allclose(g, w, rtol=1e-5, atol=1e-5), (g, w)


def test_a_killed_rank_is_replaced_and_the_latest_checkpoint_restored(svc: Service) -> None:
    """... the newest that proves its content: a newer damaged one is passed over once
    (issue 65, M8), never retried."""
    c = client(svc)
    saved = c.save_checkpoint()
    damaged = _copy_checkpoint(svc.data_dir / "checkpoints", saved.checkpoint_id, "damaged")
    _rewrite(damaged / "rank-00000.pt", lambda s: _first_piece(s)["param"].mul_(2))
    c.train_batch(sft_batch(seed=24))  # a step after the checkpoint: it will be lost
    victim = c.info().ranks[1].pid
    assert victim is not None
    # Rank 1 SIGKILLs itself as its forward pass begins (nothing cleaned up), while rank 0
    # works on. A kill from outside, timed by polling the operation, landed after the step
    # had finished on a loaded CI machine (the step was then "done").
    r = httpx.post(
        f"{svc.url}/v1/debug/faults",
        json={"rank": 1, "phase": "forward", "kill": True},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    t_kill = time.monotonic()
    op = c.submit("train_batch", [s for k in range(100) for s in sft_batch(seed=1000 + k)])
    final = c.operation(op.id, wait_s=60)
    waited = time.monotonic() - t_kill
    assert final.status.value == "failed" and final.error is not None, final
    assert final.error.type.value == "not_ready" and "nothing was applied" in final.error.message
    assert waited < 30, f"the failure took {waited:.0f}s to surface"
    # While the workers are rebuilt, calls get a retryable 503 with Retry-After.
    r = httpx.post(
        f"{svc.url}/v1/eval_batch",
        json={"sequences": sft_batch(seed=25)},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    c.wait_ready(timeout=180)
    info = c.info()
    assert info.recovery is not None and info.recovery.restored_checkpoint == saved.checkpoint_id
    assert info.recovery.source == "checkpoint" and "ZeRO-1" in (info.recovery.peer_fallback or "")
    assert [k.checkpoint_id for k in info.recovery.skipped] == ["damaged"], info.recovery
    assert "recovery failed" not in svc.log()  # restored at the first try: no retry loop
    assert info.step == saved.step and info.steps_lost >= 1
    assert digest(info.weights_digest) == digest(saved.weights_digest)
    assert all(rk.pid != victim for rk in info.ranks)
    assert c.train_batch(sft_batch(seed=26)).step == saved.step + 1
    import shutil

    shutil.rmtree(damaged)
