"""The Helm chart, offline: lint, render, validate every manifest against its schema (the
KubeRay RayService schema, Ray's own Serve schema, Kubernetes' schemas for built-in kinds), and
one test per values knob checking what it changes in the output."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.helm import (
    CHART,
    KUBE,
    ROOT,
    SCHEMA,
    docs,
    head,
    helm_binary,
    rayservice,
    render,
    serve_config,
    worker_group,
)


@pytest.mark.parametrize("values", [[], ["-f", str(CHART / "ci" / "ci-values.yaml")]])
def test_lint_and_every_manifest_validates(values: list[str]) -> None:
    lint = subprocess.run(
        [helm_binary(), "lint", str(CHART), *values], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    from ray.serve.schema import ServeDeploySchema

    schema = json.loads(SCHEMA.read_text())
    kinds = set()
    for d in docs(*values).values():
        kinds.add(d["kind"])
        if d["kind"] == "RayService":
            jsonschema.validate(d, schema)
            ServeDeploySchema.model_validate(serve_config(d))
        else:
            kubernetes_validate.validate(d, KUBE.rsplit(".", 1)[0], strict=True)
    assert {"RayService", "Service", "PersistentVolumeClaim", "Secret", "NetworkPolicy"} <= kinds


def test_the_rayservice_schema_rejects_a_broken_manifest() -> None:
    rs = rayservice()
    del worker_group(rs)["minReplicas"]
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(rs, json.loads(SCHEMA.read_text()))


def test_image() -> None:
    rs = rayservice("--set", "image.repository=reg.example/tc", "--set", "image.tag=1.2.3")
    assert head(rs)["containers"][0]["image"] == "reg.example/tc:1.2.3"
    assert worker_group(rs)["template"]["spec"]["containers"][0]["image"] == "reg.example/tc:1.2.3"


@pytest.mark.parametrize(
    ("layout", "per_pod", "pods"),
    [
        ({"dp": 1, "cp": 1, "tp": 1, "pp": 1}, 1, 1),
        ({"dp": 2, "cp": 2, "tp": 2, "pp": 1}, 4, 2),
        ({"dp": 1, "cp": 1, "tp": 4, "pp": 2}, 8, 1),
    ],
)
def test_layout_sizes_the_worker_group(layout: dict[str, int], per_pod: int, pods: int) -> None:
    sets = [f"layout.{k}={v}" for k, v in layout.items()] + [f"workers.gpusPerPod={per_pod}"]
    rs = rayservice(*[x for s in sets for x in ("--set", s)])
    group = worker_group(rs)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == per_pod
    app = serve_config(rs)["applications"][0]
    assert app["args"]["engine"]["layout"] == layout and app["args"]["rank_num_gpus"] == 1


def test_impossible_layout_fails_clearly() -> None:
    r = render("-f", str(CHART / "ci" / "impossible-layout.yaml"), check=False)
    assert r.returncode != 0
    assert "layout needs 6 GPUs (dp*cp*tp*pp), not a multiple of workers.gpusPerPod=4" in r.stderr
    r = render("--set", "layout.tp=0", check=False)
    assert r.returncode != 0 and "layout.tp: Must be greater than or equal to 1" in r.stderr


def test_model(tmp_path: Path) -> None:
    values = tmp_path / "model.yaml"  # a file: helm 3.6's --set turns floats into strings
    values.write_text("model: {seed: 7, engine: {optimizer: {lr: 0.0003}}}\n")
    app = serve_config(rayservice("-f", str(values)))["applications"][0]
    assert app["args"]["engine"]["model"]["seed"] == 7
    assert app["args"]["engine"]["optimizer"]["lr"] == 0.0003
    assert "init_hf" not in app["args"]
    app = serve_config(rayservice("--set", "model.checkpoint=/data/checkpoints/qwen"))
    assert app["applications"][0]["args"]["init_hf"] == "/data/checkpoints/qwen"


def test_checkpoint_schedule() -> None:
    args = serve_config(rayservice())["applications"][0]["args"]
    assert (args["checkpoint_every_steps"], args["keep_checkpoints"]) == (100, 3)
    assert args["data_dir"] == "/data/checkpoints"
    args = serve_config(
        rayservice("--set", "checkpoints.everySteps=10", "--set", "checkpoints.keep=5")
    )["applications"][0]["args"]
    assert (args["checkpoint_every_steps"], args["keep_checkpoints"]) == (10, 5)
    r = render("--set", "checkpoints.keep=0", check=False)
    assert r.returncode != 0 and "checkpoints.keep" in r.stderr


def test_resources_node_selectors_tolerations() -> None:
    rs = rayservice(
        "--set",
        "head.resources.limits.memory=99Gi",
        "--set",
        "workers.nodeSelector.gpu=h200",
        "--set",
        "head.nodeSelector.pool=cpu",
    )
    assert head(rs)["containers"][0]["resources"]["limits"]["memory"] == "99Gi"
    assert head(rs)["nodeSelector"] == {"pool": "cpu"}
    spec = worker_group(rs)["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h200"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nodeSelector" not in head(rayservice())


def _env(container: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in container.get("env", []) if e["name"] == name)


def test_secure_by_default_api_and_ray_tokens_generated() -> None:
    """The review's case: the chart bound 0.0.0.0 with no token, no Ray auth and no
    NetworkPolicy by default."""
    d = docs()
    token = base64.b64decode(d["Secret/t-trainctl-auth"]["data"]["token"]).decode()
    ray_token = base64.b64decode(d["Secret/t-trainctl-ray"]["data"]["token"]).decode()
    assert len(token) == 40 and len(ray_token) == 48 and token != ray_token
    assert token != base64.b64decode(docs()["Secret/t-trainctl-auth"]["data"]["token"]).decode()
    rs = d["RayService/t-trainctl"]
    ref = _env(head(rs)["containers"][0], "TRAINCTL_API_TOKEN")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "t-trainctl-auth", "key": "token"}
    for c in (head(rs)["containers"][0], worker_group(rs)["template"]["spec"]["containers"][0]):
        assert _env(c, "RAY_AUTH_MODE")["value"] == "token"
        ray_ref = _env(c, "RAY_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]
        assert ray_ref == {"name": "t-trainctl-ray", "key": "token"}
    policy = d["NetworkPolicy/t-trainctl"]["spec"]
    own, gateway, operator = policy["ingress"]
    assert own["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "t"
    assert gateway["ports"] == [{"port": 8000, "protocol": "TCP"}] and "from" not in gateway
    assert {p["port"] for p in operator["ports"]} == {8265, 52365}


def test_auth_secret_given_referenced_or_turned_off() -> None:
    created = docs("--set", "auth.token=s3cret")
    assert base64.b64decode(created["Secret/t-trainctl-auth"]["data"]["token"]) == b"s3cret"
    existing = docs("--set", "auth.existingSecret=mine")
    assert "Secret/t-trainctl-auth" not in existing
    rs = existing["RayService/t-trainctl"]
    ref = _env(head(rs)["containers"][0], "TRAINCTL_API_TOKEN")
    assert ref["valueFrom"]["secretKeyRef"]["name"] == "mine"
    off = docs("--set", "auth.enabled=false", "--set", "ray.tokenAuth=false",
               "--set", "networkPolicy.enabled=false")  # fmt: skip
    assert not any(k.startswith(("Secret/", "NetworkPolicy/")) for k in off)
    env = head(off["RayService/t-trainctl"])["containers"][0].get("env", [])
    assert not any(e["name"] in ("TRAINCTL_API_TOKEN", "RAY_AUTH_MODE") for e in env)


@pytest.mark.parametrize("volume", ["profiles", "checkpoints"])
def test_storage_volumes(volume: str) -> None:
    d = docs("--set", f"{volume}.size=5Gi", "--set", f"{volume}.storageClass=fast")
    pvc = d[f"PersistentVolumeClaim/t-trainctl-{volume}"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["spec"]["storageClassName"] == "fast"
    rs = next(x for k, x in d.items() if k.startswith("RayService/"))
    mounts = {m["name"]: m["mountPath"] for m in head(rs)["containers"][0]["volumeMounts"]}
    assert mounts[volume] == f"/data/{volume}"
    existing = docs("--set", f"{volume}.existingClaim=old")
    assert f"PersistentVolumeClaim/t-trainctl-{volume}" not in existing
    rs = next(x for k, x in existing.items() if k.startswith("RayService/"))
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in head(rs)["volumes"]}
    assert claims[volume] == "old"
    off = rayservice("--set", f"{volume}.enabled=false")
    assert volume not in {v["name"] for v in head(off).get("volumes") or []}


def test_profile_root_follows_the_mount() -> None:
    app = serve_config(rayservice("--set", "profiles.mountPath=/mnt/p"))["applications"][0]
    assert app["args"]["profile_root"] == "/mnt/p"


def test_ray_version_service_and_gateway() -> None:
    d = docs(
        "--set",
        "rayVersion=2.61.0",
        "--set",
        "service.type=LoadBalancer",
        "--set",
        "service.port=9000",
        "--set",
        "gateway.maxOngoingRequests=8",
        "--set",
        "gateway.tinker.maxSessions=64",
    )
    rs = next(x for k, x in d.items() if k.startswith("RayService/"))
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == "2.61.0"
    args = serve_config(rs)["applications"][0]["args"]
    assert args["max_ongoing_requests"] == 8
    assert (args["tinker_max_sessions"], args["tinker_max_sampling_clients"]) == (64, 4096)
    svc = d["Service/t-trainctl"]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["port"] == 9000
    assert svc["selector"]["trainctl.io/role"] == "head"


def test_serve_config_validates_against_ray() -> None:
    from ray.serve.schema import ServeDeploySchema

    from trainctl.workers.engine.config import EngineConfig

    cfg = yaml.safe_load((ROOT / "deploy" / "serve-config.yaml").read_text())
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "trainctl.service.deployment:app_builder"
    EngineConfig.from_dict(app["args"]["engine"]).validate()
    bad = {**cfg, "applications": [{**app, "name": "a"}, {**app, "name": "b"}]}
    with pytest.raises(ValueError, match="route_prefix"):  # two apps on one prefix
        ServeDeploySchema.model_validate(bad)


def test_the_serve_config_asks_for_a_token_where_its_proxy_is_reachable() -> None:
    """The shipped serve-config's proxy listens beyond loopback: its gateway takes a token."""
    from trainctl.service.launch import settings_from_args

    cfg = yaml.safe_load((ROOT / "deploy" / "serve-config.yaml").read_text())
    host = cfg["http_options"]["host"]
    s = settings_from_args(cfg["applications"][0]["args"]).model_copy(update={"host": host})
    assert s.exposure_warning() is None, s.exposure_warning()
    assert s.model_copy(update={"api_token_file": None}).exposure_warning() is not None


