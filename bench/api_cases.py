"""Benchmark cases of the API: the wire format and the gateway's overhead (run by run.py).

Each function runs in a fresh process (``run.py --child``) and returns a dict of numbers.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainctl.api import ModelLimits, TrainBatchRequest, wire


def _rl_batch(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """Sequences as an RL controller sends them: tokens, a prompt mask and three float arrays."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_seqs):
        prompt = int(rng.integers(1, seq_len // 2))
        out.append(
            {
                "tokens": rng.integers(0, vocab, seq_len),
                "loss_mask": np.r_[np.zeros(prompt, np.uint8), np.ones(seq_len - prompt, np.uint8)],
                "advantages": rng.normal(size=seq_len).astype(np.float32),
                "old_logprobs": -rng.exponential(size=seq_len).astype(np.float32),
            }
        )
    return out


def _best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def wire_case(encoding: str, n_seqs: int, seq_len: int, repeats: int) -> dict[str, float]:
    """Encode + decode of one batch into the request model, JSON vs the binary frame.

    Encode starts from what a controller holds (numpy arrays per sequence); decode ends in a
    validated ``TrainBatchRequest`` whose sequences are numpy columns (vectorised checks of
    lengths, 0/1 masks, finite floats and dtypes; the model's vocabulary and length limits via
    ``check_limits``) - the work the gateway does per call before the batch travels on.
    """
    seqs = _rl_batch(n_seqs, seq_len, vocab=151_936)
    fields = {"loss": {"kind": "ppo"}}
    limits = ModelLimits(vocab_size=151_936, max_seq_len=seq_len)
    raw = sum(s["tokens"].size * 8 + s["loss_mask"].size + 8 * s["advantages"].size for s in seqs)

    if encoding == "json":

        def encode() -> bytes:
            body = {**fields, "sequences": [{k: v.tolist() for k, v in s.items()} for s in seqs]}
            return json.dumps(body).encode()

        def decode(body: bytes) -> Any:
            req = TrainBatchRequest.model_validate_json(body)
            req.check_limits(limits)
            return req

    else:
        compress = encoding == "binary+zlib"

        def encode() -> bytes:
            return wire.encode_sequences(seqs, fields, compress=compress)

        def decode(body: bytes) -> Any:
            req = TrainBatchRequest.model_validate(wire.decode_sequences(body))
            req.check_limits(limits)
            return req

    body = encode()
    t_enc = _best(encode, repeats)
    t_dec = _best(lambda: decode(body), repeats)
    return {
        "tokens": float(n_seqs * seq_len),
        "raw_MB": raw / 1e6,
        "body_MB": len(body) / 1e6,
        "encode_s": t_enc,
        "decode_s": t_dec,
    }


def direct_step_case(n_seqs: int, seq_len: int, steps: int) -> dict[str, float]:
    """``plan_step`` + ``EngineShard.train_batch`` in this process: no Ray, no HTTP."""
    import socket

    import torch
    import torch.distributed as dist

    from trainctl.workers.control.plan import plan_step
    from trainctl.workers.engine.config import EngineConfig, ParallelLayout
    from trainctl.workers.engine.shard import EngineShard

    torch.set_num_threads(1)  # as a rank actor runs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    eng = EngineShard(EngineConfig(layout=ParallelLayout(dp=1)))
    req = TrainBatchRequest.model_validate({"sequences": _plain(n_seqs, seq_len)})

    def step() -> None:
        plan = plan_step(list(req.sequences), eng.cfg)
        eng.train_batch(plan.microbatches[0], plan.loss)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times)}


def _plain(n_seqs: int, seq_len: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, 512, seq_len).tolist()} for _ in range(n_seqs)]


def gateway_case(n_seqs: int, seq_len: int, steps: int, trivial: int) -> dict[str, float]:
    """The same step through ``trainctl serve --dp=1`` (SDK, HTTP, Serve, controller, rank),
    plus latency percentiles of trivial calls."""
    from trainctl.local import LocalService

    batch = _plain(n_seqs, seq_len)
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalService(Path(tmp), "--dp=1", "--rank-num-cpus=1") as svc,
        svc.client() as c,
    ):
        c.train_batch(batch)  # warm-up
        times, engine = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            r = c.train_batch(batch)
            times.append(time.perf_counter() - t0)
            engine.append(r.timings["forward_backward_max_s"] + r.timings["optimizer_max_s"])
        health = _latencies(c.health, trivial)
        tiny = _latencies(lambda: c.eval_batch([[1, 2, 3]]), trivial)
    return {
        "step_s": statistics.median(times),
        "engine_s": statistics.median(engine),
        "outside_engine_s": statistics.median(t - e for t, e in zip(times, engine, strict=True)),
        "health_p50_ms": health[0],
        "health_p99_ms": health[1],
        "tiny_eval_p50_ms": tiny[0],
        "tiny_eval_p99_ms": tiny[1],
    }


def _latencies(fn: Any, n: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ms, n=100)
    return q[49], q[98]


def load_case(duration_s: float, clients: int, seed: int = 0) -> dict[str, Any]:
    """``clients`` threads, each calling train_batch, eval_batch and logprobs at random on a
    ``trainctl serve`` (embedded default, dp=2) for ``duration_s``; no client-side retries, so
    every error is counted."""
    import random
    import threading
    from collections import Counter, defaultdict

    from trainctl.clients import RetryPolicy, TrainctlClient, TrainctlError
    from trainctl.local import LocalService

    lat: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = 0.0

    def worker(i: int, url: str) -> None:
        rng = random.Random(seed + i)
        np_rng = np.random.default_rng(seed + i)
        with TrainctlClient(url, retry=RetryPolicy(max_retries=0)) as c:
            while time.monotonic() < deadline:
                kind = rng.choice(["train_batch", "eval_batch", "logprobs"])
                batch = [
                    {"tokens": np_rng.integers(0, 512, int(n)).tolist()}
                    for n in np_rng.integers(16, 256, 4)
                ]
                t0 = time.perf_counter()
                try:
                    getattr(c, kind)(batch)
                    key = kind
                except TrainctlError as e:
                    key = f"{e.status} {e.type.value}" if e.status else type(e).__name__
                dt = time.perf_counter() - t0
                with lock:
                    if key == kind:
                        lat[kind].append(dt)
                    else:
                        errors[key] += 1

    with tempfile.TemporaryDirectory() as tmp, LocalService(Path(tmp)) as svc:
        deadline = time.monotonic() + duration_s
        threads = [threading.Thread(target=worker, args=(i, svc.url)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with svc.client() as c:
            step = c.info().step
    out: dict[str, Any] = {
        "served": sum(len(v) for v in lat.values()),
        "errors": dict(errors),
        "errors_5xx": sum(n for k, n in errors.items() if k[:1] == "5"),
        "steps": step,
        "duration_s": duration_s,
    }
    for kind, v in lat.items():
        q = statistics.quantiles(v, n=100) if len(v) > 1 else [v[0]] * 99
        out[kind] = {
            "n": len(v),
            "p50_ms": q[49] * 1e3,
            "p95_ms": q[94] * 1e3,
            "p99_ms": q[98] * 1e3,
        }
    return out
