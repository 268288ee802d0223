"""``--on-node-loss shrink`` on a simulated cluster: three nodes of one rank slot each, dp3.

A node leaves: the service comes back at once on dp2 (from the surviving ranks' state: no
step lost) instead of waiting, and a train call retried through the loss applies once; that
step equals a dp2 service's, loaded from the same state. The node comes back: after the next
checkpoint the service runs dp3 again, with ``steps_lost`` unchanged. A real Ray cluster
(``ray.cluster_utils.Cluster``: one raylet per node on this machine), real ranks, real HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.batches import sft_shared_batch
from helpers.servicekit import Service, running_service
from helpers.single_process import close

NODES = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head with no rank slot (it runs the gateway and the controller) and three nodes of
    one slot each."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(NODES):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


FLAGS = ("--rank-num-cpus=1", "--packing=flat", "--distributed-optimizer=off")
SAVES = ("--checkpoint-every-steps=1", "--keep-checkpoints=10")


def _dp(layout: dict[str, int]) -> int:
    return layout["dp"]


def _nodes(info: Any) -> set[str]:
    return {r.node for r in info.ranks}


def _wait_for(svc: Service, done: Any, what: str, timeout_s: float = 240) -> Any:
    client = svc.client()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = client.info()
            if done(info):
                return info
        except Exception:  # not ready while the ranks are rebuilt
            pass
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout_s:.0f}s:\n{svc.log()[-3000:]}")


def test_a_lost_node_shrinks_to_dp2_at_once_and_grows_back_after_a_checkpoint(
    cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from trainctl.clients import RetryPolicy

    data = tmp_path_factory.mktemp("shrink")
    batch = sft_shared_batch(seed=7)
    address = f"--ray-address={cluster.address}"
    with running_service(data, address, "--dp=3", "--on-node-loss=shrink", *FLAGS, *SAVES) as svc:
        client = svc.client()
        first = client.train_batch(batch)
        before = client.info()
        assert first.step == 1 == before.step and _dp(before.layout) == 3 == before.world_size
        assert len(_nodes(before)) == NODES and before.configured_layout == before.layout

        victim = next(n for n in cluster.worker_nodes if n.node_id[:12] in before.ranks[-1].node)
        cluster.remove_node(victim, allow_graceful=True)
        t_lost = time.monotonic()
        # The call in flight meets the dead rank (a 503, nothing applied); the SDK retries it
        # under the same idempotency key until the service is back.
        patient = svc.client(retry=RetryPolicy(max_retries=60, backoff_s=1, max_backoff_s=3))
        step2 = patient.train_batch(batch)
        back_s = time.monotonic() - t_lost
        shrunk = client.info()
        assert step2.step == 2 == shrunk.step, (step2.step, shrunk.step)  # applied once
        assert _dp(shrunk.layout) == 2 == shrunk.world_size and len(shrunk.ranks) == 2
        assert shrunk.configured_layout is not None and _dp(shrunk.configured_layout) == 3
        rec = shrunk.recovery
        assert rec is not None and rec.source == "peer" and rec.layout is not None
        assert _dp(rec.layout) == 2 and rec.step_after == 1 and shrunk.steps_lost == 0, rec
        assert "waiting for the cluster" not in svc.log()
        print(f"node lost -> the retried step answered at dp2: {back_s:.1f}s")

        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        third = client.train_batch(sft_shared_batch(seed=8))  # its checkpoint: then dp3
        assert third.step == 3
        grown = _wait_for(svc, lambda i: _dp(i.layout) == 3 and i.weights_digest, "dp3 again")
        assert grown.step == 3 and grown.steps_lost == 0 and len(_nodes(grown)) == NODES
        assert grown.recovery == rec  # a grow is no failure: the record stays the loss's
        assert client.train_batch(batch).step == 4  # and it trains on

    # The dp2 reference: a service of that layout, loaded from the same state (step 1).
    with running_service(data, address, "--dp=2", "--resume=step-000001", *FLAGS) as ref:
        want = ref.client().train_batch(batch)
    assert want.step == 2
    assert close(step2.loss, want.loss, 1e-5), (step2.loss, want.loss)
    got_norm, want_norm = step2.metrics["grad_norm:value"], want.metrics["grad_norm:value"]
    assert close(got_norm, want_norm, 1e-5), (got_norm, want_norm)
