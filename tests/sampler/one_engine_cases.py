"""One vLLM sampler engine in a process of its own (``VllmSampler``, no Ray, no service),
driven through the ``SamplerEngine`` protocol: the cases of ``test_engine.py``, importable
by a spawned process."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def _hf_weights(seed: int) -> dict[str, Any]:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(concurrency: int = 64) -> Any:
    from trainctl.workers.sampler.vllm_backend.rules import env

    os.environ.update(env(False, 1))
    from trainctl.workers.sampler.spec import SamplerSpec
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    spec = SamplerSpec(hf_config=CONFIG, max_model_len=256, max_num_seqs=8, concurrency=concurrency)
    return VllmSampler(0, spec)


def jam_then_refused_load() -> dict[str, Any]:
    """A request that raises inside vLLM's step (a seed of 2^64, past the gateway's check),
    then a weight set with one tensor of the wrong shape: what each answered, and whether the
    engine still samples what it sampled before."""
    return asyncio.run(_jam_then_refused_load())


async def _jam_then_refused_load() -> dict[str, Any]:
    from trainctl.api import SampleRequest, TrainctlError
    from trainctl.workers.sampler.transport import LocalTransport

    engine = _engine()
    weights = _hf_weights(0)
    v1 = LocalTransport.ship(1, weights)
    await engine.load_weights(v1)
    ok = SampleRequest(prompts=[[1, 2, 3], [4, 5]], n=2, max_tokens=5, seed=5)
    ref = (await engine.sample("ref", ok, v1)).samples
    out: dict[str, Any] = {}
    bad = SampleRequest.model_construct(**{**ok.model_dump(), "seed": 2**64})
    try:
        await engine.sample("bad", bad, v1)
        out["bad_seed"] = "answered"
    except TrainctlError as e:
        out["bad_seed"] = (e.status, e.message)
    out["after_bad_seed"] = (await engine.sample("again", ok, v1)).samples == ref
    wrong = dict(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    wrong[name] = wrong[name][:, :-1].clone()
    try:
        await engine.load_weights(LocalTransport.ship(2, wrong))
        out["wrong_shape"] = "loaded"
    except TrainctlError as e:
        out["wrong_shape"] = (e.status, e.message)
    out["step_after_refusal"] = engine._engine.step
    out["after_refusal"] = (await engine.sample("after", ok, v1)).samples == ref
    v3 = LocalTransport.ship(3, _hf_weights(1))
    await engine.load_weights(v3)
    out["after_a_good_load"] = (await engine.sample("changed", ok, v3)).samples != ref
    # A request naming the version the engine no longer holds gets that version (a swap).
    back = await engine.sample("back", ok, v1)
    out["swapped_back"] = (back.step, back.samples == ref, engine._engine.step)
    return out


def aborts() -> dict[str, Any]:
    """The protocol's ordering: a request aborted while it waits for its turn is dropped, one
    running is stopped at the engine's next step (and the engine serves the next)."""
    return asyncio.run(_aborts())


async def _aborts() -> dict[str, Any]:
    from trainctl.api import SampleRequest, TrainctlError
    from trainctl.workers.sampler.transport import LocalTransport

    engine = _engine(concurrency=1)  # one at a time: the short request waits
    v1 = LocalTransport.ship(1, _hf_weights(0))
    await engine.load_weights(v1)
    long = SampleRequest(prompts=[[1, 2, 3]] * 8, n=4, max_tokens=200, seed=1)
    short = SampleRequest(prompts=[[4, 5]], max_tokens=3, seed=1)
    out: dict[str, Any] = {}
    running = asyncio.create_task(engine.sample("running", long, v1))
    await asyncio.sleep(0.2)
    queued = asyncio.create_task(engine.sample("queued", short, v1))
    await asyncio.sleep(0.05)
    out["abort_queued"] = await engine.abort("queued")
    t0 = time.monotonic()
    out["abort_running"] = await engine.abort("running")
    out["abort_unknown"] = await engine.abort("never-sent")
    for name, task in (("queued", queued), ("running", running)):
        try:
            await task
            out[name] = "answered"
        except TrainctlError as e:
            out[name] = (e.status, e.message)
        if name == "running":
            out["running_gone_after_s"] = time.monotonic() - t0
    out["after_abort"] = len((await engine.sample("after", short, v1)).samples)
    return out


def concurrent_equals_alone() -> dict[str, Any]:
    """16 requests at once on one engine (different prompts, seeds, ``n`` and lengths, prompt
    log-probs on), the first eight naming step 1's weights and the rest step 2's, then each alone:
    their tokens and log-probs, each token's step, and how many ran at once."""
    return asyncio.run(_concurrent_equals_alone())


