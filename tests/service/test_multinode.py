"""A simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``: one raylet per node on
this machine, each with its own resources): the service joins it through its head, places
every tensor-parallel group on one node, and a train step equals the single-rank engine.

What it cannot show: a real network between the nodes, or real GPUs and NVLink. It does
show that the placement Ray is asked for is the one it gives, read back from each rank."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.batches import sft_shared_batch
from helpers.servicekit import Service, fresh_home, running_service
from helpers.single_process import close, single_process

SLOTS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head with no slots for ranks (it runs the gateway and controller) and two nodes of
    two slots each."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=SLOTS_PER_NODE)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _tp_groups(info: Any) -> dict[tuple[int, int, int], set[str]]:
    """The nodes of each TP group, keyed by its (dp, cp, pp) coordinates."""
    groups: dict[tuple[int, int, int], set[str]] = defaultdict(set)
    for r in info.ranks:
        c = r.coords
        assert r.node, r
        groups[(c["dp"], c["cp"], c["pp"])].add(r.node)
    return groups


def _placed_and_equal_to_one_rank(svc: Service) -> None:
    """Each TP group on one node, both nodes used, and a train step (taken here) equal to the
    single-rank engine's."""
    client = svc.client()
    groups = _tp_groups(client.info())
    assert len(groups) == 2 and all(len(nodes) == 1 for nodes in groups.values()), groups
    assert len({n for nodes in groups.values() for n in nodes}) == 2  # both nodes used
    batch = sft_shared_batch(seed=5)
    before = client.eval_batch(batch).loss
    step = client.train_batch(batch)
    want = single_process("step", batch)
    assert close(before, want["eval_before"]), (before, want)
    assert close(step.loss, want["loss"]), (step.loss, want)
    assert close(step.metrics["grad_norm:value"], want["grad_norm"]), (step.metrics, want)


def test_tp_groups_stay_on_a_node_and_a_step_equals_one_rank_at_tp2_pp2(
    cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two pipeline stages, one per node (tp2 x dp2 is the lost-node test's layout, checked
    the same way there)."""
    data = tmp_path_factory.mktemp("multinode")
    flags = ("--tp=2", "--pp=2", "--dp=1", "--rank-num-cpus=1", "--packing=flat")
    with running_service(data, f"--ray-address={cluster.address}", *flags) as svc:
        _placed_and_equal_to_one_rank(svc)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--tp=4", "--dp=1"), "tp=4: a tensor-parallel group must sit on one node, but the "
         f"largest node has {SLOTS_PER_NODE} rank slot(s)"),
        (("--tp=2", "--dp=3"), "6 ranks need 6 slots in whole tensor-parallel groups of 2, but "
         f"the cluster's nodes give {2 * SLOTS_PER_NODE}"),
    ],
)  # fmt: skip
def test_a_layout_the_nodes_cannot_hold_is_refused_at_start(
    cluster: Any, tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, ...], words: str
) -> None:
    data = tmp_path_factory.mktemp("unplaceable")
    engine = data / "engine.json"  # four KV heads, so that tp=4 is a valid model split
    engine.write_text(json.dumps({"model": {"num_query_groups": 4}}))
    svc = Service(
        data, f"--ray-address={cluster.address}", "--rank-num-cpus=1",
        f"--engine-config={engine}", *flags, start_timeout_s=120, env=fresh_home(data),
    )  # fmt: skip
    with pytest.raises(RuntimeError):
        svc.start()
    assert words in svc.log(), svc.log()[-2000:]


def test_a_lost_node_is_waited_for_and_a_retried_step_applies_once(
    cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tp2 x dp2 on two nodes, a checkpoint every step: placed as asked, and its first step
    equals one rank's. A node leaves: its ranks die, the service says it waits for the slots,
    and ``ready`` is false. A node joins: the ranks are
    placed again and the checkpoint restored. A train call made through all of this, retried
    by the SDK with one idempotency key, applies exactly once."""
    import threading

    from trainctl.clients import RetryPolicy

    data = tmp_path_factory.mktemp("node-loss")
    flags = ("--tp=2", "--dp=2", "--rank-num-cpus=1", "--packing=flat")
    # The per-rank format (the reshardable default is the other service tests'): its saves and
    # the recovery's load keep running end to end.
    flags += ("--checkpoint-every-steps=1", "--checkpoint-format=per_rank")
    with running_service(data, f"--ray-address={cluster.address}", *flags) as svc:
        _placed_and_equal_to_one_rank(svc)
        client = svc.client()
        batch = sft_shared_batch(seed=7)
        before = client.info()
        assert before.step == 1
        at_step_1 = client.eval_batch(batch).loss  # what the restored weights must give
        victim = next(n for n in cluster.worker_nodes if n.node_id[:12] in before.ranks[-1].node)
        cluster.remove_node(victim, allow_graceful=True)

        patient = svc.client(retry=RetryPolicy(max_retries=40, backoff_s=1, max_backoff_s=5))
        outcome: dict[str, Any] = {}

        def train() -> None:
            try:
                outcome["result"] = patient.train_batch(batch)
            except Exception as e:  # reported by the assertion below
                outcome["error"] = e

        caller = threading.Thread(target=train)
        caller.start()
        # The service notices the loss, and says what it waits for.
        waiting = ""
        for _ in range(120):
            ready = httpx.get(f"{svc.url}/v1/ready", timeout=10).status_code == 200
            if not ready:
                body = httpx.post(f"{svc.url}/v1/eval_batch", json={"sequences": batch}, timeout=30)
                if body.status_code == 503 and "waiting for the cluster" in body.text:
                    waiting = body.json()["message"]
                    break
            time.sleep(1)
        assert "4 ranks need 4 slots" in waiting and "give 2" in waiting, waiting
        cluster.add_node(num_cpus=SLOTS_PER_NODE)
        caller.join(timeout=300)
        assert not caller.is_alive() and "error" not in outcome, outcome
        after = client.info()
        assert outcome["result"].step == 2 == after.step  # restored step 1, then one step
        assert after.recovery is not None and after.recovery.restored_checkpoint == "step-000001"
        assert abs(outcome["result"].loss - at_step_1) <= 1e-5 * abs(at_step_1)
        assert {c.format for c in client.list_checkpoints().checkpoints} == {"per_rank"}
        assert len(_tp_groups(after)) == 2 and all(len(n) == 1 for n in _tp_groups(after).values())