def test_dockerfile_runs_trainctl_entry_point() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["trainctl"]' in text and '"serve"' in text
    assert "serve run" not in text.split("#")[-1]


@pytest.mark.parametrize("source", ["chart", "serve-config"])
def test_application_args_are_serve_settings(source: str) -> None:
    """Both Serve configs speak the one settings model: every arg is a `trainctl serve`
    setting, and the engine config they give builds and validates."""
    from trainctl.service.launch import engine_config, settings_from_args

    if source == "chart":
        cfg = serve_config(rayservice("--set", "layout.tp=2", "--set", "workers.gpusPerPod=2"))
    else:
        cfg = yaml.safe_load((ROOT / "deploy" / "serve-config.yaml").read_text())
    args = cfg["applications"][0]["args"]
    s = settings_from_args(args)
    engine = engine_config(s).to_dict()
    assert engine["layout"] == {**engine["layout"], **args["engine"]["layout"]}
    if source == "chart":
        assert engine["layout"]["tp"] == 2 and s.rank_num_gpus == 1
    with pytest.raises(ValueError, match="unknown application args \\['data_root'\\]"):
        settings_from_args({**args, "data_root": "/x"})


def test_a_tp_group_wider_than_a_worker_pod_is_refused_by_the_schema() -> None:
    """Placement keeps each tensor-parallel group on one node (a worker pod); a pod whose
    GPUs are not a multiple of tp cannot hold whole groups."""
    ok = ("--set", "layout.tp=2", "--set", "layout.dp=2", "--set", "workers.gpusPerPod=4")
    assert worker_group(rayservice(*ok))["replicas"] == 1
    for tp, per_pod in ((4, 2), (2, 3)):
        world = per_pod * tp  # a multiple of both: only the TP rule can refuse it
        r = render(
            "--set", f"layout.tp={tp}", "--set", f"layout.dp={world // tp}",
            "--set", f"workers.gpusPerPod={per_pod}", check=False,
        )  # fmt: skip
        assert r.returncode != 0
        assert f"workers.gpusPerPod: Must be a multiple of {tp}" in r.stderr, r.stderr


