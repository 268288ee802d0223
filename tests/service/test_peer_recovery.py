"""Recovery from live peers with the real service: a rank killed (SIGKILL) mid-step is
rebuilt from the surviving replica's memory, so no step is lost and no checkpoint is needed;
a rank killed after its update leaves the step applied exactly once. One service for the
module: dp=2 with a replicated optimizer (``--distributed-optimizer off``), no checkpoint on
disk unless a test makes one, fault injection on. Tests run in file order.

Each case first takes the *undisturbed* reference: the state is saved, the batch trained and
a probe evaluated, then the state is loaded back and the checkpoint deleted. The case then
kills a rank and checks that the retried step gives the reference's numbers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from trainctl.clients import NotReadyError, RetryPolicy, TrainctlClient

from helpers.batches import sft_batch
from helpers.servicekit import Service, digest, running_service

TOL = 1e-5


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data = tmp_path_factory.mktemp("peer_recovery")
    flags = ("--enable-fault-injection=true", "--distributed-optimizer=off")
    with running_service(data, *flags) as s:
        yield s


def client(s: Service, retries: bool = True) -> TrainctlClient:
    retry = None if retries else RetryPolicy(max_retries=0)
    return TrainctlClient(s.url, timeout=300, **({"retry": retry} if retry else {}))


def big_batch(seed: int) -> list[dict]:
    """Distinct sequences, enough for a kill to land mid-step (copies of one would share
    their prefixes, and tree packing would compute them once)."""
    return [s for k in range(100) for s in sft_batch(seed=seed + k)]


@dataclass(frozen=True)
class Reference:
    step: int
    digest: str
    loss: float
    grad_norm: float
    digest_after: str
    probe_after: float


def undisturbed(c: TrainctlClient, batch: list[dict], probe: list[dict]) -> Reference:
    """What ``batch`` does from the current state, with nothing killed: the step's loss and
    grad norm, the weights after it and a probe's loss there. The state is put back after
    (a checkpoint saved, loaded and deleted: none is left on disk)."""
    before = c.info()
    saved = c.save_checkpoint()
    stepped = c.train_batch(batch)
    after = c.info()
    probe_after = c.eval_batch(probe).loss
    c.load_checkpoint(saved.checkpoint_id)
    c.delete_checkpoint(saved.checkpoint_id)
    back = c.info()
    assert back.step == before.step and back.weights_digest == before.weights_digest
    assert c.list_checkpoints().checkpoints == []
    return Reference(
        step=before.step, digest=digest(before.weights_digest), loss=stepped.loss,
        grad_norm=stepped.metrics["grad_norm:value"],
        digest_after=digest(after.weights_digest), probe_after=probe_after,
    )  # fmt: skip


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def arm(svc: Service, **fault: object) -> None:
    r = httpx.post(f"{svc.url}/v1/debug/faults", json=fault)
    assert r.status_code == 200, r.text


def kill_mid_step(svc: Service, rank: int, batch: list[dict]) -> None:
    """``rank`` SIGKILLed while ``batch`` trains: the call fails retryable, nothing applied.
    The rank kills itself as its forward pass begins (an injected crash: SIGKILL, nothing
    cleaned up), while its peer works on: a kill from outside, timed by polling the
    operation, landed after both ranks had applied the update on a loaded CI machine (the
    step then stands, as the next test checks)."""
    c = client(svc)
    victim = c.info().ranks[rank].pid
    assert victim is not None
    arm(svc, rank=rank, phase="forward", kill=True)
    op = c.submit("train_batch", batch)
    final = c.operation(op.id, wait_s=60)
    assert final.status.value == "failed" and final.error is not None, final
    assert final.error.type.value == "not_ready" and "nothing was applied" in final.error.message
    c.wait_ready(timeout=180)
    assert all(rk.pid != victim for rk in c.info().ranks)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_is_rebuilt_from_its_peer_with_no_step_lost(svc: Service, rank: int) -> None:
    """Rank 1, then rank 0 (which held the group's rendezvous store): the survivor's memory
    rebuilds both ranks; the step, the weights and the next step are the undisturbed run's."""
    c = client(svc)
    c.train_batch(sft_batch(seed=rank + 40))  # AdamW moments that a lost copy would show
    batch, probe = big_batch(1000 + 100 * rank), sft_batch(seed=99)
    ref = undisturbed(c, batch, probe)
    kill_mid_step(svc, rank, batch)
    info = c.info()
    rec = info.recovery
    assert rec is not None and rec.source == "peer", rec
    assert rec.restored_checkpoint is None and rec.peer_fallback is None
    assert info.steps_lost == 0 and rec.step_after == rec.step_before == ref.step
    assert info.step == ref.step and digest(info.weights_digest) == ref.digest
    assert len({digest(rk.weights_digest) for rk in info.ranks}) == 1
    retried = c.train_batch(batch)  # the same batch again: the undisturbed step
    assert retried.step == ref.step + 1
    assert close(retried.loss, ref.loss), (retried.loss, ref.loss)
    assert close(retried.metrics["grad_norm:value"], ref.grad_norm)
    assert digest(c.info().weights_digest) == ref.digest_after
    assert close(c.eval_batch(probe).loss, ref.probe_after)


def test_a_rank_killed_after_its_update_leaves_the_step_applied_once(svc: Service) -> None:
    """Rank 1 dies between its optimizer update and its answer (where ZeRO-1 would publish):
    rank 0 applied the update too, so the step stands. The call answers its result after the
    rebuild, its idempotency key keeps it, and a retry applies nothing more."""
    c = client(svc)
    batch, probe = big_batch(3000), sft_batch(seed=98)
    ref = undisturbed(c, batch, probe)
    arm(svc, rank=1, phase="optimizer_end", kill=True)
    once = client(svc, retries=False)
    got = once.train_batch(batch, idempotency_key="exactly-once")
    assert got.step == ref.step + 1 and close(got.loss, ref.loss)
    assert any("the step stands" in w for w in got.warnings), got.warnings
    info = c.info()
    assert info.recovery is not None and info.recovery.source == "peer"
    assert info.recovery.step_before == ref.step and info.recovery.step_after == ref.step + 1
    assert info.steps_lost == 0 and info.step == ref.step + 1
    assert digest(info.weights_digest) == ref.digest_after
    again = once.train_batch(batch, idempotency_key="exactly-once")
    assert again.step == got.step and again.loss == got.loss
    assert c.info().step == ref.step + 1  # applied once
    assert close(c.eval_batch(probe).loss, ref.probe_after)


def test_survivors_that_disagree_fall_back_to_the_checkpoint(svc: Service) -> None:
    """Rank 1 fails before its update, rank 0 applies it: every rank is alive but they are at
    different steps, so the checkpoint is restored and the step counted lost."""
    c = client(svc)
    saved = c.save_checkpoint()
    c.train_batch(sft_batch(seed=51))  # a step after the checkpoint: it will be lost
    lost_before = c.info().steps_lost
    arm(svc, rank=1, phase="optimizer")
    with pytest.raises(NotReadyError, match=f"rebuilt from checkpoint {saved.checkpoint_id}"):
        client(svc, retries=False).train_batch(sft_batch(seed=52))
    info = c.info()
    rec = info.recovery
    assert rec is not None and rec.source == "checkpoint", rec
    assert rec.restored_checkpoint == saved.checkpoint_id
    assert rec.peer_fallback is not None and "disagree" in rec.peer_fallback
    assert info.step == saved.step and info.steps_lost == lost_before + 1
    assert digest(info.weights_digest) == digest(saved.weights_digest)
    assert c.train_batch(sft_batch(seed=52)).step == saved.step + 1
