"""Hostile input, route by route, against a real service: every route the app serves (native
and Tinker, read from the app itself, so a new route is covered by default) gets every probe
that applies to it, and each ends in a 4xx, quickly, with nothing written outside the data
directory and the model unchanged.

The auth probes (no token, a wrong token, a ``tml-`` key on a native route) run on the same
route list in ``tests/unit/test_auth.py``; the bombs' memory bounds, one byte over the body
limit, the slow body and the overflowing frame shapes in ``tests/unit/test_hostile.py``; the
OpenAPI fuzz in ``test_fuzz.py``. This module adds what only the real service shows: the
answers of the whole stack, Serve's proxy included.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import zstandard

from trainctl.api import wire

from helpers.servicekit import Service, served_routes

AUTH = {"x-api-key": "tml-matrix"}
"""The session's service has no token: the native routes are open, Tinker's take any key."""
INFLATED = 300 << 20
"""What the bombs inflate to: more than the service's 256 MiB body limit."""
PROBE_S = 15.0
"""The most one probe may take, end to end."""

UNREAD_BODY = {
    ("POST", "/api/v1/telemetry"): "the SDK's telemetry: accepted and dropped, never read",
    ("POST", "/api/v1/client/config"): "answers the client's feature flags; reads no body",
    ("POST", "/api/v1/client/dynamic_config"): "the same, with no credential",
}
"""POST routes that do not read their body, so body probes cannot reach them."""
SKIPPED_PATHS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}

TRAVERSALS = {
    "dotdot": "..%2F..%2F..%2Fetc%2Fpasswd",
    "absolute": "%2Fetc%2Fpasswd",
    "nul": "name%00.txt",
    "long": "a" * 4096,
    "dot": "..",
}


def _routes() -> list[tuple[str, str]]:
    """The routes of the app the service runs (built here; listing needs no controller)."""
    from trainctl.service.app import create_app

    app = create_app(None)  # type: ignore[arg-type]
    return sorted(
        (m, p) for m, p, _ in served_routes(app)
        if p not in SKIPPED_PATHS and m in ("GET", "POST", "DELETE")
    )  # fmt: skip