def _exported_series() -> set[str]:
    """Every series name the gateway and the controller export once a step, a failure, a
    recovery and an HTTP error were observed (the real metric classes)."""
    import time as _time

    from trainctl.api import (
        ErrorBody,
        ErrorType,
        Operation,
        OperationKind,
        OperationStatus,
        StepResult,
    )
    from trainctl.service.metrics import GatewayMetrics
    from trainctl.workers.control.op_queue import Handle
    from trainctl.workers.control.telemetry import ControllerMetrics

    controller, gateway = ControllerMetrics(lambda: 0), GatewayMetrics()
    now = _time.time()
    step = StepResult(loss=1.0, step=1, metrics={"tokens:sum": 8.0, "computed_tokens:sum": 6.0,
                      "grad_norm:value": 0.5}, timings={"forward_backward_s": 0.1,
                      "optimizer_max_s": 0.01, "total_s": 0.2})  # fmt: skip
    for kind, status, result, error in [
        (OperationKind.TRAIN_BATCH, OperationStatus.DONE, step, None),
        (OperationKind.RECOVER, OperationStatus.DONE, None, None),
        (OperationKind.TRAIN_BATCH, OperationStatus.FAILED, None,
         ErrorBody(type=ErrorType.WORKER_ERROR, message="x")),
    ]:  # fmt: skip
        op = Operation(id="op", kind=kind, status=status, created_at=now, started_at=now,
                       finished_at=now, result=result, error=error)  # fmt: skip
        controller.observe(Handle(op=op, run=None, key=None, fingerprint=""))
    gateway.requests.labels("/v1/train_batch", "200").inc()
    gateway.latency.labels("/v1/train_batch").observe(0.1)
    gateway.errors.labels("invalid_request").inc()
    gateway.track_evictions({"tinker_sessions": 1})
    text = (controller.text() + gateway.text()).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line.startswith("trainctl_")}  # fmt: skip


