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


_OOM = {"step_s": float("nan"), "peak_gib": float("nan"), "oom": 1.0}
"""A measurement that ran out of device memory."""


def _profiled(where: str | None) -> Any:
    """A torch profiler over the timed steps whose table (by self device time) goes to
    ``where``; a no-op context without one."""
    import contextlib

    import torch

    if not where:
        return contextlib.nullcontext()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)

    @contextlib.contextmanager
    def run() -> Any:
        with prof:
            yield
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        Path(where).write_text(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")

    return run()


def _tokens(vocab: int, tokens: int, seq_len: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, seq_len).tolist() for _ in range(tokens // seq_len)]


def trainctl_step(
    model: dict[str, Any],
    tokens: int,
    seq_len: int,
    steps: int,
    fused: bool = True,
    profile: str | None = None,
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
    try:
        engine.train_batch(req)  # warm-up: kernels, optimizer state
        _sync()
        _peak_reset()
        t0 = time.perf_counter()
        with _profiled(profile):
            for _ in range(steps):
                engine.train_batch(req)
            _sync()
    except Exception as e:  # the rank's OutOfMemoryError arrives wrapped in a WorkerError
        if "OutOfMemoryError" in str(e):
            return _OOM
        raise
    seconds = (time.perf_counter() - t0) / steps
    return {"step_s": seconds, "peak_gib": _peak_gib(), "params": engine.engine.num_parameters()}


def transformers_step(
    model: dict[str, Any], tokens: int, seq_len: int, steps: int, profile: str | None = None
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
        with _profiled(profile):
            for _ in range(steps):
                step()
            _sync()
    except torch.OutOfMemoryError:
        return _OOM
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


def measure(timeout_s: float, **job: Any) -> dict[str, float] | None:
    """One measurement in a fresh process; ``None`` (and its error on stderr) if it failed, so
    one failing cell does not cost the rest of the table."""
    head = "" if job.get("fused", True) else " (log-prob kernel)"
    what = f"{job['fn']}{head} at {job['tokens']:,} tokens"
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(job)],
            capture_output=True, text=True, cwd=ROOT, timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"FAILED: {what}: no result in {timeout_s:.0f} s", file=sys.stderr, flush=True)
        return None
    if proc.returncode:
        print(f"FAILED: {what}:\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _unmeasured(result: dict[str, float] | None) -> str | None:
    """What a cell says for a measurement with no numbers: "failed", "OOM", or None."""
    if result is None:
        return "failed"
    return "OOM" if result.get("oom") else None


def profile(
    where: Path, timeout_s: float, model: dict[str, Any], tokens: int, seq_len: int, steps: int
) -> int:
    """Both steps under the torch profiler; prints and keeps their kernel tables. Returns the
    number of failed runs."""
    where.mkdir(parents=True, exist_ok=True)
    failed = 0
    for fn in ("trainctl", "transformers"):
        path = where / f"profile_{fn}_{tokens}.txt"
        got = measure(
            timeout_s, fn=fn, model=model, tokens=tokens, seq_len=seq_len, steps=steps,
            profile=str(path),
        )  # fmt: skip
        failed += got is None
        if got is not None and path.exists():
            print(f"## {fn}, {tokens:,} tokens, {steps} steps: {got['step_s']:.3f} s a step")
            print(path.read_text(), flush=True)
    return failed


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
    ap.add_argument("--child-timeout", type=float, default=600, help="seconds per measurement")
    ap.add_argument(
        "--profile", metavar="DIR",
        help="instead of the table: profile trainctl's and transformers' steps at the first "
        "size, and write each one's kernel table (by self device time) into DIR",
    )  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    model, sizes, seq_len = QWEN3_06B, [int(t) for t in a.tokens.split(",")], a.seq_len
    if a.quick:
        model, sizes, seq_len = TINY, [512, 1024], 256
    if a.profile:
        sys.exit(profile(Path(a.profile), a.child_timeout, model, sizes[0], seq_len, a.steps))
    gpu, peak = _gpu()
    rows, params, failed = [], 0, 0
    for tokens in sizes:
        common = dict(model=model, tokens=tokens, seq_len=seq_len, steps=a.steps)
        ours = measure(a.child_timeout, fn="trainctl", fused=True, **common)
        unfused = measure(a.child_timeout, fn="trainctl", fused=False, **common)
        hf = measure(a.child_timeout, fn="transformers", **common)
        failed += sum(r is None for r in (ours, unfused, hf))
        if no := _unmeasured(ours):
            cells = [no] * 4
        else:
            assert ours is not None
            params = int(ours["params"])
            rate = step_flops(model, params, tokens, seq_len) / ours["step_s"]
            mfu = f"{100 * rate / peak:.1f}%" if peak else "n/a"
            cells = [f"{tokens / ours['step_s']:,.0f}", f"{rate / 1e12:.0f}", mfu,
                     f"{ours['peak_gib']:.1f}"]  # fmt: skip
        cells.append(_unmeasured(unfused) or f"{unfused['peak_gib']:.1f}")
        if no := _unmeasured(hf):
            cells += [no] * 2
        else:
            assert hf is not None
            cells += [f"{tokens / hf['step_s']:,.0f}", f"{hf['peak_gib']:.1f}"]
        rows.append(f"| {tokens:,} | {' | '.join(cells)} |")
        print(rows[-1], flush=True)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    table = "\n".join(
        [
            f"{gpu}, {date}: {'a tiny' if a.quick else 'a Qwen3-0.6B-shaped'} model "
            f"({params / 1e6:.1f}M parameters, random weights), "
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
    if failed:
        sys.exit(f"{failed} measurement(s) failed (their errors are above)")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
