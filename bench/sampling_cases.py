"""Benchmark cases of the samplers (run by run.py in a fresh process each).

``sampling_case`` starts ``trainctl serve --samplers 1`` (dp=1) on a model shape and measures:
- the weight sync: gather (ranks to one object of HF-named tensors) and load (into vLLM);
- the path it replaces: ``export_hf`` to disk, then a fresh vLLM engine loading that export;
- the sampler's generation throughput;
- with ``rl_iterations``, the RL loop of ``examples/rl_loop.py``: time per iteration, split
  into sample, train and sync.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from examples import rl_loop

ROOT = Path(__file__).resolve().parents[1]

WIDE = {
    "num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 4,
    "ffn_hidden_size": 2816, "vocab_size": 32000, "max_seq_len": 1024,
}  # fmt: skip
"""A wider model: 4 layers of width 1024 and a 32K vocabulary (113M parameters)."""

FRESH_ENGINE = """
import json, os, sys, time
os.environ.update(VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
def main():
    from vllm import LLM
    t0 = time.perf_counter()
    LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=int(sys.argv[2]))
    print(json.dumps({"load_s": time.perf_counter() - t0}))
if __name__ == "__main__":
    main()
"""


def _fresh_engine(export_dir: str, max_len: int) -> float:
    """Seconds for a new vLLM engine to load an export from disk (a fresh process; Python's
    imports are not counted)."""
    out = subprocess.run(
        [sys.executable, "-c", FRESH_ENGINE, export_dir, str(max_len)],
        capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["load_s"])


def sampling_case(model: dict[str, int], syncs: int, rl_iterations: int) -> dict[str, Any]:
    from trainctl.local import LocalService

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "engine.json"
        cfg.write_text(json.dumps({"model": model}))
        flags = ("--dp", "1", "--samplers", "1", "--sampler-sync", "manual",
                 "--engine-config", str(cfg), "--max-tokens-per-microbatch", "8192")  # fmt: skip
        svc = LocalService(Path(tmp) / "data", *flags, start_timeout_s=900)
        with svc, svc.client() as tc:
            info = tc.info()
            params = int(info.engine["parameters_per_replica"])
            runs = [tc.sync_weights() for _ in range(syncs)]
            t0 = time.perf_counter()
            export = tc.export_hf("bench")
            export_s = time.perf_counter() - t0
            fresh_s = _fresh_engine(export.path, int(info.limits.max_seq_len))
            prompts = [[1 + i, 2, 3, 4] for i in range(32)]
            tc.sample(prompts[:2], max_tokens=4)  # warm
            t0 = time.perf_counter()
            r = tc.sample(prompts, n=4, max_tokens=64, temperature=1.0, seed=0)
            wall = time.perf_counter() - t0
            generated = sum(len(c.tokens) for s in r.samples for c in s.completions)
            its = rl_loop.run(tc, rl_iterations, quiet=True) if rl_iterations else []
    out: dict[str, Any] = {
        "parameters": params,
        "bytes": runs[0].bytes,
        "gather_s": statistics.median(s.gather_s for s in runs),
        "load_s": statistics.median(s.load_s for s in runs),
        "export_s": export_s,
        "fresh_engine_s": fresh_s,
        "tokens_per_s": generated / wall,
        "generated": generated,
    }
    if its:
        out["rl"] = {
            k: statistics.median(getattr(i, k) for i in its)
            for k in ("sample_s", "train_s", "sync_s")
        }
        out["rl"]["reward_first"], out["rl"]["reward_last"] = its[0].reward, its[-1].reward
        out["rl"]["iterations"] = len(its)
    return out
