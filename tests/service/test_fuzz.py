"""Hostile input against the running service: the OpenAPI schema fuzzed by schemathesis.

Every operation gets schema-violating input (negative mode), and the read-only ones (plus
eval and log-probs, which change nothing) also get valid input: no 5xx, no hang, and the
weights checksum and step are the same before and after the whole run.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from trainctl.clients import ConflictError

from helpers.servicekit import Service, digest

MUTATING = r"train_batch|forward_backward|optim_step|checkpoints|export|memory_profile"


def _schemathesis(svc: Service, report: Path, *args: str) -> tuple[int, str, int]:
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{svc.url}/openapi.json",
        "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "7",
        "--request-timeout", "60", "--max-response-time", "60", "--workers", "1",
        "--phases", "examples,coverage,fuzzing", "--generation-database", "none",
        "--no-color", "--report", "ndjson", "--report-ndjson-path", str(report), *args,
    ]  # fmt: skip
    # In the test's own directory: schemathesis leaves a .schemathesis/ cache where it runs.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=report.parent)
    cases = 0  # test cases sent: each finished scenario records its cases
    for line in report.read_text().splitlines():
        event = json.loads(line)
        if "ScenarioFinished" in event:
            cases += len(event["ScenarioFinished"]["recorder"].get("cases", {}))
    return proc.returncode, proc.stdout[-6000:] + proc.stderr[-2000:], cases


def test_fuzzed_input_never_breaks_or_changes_the_service(service: Service, tmp_path: Path) -> None:
    before = service.client().info()
    rc_neg, out_neg, n_neg = _schemathesis(service, tmp_path / "neg.ndjson", "--mode", "negative")
    rc_pos, out_pos, n_pos = _schemathesis(
        service, tmp_path / "pos.ndjson", "--mode", "positive", "--exclude-path-regex", MUTATING
    )
    print(f"schemathesis: {n_neg} negative and {n_pos} positive cases")  # shown with -s / -rA
    # Negative generation can still produce a valid `memory_profile/start` (its body is
    # optional): stop any profile left recording so later tests start clean.
    with contextlib.suppress(ConflictError):
        service.client().stop_memory_profile()
    assert rc_neg == 0, out_neg
    assert rc_pos == 0, out_pos
    assert n_neg >= 100 and n_pos >= 20, (n_neg, n_pos)
    after = service.client().info()
    assert (
        digest(after.weights_digest) == digest(before.weights_digest) and after.step == before.step
    )
    assert service.client().is_ready()


HOSTILE = [
    ('{"sequences": [{"tokens": [1, 2], "weights": [NaN, 1.0]}]}', "sequences[0].weights"),
    (
        '{"sequences": [{"tokens": [1, 2], "advantages": [Infinity, 1.0]}]}',
        "sequences[0].advantages",
    ),
    ('{"sequences": [{"tokens": [1, 1180591620717411303424]}]}', "sequences[0].tokens[1]"),
    ('{"sequences": [{"tokens": [-5, 2]}]}', "sequences[0].tokens[0]"),
    ('{"sequences": [{"tokens": [1, 2, 3], "loss_mask": [1, 1]}]}', "sequences[0].loss_mask"),
    ('{"sequences": [{"tokens": [1, 2]}], "loss": {"kind": "ppo"}}', "sequences[0].advantages"),
    ('{"sequences": [{"tokens": [1, 2]}]', "body"),
    ("[]", "body"),
]


@pytest.mark.parametrize(("raw", "field"), HOSTILE)
def test_hostile_bodies_get_a_4xx_naming_the_field(service: Service, raw: str, field: str) -> None:
    before = service.client().info()
    for route in ("train_batch", "eval_batch", "logprobs"):
        r = httpx.post(
            f"{service.url}/v1/{route}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        if route == "logprobs" and field.endswith(("advantages", "loss_mask", "weights")):
            continue  # log-probs read only the tokens
        assert 400 <= r.status_code < 500, (route, r.status_code, r.text)
        body = r.json()
        assert body["type"] == "invalid_request" and field in body["message"], body
    assert digest(service.client().info().weights_digest) == digest(before.weights_digest)
    json.loads(json.dumps(before.model_dump(mode="json")))  # info stays serialisable