@functools.cache
def _bombs() -> tuple[bytes, bytes]:
    """A binary frame whose zlib payload, and a zstd body, inflate past the body limit."""
    zeros = np.zeros(INFLATED // 8, np.int64)
    frame = wire.encode_sequences([{"tokens": zeros}], {}, compress=True)
    zstd = zstandard.ZstdCompressor().compress(zeros.tobytes())
    assert len(frame) < INFLATED // 256 and len(zstd) < INFLATED // 256
    return frame, zstd


def _files(root: Path, skip: Path) -> set[str]:
    return {
        str(p) for p in root.rglob("*")
        if skip not in p.parents and p != skip and p.is_file()
    }  # fmt: skip


def _send(svc: Service, method: str, path: str, **kw: object) -> httpx.Response:
    t0 = time.monotonic()
    r = httpx.request(method, svc.url + path, headers={**AUTH, **kw.pop("headers", {})},  # type: ignore[arg-type]
                      timeout=PROBE_S, **kw)  # type: ignore[arg-type]  # fmt: skip
    assert time.monotonic() - t0 < PROBE_S
    return r


def _probes(method: str, path: str) -> Iterator[tuple[str, str, dict[str, object]]]:
    """(name, concrete path, request arguments) of every probe that applies to the route."""
    params = re.findall(r"\{([^}]+)\}", path)
    for param in params:
        for name, value in TRAVERSALS.items():
            concrete = path
            for p in params:
                concrete = concrete.replace(f"{{{p}}}", value if p == param else "x")
            yield f"{param}={name}", concrete, {}
    if method != "POST" or (method, path) in UNREAD_BODY:
        return
    concrete = re.sub(r"\{[^}]+\}", "x", path)
    json_ct = {"content-type": "application/json"}
    yield "malformed-json", concrete, {"content": b'{"a": ', "headers": json_ct}
    yield "json-array", concrete, {"content": b"[1, 2, 3]", "headers": json_ct}
    frame = wire.encode_sequences([{"tokens": np.arange(8)}], {})
    lying = frame[:-8]  # the header promises 8 more bytes than come
    yield (
        "frame-shorter-than-its-header",
        concrete,
        {"content": lying, "headers": {"content-type": wire.CONTENT_TYPE}},
    )
    bomb, zstd_bomb = _bombs()
    yield (
        "zlib-bomb-frame",
        concrete,
        {"content": bomb, "headers": {"content-type": wire.CONTENT_TYPE}},
    )
    yield (
        "zstd-bomb",
        concrete,
        {
            "content": zstd_bomb,
            "headers": {"content-type": "application/x-protobuf", "content-encoding": "zstd"},
        },
    )


def test_every_route_refuses_every_hostile_probe_with_a_4xx(service: Service) -> None:
    hostile = service
    routes = _routes()
    assert len(routes) >= 40, routes  # native and Tinker
    root = hostile.data_dir.parent
    before = _files(root, hostile.data_dir)
    with hostile.client() as tc:
        step, digest = tc.info().step, tc.info().weights_digest
    answered: dict[tuple[str, str, str], int] = {}
    wrong = []
    for method, path in routes:
        for name, concrete, kw in _probes(method, path):
            r = _send(hostile, method, concrete, **kw)
            answered[(method, path, name)] = r.status_code
            if not 400 <= r.status_code < 500:
                wrong.append((method, concrete[:80], name, r.status_code, r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    probes = len(answered)
    print(f"{len(routes)} routes x their probes = {probes} hostile requests, all 4xx: "
          f"{sorted(set(answered.values()))}")  # fmt: skip
    assert probes >= 150
    with hostile.client() as tc:
        info = tc.info()
        assert (info.step, info.weights_digest) == (step, digest)
    assert _files(root, hostile.data_dir) == before, "a probe wrote outside the data directory"
    assert os.path.getsize("/etc/passwd") > 0


EDGES: dict[str, bytes] = {
    "inf": b"Infinity", "-inf": b"-Infinity", "nan": b"NaN", "1e308": b"1e308",
    "2^64": str(2**64).encode(), "2^70": str(2**70).encode(), "-1": b"-1",
    "-2^70": str(-(2**70)).encode(),
}  # fmt: skip
"""Numbers at the edges of what any field could take, as raw JSON (Python's json writes
Infinity and NaN; the review sent them)."""
VALID_EDGES = {("top_k", "-1")}
ASAMPLE = b'{"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "base_model": "m",'
"""(field, edge) pairs that are valid values: -1 is top-k off."""
SAMPLING_FIELDS = {
    # route, the JSON body around the field (FIELD is replaced), the field's path in the error
    ("/v1/sample", b'{"prompts": [[1, 2, 3]], "max_tokens": 4, "FIELD": EDGE}'): (
        "seed", "temperature", "top_p", "top_k", "n", "max_tokens", "expected_step",
    ),
    ("/api/v1/asample", ASAMPLE + b' "sampling_params": {"max_tokens": 4, "FIELD": EDGE}}'): (
        "seed", "temperature", "top_p", "top_k", "max_tokens",
    ),
    ("/api/v1/asample", ASAMPLE + b' "sampling_params": {"max_tokens": 4}, "FIELD": EDGE}'): (
        "num_samples",
    ),
    ("/v1/adapters", b'{"name": "edge", "rank": 8, "FIELD": EDGE}'): ("alpha", "seed", "rank"),
    ("/api/v1/create_model", b'{"session_id": "s", "model_seq_id": 0, "base_model": "m",'
                             b' "lora_config": {"rank": 8, "FIELD": EDGE}}'): ("seed", "rank"),
}  # fmt: skip


def test_every_sampling_and_adapter_field_refuses_its_edges_naming_the_field(
    service: Service,
) -> None:
    """inf, NaN, 1e308, 2^64, 2^70 and negatives in every sampling and adapter field, native
    and Tinker: each a 4xx naming the field (never a 500 from inside an engine), quickly."""
    wrong = []
    sent = 0
    for (path, template), fields in SAMPLING_FIELDS.items():
        for field in fields:
            for edge, raw in EDGES.items():
                if (field, edge) in VALID_EDGES:
                    continue
                body = template.replace(b"FIELD", field.encode()).replace(b"EDGE", raw)
                r = _send(service, "POST", path, content=body,
                          headers={"content-type": "application/json"})  # fmt: skip
                sent += 1
                if not (400 <= r.status_code < 500 and field in r.text):
                    wrong.append((path, field, edge, r.status_code, r.text[:160]))
    assert not wrong, "\n".join(map(str, wrong))
    assert sent >= 100, sent  # the table is not silently empty


LOOSE: dict[str, bytes] = {"string": b'"1"', "true": b"true", "float": b"1.0"}
"""What a lax parser reads as the integer 1; token ids and seeds refuse each (issue 65)."""
STRICT_FIELDS: list[tuple[str, bytes, str]] = [
    # route, the JSON body (V is replaced by each loose value), the field the error names
    ("/v1/sample", b'{"prompts": [[1, V]], "max_tokens": 4}', "prompts"),
    ("/v1/sample", b'{"prompts": [[1, 2]], "max_tokens": 4, "stop_token_ids": [V]}',
     "stop_token_ids"),
    ("/v1/sample", b'{"prompts": [[1, 2]], "max_tokens": 4, "seed": V}', "seed"),
    ("/v1/train_batch", b'{"sequences": [{"tokens": [1, V, 3]}]}', "tokens"),
    ("/v1/eval_batch", b'{"sequences": [{"tokens": [V, 2, 3]}]}', "tokens"),
    ("/v1/adapters", b'{"name": "strict", "rank": 8, "seed": V}', "seed"),
    ("/api/v1/asample", ASAMPLE + b' "sampling_params": {"max_tokens": 4, "seed": V}}', "seed"),
    ("/api/v1/create_model", b'{"session_id": "s", "model_seq_id": 0, "base_model": "m",'
                             b' "lora_config": {"rank": 8, "seed": V}}', "seed"),
]  # fmt: skip
TOP = str(2**64 - 1).encode()
BOUNDS: list[tuple[str, bytes, str]] = [
    # seed + n - 1 past 2^64 - 1: vLLM seeds child i with seed + i
    ("/v1/sample", b'{"prompts": [[1, 2]], "max_tokens": 4, "n": 2, "seed": ' + TOP + b"}",
     "seed"),
    ("/api/v1/asample", ASAMPLE + b' "sampling_params": {"max_tokens": 4, "seed": ' + TOP
     + b'}, "num_samples": 2}', "seed"),
    # past vLLM's own limit: refused here, not inside the engine
    ("/v1/sample", b'{"prompts": [[1, 2]], "max_tokens": 4, "temperature": 2.5}', "temperature"),
    ("/api/v1/asample", ASAMPLE + b' "sampling_params": {"max_tokens": 4, "temperature": 2.5}}',
     "temperature"),
    # integers past int64
    ("/v1/train_batch", b'{"sequences": [{"tokens": [1, 2, 3], "policy_step": '
     + str(2**63).encode() + b"}]}", "policy_step"),
    ("/v1/sample", b'{"prompts": [[1, 2]], "max_tokens": 4, "expected_step": '
     + str(2**63).encode() + b"}", "expected_step"),
    ("/v1/optim_step", b'{"expected_step": ' + str(2**63).encode() + b"}", "expected_step"),
    ("/api/v1/create_sampling_session", b'{"session_id": "s", "base_model": "m",'
     b' "sampling_session_seq_id": ' + str(2**63).encode() + b"}", "sampling_session_seq_id"),
    ("/api/v1/create_model", b'{"session_id": "s", "base_model": "m", "model_seq_id": '
     + str(2**63).encode() + b"}", "model_seq_id"),
]  # fmt: skip


def test_loose_integers_and_the_last_bounds_are_each_a_4xx_naming_the_field(
    service: Service,
) -> None:
    """Token ids and seeds sent as "1", true or 1.0, a seed whose children overflow, a
    temperature vLLM refuses and integers past int64 (issue 65, item 4): each a 4xx naming
    the field, native and Tinker, and the model unchanged."""
    tc = service.client()
    before = tc.info()
    wrong, sent = [], 0
    cases = [(p, t.replace(b"V", raw), f) for p, t, f in STRICT_FIELDS for raw in LOOSE.values()]
    for path, body, field in [*cases, *BOUNDS]:
        r = _send(service, "POST", path, content=body, headers={"content-type": "application/json"})
        sent += 1
        if not (400 <= r.status_code < 500 and field in r.text):
            wrong.append((path, body[:90], r.status_code, r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    assert sent == len(STRICT_FIELDS) * len(LOOSE) + len(BOUNDS)
    after = tc.info()
    assert (after.step, after.weights_digest) == (before.step, before.weights_digest)
