"""The chart's pieces beside the rank workers: the sampler worker group, and the ``helm test``
pod that checks readiness as trainctl (rendered offline, as in ``test_helm_chart.py``)."""

from __future__ import annotations

import json

from helpers.helm import docs, rayservice, serve_config


def test_helm_test_checks_readiness_as_trainctl() -> None:
    """`helm test` runs `trainctl ready` through the release's Service: a 200 from anything
    but a ready trainctl fails it (tests/unit/test_cli.py shows the squatter case)."""
    pods = [d for k, d in docs().items() if k.startswith("Pod/")]
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["trainctl", "--url", "http://t-trainctl:8000", "ready"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "t"  # the policy lets it in


def test_a_sampler_worker_group_is_kept_for_the_samplers() -> None:
    """``samplers.count`` pods, one engine and one GPU each, marked with the resource that
    keeps ranks off them (and sends each engine to one); the app args are serve settings."""
    from trainctl.service.launch import settings_from_args
    from trainctl.workers.sampler.spec import SAMPLER_NODE_RESOURCE

    plain = rayservice()
    assert [g["groupName"] for g in plain["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == [
        "gpu"
    ]
    assert "samplers" not in serve_config(plain)["applications"][0]["args"]

    rs = rayservice("--set", "samplers.count=3", "--set", "samplers.sync=manual")
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu", "samplers"}
    g = groups["samplers"]
    assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 3
    assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {SAMPLER_NODE_RESOURCE: 1}
    assert SAMPLER_NODE_RESOURCE not in json.dumps(groups["gpu"])
    (container,) = g["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    s = settings_from_args(serve_config(rs)["applications"][0]["args"])
    assert (s.samplers, s.sampler_sync, s.sampler_num_gpus) == (3, "manual", 1)
    assert s.max_staleness is None

    rs = rayservice("--set", "samplers.count=1", "--set", "samplers.sync=in_flight",
                    "--set", "samplers.maxStaleness=2")  # fmt: skip
    s = settings_from_args(serve_config(rs)["applications"][0]["args"])
    assert (s.sampler_sync, s.max_staleness) == ("in_flight", 2)