def test_the_dashboard_charts_only_series_the_service_exports() -> None:
    import re

    d = docs()
    cm = d["ConfigMap/t-trainctl-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["trainctl.json"])
    titles = {p["title"] for p in dash["panels"]}
    for want in (
        "Loss",
        "Gradient norm",
        "Tokens per second",
        "Queue depth",
        "Recoveries",
        "Computed / total tokens (prefix sharing)",
        "Step latency by phase (median)",
    ):
        assert want in titles, titles
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in re.findall(r"\btrainctl_\w+", e)}
    exported = _exported_series()
    assert used and used <= exported, sorted(used - exported)
    assert {p["id"] for p in dash["panels"]} == set(range(1, len(dash["panels"]) + 1))
    assert "ServiceMonitor/t-trainctl" not in d
    monitor = docs("--set", "monitoring.serviceMonitor.enabled=true")["ServiceMonitor/t-trainctl"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    service = d["Service/t-trainctl"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()


def test_tenant_keys_are_mounted_from_a_secret_in_every_pod() -> None:
    """auth.apiKeysSecret: the Secret's `api-keys` is mounted in the head and every worker (a
    gateway replica may run on any of them), and the serve config's `api_keys` names it."""
    from trainctl.service.launch import settings_from_args

    rs = rayservice("--set", "auth.apiKeysSecret=tenants")
    args = serve_config(rs)["applications"][0]["args"]
    assert args["api_keys"] == "/etc/trainctl/keys/api-keys"
    assert settings_from_args(args).api_keys is not None
    worker = worker_group(rs)["template"]["spec"]
    for spec in (head(rs), worker):
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == "tenants"
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "api-keys", "mountPath": "/etc/trainctl/keys", "readOnly": True} in mounts
    plain = rayservice()
    assert "api_keys" not in serve_config(plain)["applications"][0]["args"]
    assert all(v["name"] != "api-keys" for v in head(plain).get("volumes") or [])