async def _concurrent_equals_alone() -> dict[str, Any]:
    import numpy as np

    from trainctl.api import SampleRequest
    from trainctl.workers.sampler.transport import LocalTransport

    engine = _engine()
    v1 = LocalTransport.ship(1, _hf_weights(0))
    await engine.load_weights(v1)
    versions = [v1, LocalTransport.ship(2, _hf_weights(1))]  # two steps' weights, interleaved
    rng = np.random.default_rng(3)
    reqs = [
        SampleRequest(
            prompts=[rng.integers(0, 512, int(rng.integers(2, 12))).tolist() for _ in range(2)],
            n=1 + i % 3, max_tokens=4 + i % 7, seed=i, prompt_logprobs=True,
        )
        for i in range(16)
    ]  # fmt: skip
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(engine._turns.running))
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    together = await asyncio.gather(
        *(engine.sample(f"c{i}", r, versions[i // 8]) for i, r in enumerate(reqs))
    )
    watcher.cancel()
    alone = [await engine.sample(f"a{i}", r, versions[i // 8]) for i, r in enumerate(reqs)]

    def flat(res: Any) -> tuple[list[list[int]], list[float]]:
        tokens = [c.tokens for s in res.samples for c in s.completions]
        lps = [x for s in res.samples for c in s.completions for x in c.logprobs or []]
        lps += [x for s in res.samples for x in s.prompt_logprobs or [] if x is not None]
        return tokens, lps

    pairs = [(flat(t), flat(a)) for t, a in zip(together, alone, strict=True)]
    # Each token's step, from the engine's weight-version labels (set at each load).
    completions = [(r.step, c) for r in together for p in r.samples for c in p.completions]
    labelled = {(step, s) for step, c in completions for s in c.token_steps or [-1]}
    return {
        "peak": peak,
        "token_steps": sorted(labelled),
        "same_tokens": all(t[0] == a[0] for t, a in pairs),
        "steps": sorted({r.step for r in together}),
        "logprob_values": sum(len(a[1]) for _, a in pairs),
        "max_diff": max(
            (abs(x - y) for t, a in pairs for x, y in zip(t[1], a[1], strict=True)), default=None
        ),
    }


def collective_sync() -> dict[str, Any]:
    """An engine built with the ``gloo`` weight-transfer backend gets two versions over the
    collective (a sender thread broadcasting in buckets, the engine receiving through vLLM's
    own weight-sync sequence), each sampled against the same weights loaded through the
    shipment path (what a fresh engine is compared with in ``test_engine.py``); then a send
    that breaks half-way, and what the engine serves after it."""
    return asyncio.run(_collective_sync())


class _Sender:
    """The trainer's end of one generation's group, in a thread of this process: it joins
    the group on its first send and keeps it for the next ones (as a service would)."""

    def __init__(self, rv: Any) -> None:
        import socket

        from trainctl.workers import rendezvous

        self.rv, self.group = rv, None
        self.gate = rendezvous.Gate(socket.create_server((rv.host, rv.port)), rv.prefix)

    def send(self, weights: dict[str, Any], plan: Any, buckets: int | None = None) -> Any:
        """Broadcast ``plan``'s first ``buckets`` buckets (None: all) in a thread; with a
        number, the group is then torn down, as by a sender that died mid-send."""
        import threading

        from trainctl.workers.sampler import collective
        from trainctl.workers.sampler.stream import StreamPlan

        out: dict[str, Any] = {}
        first = StreamPlan(plan.owners, plan.buckets[:buckets])  # the same tags, fewer

        def run() -> None:
            try:
                if self.group is None:
                    self.group = collective.open_group(self.rv, 0, self.gate)
                out["sent"], _ = collective.send(
                    self.group.group, first, 0, [1], lambda p: weights[p.name]
                )
                if buckets is not None:  # the sender dies: its group and gate go
                    self.gate.close()
                    self.group = None
            except Exception as e:  # reported, not raised: the test reads it
                out["error"] = repr(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, out


def flat_result(result: Any) -> tuple[list[list[int]], list[float]]:
    """Every completion's tokens, and every prompt and completion log-prob, in order."""
    tokens, lps = [], []
    for p in result.samples:
        lps += [x for x in p.prompt_logprobs or [] if x is not None]
        for c in p.completions:
            tokens.append(c.tokens)
            lps += c.logprobs or []
    return tokens, lps


async def _collective_sync() -> dict[str, Any]:
    import socket

    from trainctl.api import SampleRequest, TrainctlError
    from trainctl.workers.sampler import collective
    from trainctl.workers.sampler.spec import SamplerSpec
    from trainctl.workers.sampler.stream import StreamPlan
    from trainctl.workers.sampler.transport import LocalTransport, Shipment, schema_of
    from trainctl.workers.sampler.vllm_backend.rules import env
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    os.environ.update(env(False, 1))
    spec = SamplerSpec(hf_config=CONFIG, max_model_len=256, max_num_seqs=8, weight_transfer="gloo")
    engine = VllmSampler(0, spec)
    req = SampleRequest(
        prompts=[[1, 2, 3], [4, 5, 6, 7]],
        n=2,
        max_tokens=6,
        seed=3,
        logprobs=True,
        prompt_logprobs=True,
    )

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    async def reference(step: int, weights: dict[str, Any]) -> Any:
        """The same weights through the shipment path, then back to ``step``'s collective
        version is not possible (a broadcast cannot be replayed): the caller re-syncs."""
        ship = LocalTransport.ship(step, weights)
        await engine.load_weights(ship)
        return await engine.sample(f"ref{step}", req, ship)

    out: dict[str, Any] = {}
    senders: dict[int, _Sender] = {}
    shipments: list[Any] = []
    # Two syncs on generation 1's group, one on generation 2's (the group re-formed).
    for generation, seed in ((1, 0), (1, 1), (2, 2)):
        if generation not in senders:
            rv = collective.Rendezvous.new("127.0.0.1", port(), 2, generation, timeout_s=20)
            senders[generation] = _Sender(rv)
        sender = senders[generation]
        weights = _hf_weights(seed)
        plan = StreamPlan.whole(schema_of(weights), 300 * 1024)  # several buckets
        shipment = Shipment("collective", seed + 1, None, 0, plan)
        shipments.append(shipment)
        t0 = time.perf_counter()
        thread, sent = sender.send(weights, plan)
        window = [x.id for x in shipments[-2:]]  # the pool's window of two versions
        loaded = await engine.load_weights(shipment, (sender.rv.to_dict(), 1), window)
        thread.join(30)
        seconds = time.perf_counter() - t0
        got = await engine.sample(f"c{seed}", req, shipment)
        ref = await reference(seed + 1, weights)
        (tokens, lps), (ref_tokens, ref_lps) = flat_result(got), flat_result(ref)
        out[f"v{seed}"] = {
            "buckets": len(plan.buckets),
            "sent": sent,
            "step": (loaded.step, got.step),
            "seconds": seconds,
            "same_tokens": tokens == ref_tokens,
            "logprobs": len(lps),
            "logprob_diff": max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)),
            "tokens": tokens,
            "logprob_values": lps,
        }
    # A client pinned to step 2 (received over the collective, replaced since): the engine
    # reloads the copy it kept; step 1 has left its two kept versions.
    pinned = flat_result(await engine.sample("pinned", req, shipments[1]))
    out["pinned_step_2"] = pinned == (out["v1"]["tokens"], out["v1"]["logprob_values"])
    try:
        await engine.sample("gone", req, shipments[0])
        out["pinned_step_1"] = "served"
    except TrainctlError as e:
        out["pinned_step_1"] = (e.status, e.message)
    # A sender that dies after one bucket: the receive fails, the weights served stay.
    served = LocalTransport.ship(3, _hf_weights(2))
    await engine.load_weights(served)
    before = flat_result(await engine.sample("before", req, served))
    weights = _hf_weights(3)
    plan = StreamPlan.whole(schema_of(weights), 300 * 1024)
    thread, sent = senders[2].send(weights, plan, buckets=1)
    try:
        await engine.load_weights(
            Shipment("collective", 4, None, 0, plan), (senders[2].rv.to_dict(), 1)
        )
        out["broken_send"] = "received"
    except TrainctlError as e:
        out["broken_send"] = (e.status, e.message)
    thread.join(30)
    after = flat_result(await engine.sample("after", req, served))
    out["after_broken_send"] = {"same": after == before, "step": engine._engine.step}
    return out


def fresh_engine_sample(export_dir: str, step: int, request: dict[str, Any]) -> Any:
    """A fresh engine built from an exported checkpoint's ``config.json`` (as the service
    builds its engines, placeholders first), loaded with its ``model.safetensors`` in memory,
    then ``request`` sampled: what a sampler on those weights answers, as ``flat_result`` has it."""
    from pathlib import Path

    from safetensors.torch import load_file

    from trainctl.api import SampleRequest
    from trainctl.workers.sampler.transport import LocalTransport
    from trainctl.workers.sampler.vllm_backend.rules import env

    os.environ.update(env(False, 1))
    import json

    from trainctl.workers.sampler.spec import SamplerSpec
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    config = json.loads(Path(export_dir, "config.json").read_text())
    weights = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        weights |= load_file(str(f))

    async def run() -> Any:
        spec = SamplerSpec(hf_config=config, max_model_len=config["max_position_embeddings"])
        engine = VllmSampler(0, spec)
        shipment = LocalTransport.ship(step, weights)
        await engine.load_weights(shipment)
        return flat_result(await engine.sample("fresh", SampleRequest(**request), shipment))

    return asyncio.run(run())
