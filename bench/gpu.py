"""The GPU benchmark: a train step of a Qwen3-0.6B-shaped model (random weights, bf16) on one
GPU, on packed batches of 16K to 64K tokens, against plain transformers + AdamW.

    python bench/gpu.py                   # on a GPU: prints the table, writes bench/results/gpu.md
    python bench/gpu.py --quick           # anywhere (CPU too): a tiny model, to check the script

Each measurement runs in a fresh process (``--child``), so its peak memory is its own:
``torch.cuda.max_memory_allocated`` over the timed steps, after a warm-up step has created the
optimizer state (so the peak holds weights, gradients, optimizer state and activations).

trainctl runs the engine in process (``workers/control/inprocess.py``): bf16 parameters, fp32
main gradients and AdamW master weights, the batch packed into one micro-batch of sequences of
``--seq-len`` tokens. Its head is the fused LM head (logits one chunk at a time) or, with
``fused_lm_head`` off, the full logits then our streamed log-prob kernel. transformers runs
``Qwen3ForCausalLM`` in bf16 on the same tokens as a ``[batch, seq-len]`` tensor, its own
cross-entropy loss and ``torch.optim.AdamW`` (bf16 state, as a plain script has it).

FLOPs per step: ``6 * N * tokens`` for the matrix products (``N``: every parameter but the
input embedding; tied, the embedding counts once, as the LM head) plus causal attention,
``6 * layers * heads * head_dim * L^2`` per sequence of length ``L`` (``QK^T`` and ``AV``, two
FLOPs a multiply-add, half the square, times three for forward and backward). MFU divides the
achieved rate by the GPU's dense bf16 peak (989 TFLOP/s for the H100 SXM and the H200).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "gpu.md"

QWEN3_06B = dict(
    family="qwen3", vocab_size=151936, hidden_size=1024, ffn_hidden_size=3072, num_layers=28,
    num_attention_heads=16, num_query_groups=8, head_dim=128, tie_embeddings=True,
    rotary_base=1000000, norm_eps=1e-6,
)  # fmt: skip
TINY = dict(
    family="qwen3", vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2,
    num_attention_heads=4, num_query_groups=2, head_dim=16, tie_embeddings=True,
)  # fmt: skip
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _tokens(vocab: int, tokens: int, seq_len: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, seq_len).tolist() for _ in range(tokens // seq_len)]


def trainctl_step(
    model: dict[str, Any], tokens: int, seq_len: int, steps: int, fused: bool
) -> dict[str, float]:
    import torch

    from trainctl.api import TrainBatchRequest
    from trainctl.workers.control.inprocess import InProcessEngine
    from trainctl.workers.engine.config import EngineConfig

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    cfg = EngineConfig.from_dict(
        {
            "model": {**model, "max_seq_len": seq_len},
            "precision": precision,
            "max_tokens_per_microbatch": tokens,
            "fused_lm_head": fused,
            "packing": "flat",
        }
    )
    engine = InProcessEngine(cfg)
    seqs = _tokens(model["vocab_size"], tokens, seq_len)
    req = TrainBatchRequest(sequences=[{"tokens": t} for t in seqs])
    engine.train_batch(req)  # warm-up: kernels, optimizer state
    _sync()
    _peak_reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(req)
    _sync()
    seconds = (time.perf_counter() - t0) / steps
    return {"step_s": seconds, "peak_gib": _peak_gib(), "params": engine.engine.num_parameters()}


def transformers_step(
    model: dict[str, Any], tokens: int, seq_len: int, steps: int
) -> dict[str, float]:
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    config = transformers.Qwen3Config(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"],
        intermediate_size=model["ffn_hidden_size"], num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"], head_dim=model["head_dim"],
        tie_word_embeddings=model["tie_embeddings"], max_position_embeddings=seq_len,
    )  # fmt: skip
    net = transformers.AutoModelForCausalLM.from_config(config).to(dev, dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
    ids = torch.tensor(_tokens(model["vocab_size"], tokens, seq_len), device=dev)

    def step() -> None:
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        step()
        _sync()
        _peak_reset()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
    except torch.OutOfMemoryError:
        return {"step_s": float("nan"), "peak_gib": float("nan"), "oom": 1.0}
    return {"step_s": (time.perf_counter() - t0) / steps, "peak_gib": _peak_gib()}


def step_flops(model: dict[str, Any], params: int, tokens: int, seq_len: int) -> float:
    """Model FLOPs of one train step (see the module docstring)."""
    untied_embedding = 0 if model["tie_embeddings"] else model["vocab_size"] * model["hidden_size"]
    matmul_params = params - untied_embedding
    attn = 6 * model["num_layers"] * model["num_attention_heads"] * model["head_dim"]
    return 6.0 * matmul_params * tokens + attn * seq_len**2 * (tokens // seq_len)


def _child(job: dict[str, Any]) -> dict[str, float]:
    fn = {"trainctl": trainctl_step, "transformers": transformers_step}[job.pop("fn")]
    return fn(**job)  # type: ignore[no-any-return,operator]


def measure(**job: Any) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{job['fn']} at {job['tokens']} tokens failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _gpu() -> tuple[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return "CPU (no CUDA device)", None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return name, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384,32768,65536", help="packed batch sizes")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    model, sizes, seq_len = QWEN3_06B, [int(t) for t in a.tokens.split(",")], a.seq_len
    if a.quick:
        model, sizes, seq_len = TINY, [512, 1024], 256
    gpu, peak = _gpu()
    rows = []
    for tokens in sizes:
        common = dict(model=model, tokens=tokens, seq_len=seq_len, steps=a.steps)
        ours = measure(fn="trainctl", fused=True, **common)
        unfused = measure(fn="trainctl", fused=False, **common)
        hf = measure(fn="transformers", **common)
        flops = step_flops(model, int(ours["params"]), tokens, seq_len)
        rate = flops / ours["step_s"]
        mfu = f"{100 * rate / peak:.1f}%" if peak else "n/a"
        hf_tps = "OOM" if hf.get("oom") else f"{tokens / hf['step_s']:,.0f}"
        hf_mem = "OOM" if hf.get("oom") else f"{hf['peak_gib']:.1f}"
        rows.append(
            f"| {tokens:,} | {tokens / ours['step_s']:,.0f} | {rate / 1e12:.0f} | {mfu} "
            f"| {ours['peak_gib']:.1f} | {unfused['peak_gib']:.1f} | {hf_tps} | {hf_mem} |"
        )
        print(rows[-1], flush=True)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    table = "\n".join(
        [
            f"{gpu}, {date}: {'a tiny' if a.quick else 'a Qwen3-0.6B-shaped'} model "
            f"({int(ours['params']) / 1e6:.1f}M parameters, random weights), "
            f"{'bf16' if peak is not None else 'fp32'}, sequences of {seq_len} tokens packed into "
            f"one micro-batch; the mean of {a.steps} steps after a warm-up.",
            "",
            "| tokens / step | trainctl tokens/s | model TFLOP/s | MFU | peak GiB (fused head) "
            "| peak GiB (log-prob kernel) | transformers + AdamW tokens/s "
            "| transformers peak GiB |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if not a.quick and peak is not None:
        RESULT.write_text(table + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
