"""The GPU benchmark: a train step of a Qwen3-0.6B-shaped model (random weights, bf16) on one
GPU, against transformers run two ways.

    python bench/gpu.py                   # on a GPU: prints the table, writes bench/results/gpu.md
    python bench/gpu.py --quick           # anywhere (CPU too): a tiny model, to check the script

Rows: packed batches of sequences of ``--seq-len`` tokens (16K, 32K, 64K tokens a step), and
one ragged RL batch, ``--ragged`` (by default 32 x 512 + 4 x 4096 = 32K tokens), as a GRPO
step's groups and long prompts would give.

Columns, each measured in a fresh process (``--child``) so its peak memory is its own
(``torch.cuda.max_memory_allocated`` over the timed steps, after warm-up made the optimizer
state):

* **trainctl**: the engine in process (``workers/control/inprocess.py``), the service's own step
  code: bf16 parameters, fp32 main gradients, fp32 AdamW master weights (fused), gradient
  clipping at 1.0, the fused LM head; the whole batch is one packed micro-batch. Its timed region
  includes the host's planning and packing of the request (a product number: what a client
  waits for), where transformers gets its tensors on the device already.
* **transformers, AMP**: what HF Trainer with ``bf16=True`` runs: fp32 parameters, autocast to
  bf16, fused AdamW, ``clip_grad_norm_(1.0)``; the batch in micro-batches of at most
  ``--hf-micro-tokens`` with gradient accumulation (one forward of 32K tokens builds 20 GB of
  fp32 logits); a ragged batch by length buckets (no padding: the kindest layout for it).
* **transformers, pure bf16**: bf16 parameters and AdamW state with no master weights, norm or
  clip (a plain script; fastest, and numerically not the same training).

Each cell is the median of ``--steps`` steps after ``--warmup`` steps. The attention kernels each
side ran are read from one profiled step.

FLOPs per step: ``6 * N * tokens`` for the matrix products (``N``: every parameter but the
input embedding; tied, the embedding counts once, as the LM head) plus attention,
``6 * layers * heads * head_dim * L^2`` per sequence of length ``L`` with causal attention's
half of the square (``QK^T`` and ``AV``, two FLOPs a multiply-add, times three for forward and
backward): the **bench** convention. The **PaLM** convention (nanochat, torchtitan) counts the
whole square, twice that attention term. MFU divides by the GPU's dense bf16 peak (989 TFLOP/s
for the H100 SXM and the H200).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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
_NOT_RUN = {"step_s": float("nan"), "peak_gib": float("nan"), "not_run": 1.0}
"""A cell this run leaves out (see the table's caption)."""


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


def _attention_kernels(step: Any) -> str:
    """The attention kernels one run of ``step`` launched (a profiled step), or ``n/a``."""
    import torch

    if not torch.cuda.is_available():
        return "n/a (CPU)"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = sorted(
        {e.key for e in prof.key_averages() if any(k in e.key.lower() for k in ATTENTION_KERNELS)}
    )
    return "; ".join(n[:60] for n in names) or "none found"


def _timed(step: Any, steps: int, warmup: int, profile: str | None) -> list[float]:
    """Per-step seconds of ``steps`` runs of ``step`` after ``warmup`` runs; the peak memory
    counter starts after the warm-up."""
    for _ in range(warmup):
        step()
    _sync()
    _peak_reset()
    times = []
    with _profiled(profile):
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            _sync()
            times.append(time.perf_counter() - t0)
    return times


def lengths_of(tokens: int, seq_len: int, ragged: str | None) -> list[int]:
    """The sequence lengths of a row: ``tokens // seq_len`` sequences of ``seq_len``, or the
    ragged spec ``"32x512+4x4096"``."""
    if not ragged:
        return [seq_len] * (tokens // seq_len)
    out: list[int] = []
    for part in ragged.split("+"):
        count, length = part.split("x")
        out += [int(length)] * int(count)
    return out


def _sequences(vocab: int, lengths: list[int]) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def trainctl_step(
    model: dict[str, Any],
    lengths: list[int],
    steps: int,
    warmup: int,
    fused: bool = True,
    profile: str | None = None,
) -> dict[str, Any]:
    import torch

    from trainctl.api import TrainBatchRequest
    from trainctl.workers.control.inprocess import InProcessEngine
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.ops import packed_attention

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    cfg = EngineConfig.from_dict(
        {
            "model": {**model, "max_seq_len": max(lengths)},
            "precision": precision,
            "max_tokens_per_microbatch": sum(lengths),
            "fused_lm_head": fused,
            "packing": "flat",
            "optimizer": {"clip_grad": 1.0},
        }
    )
    engine = InProcessEngine(cfg)
    req = TrainBatchRequest(
        sequences=[{"tokens": t} for t in _sequences(model["vocab_size"], lengths)]
    )
    losses: list[float] = []

    def step() -> None:
        losses.append(engine.train_batch(req).loss)

    try:
        times = _timed(step, steps, warmup, profile)
        kernels = _attention_kernels(step)
    except Exception as e:  # the rank's OutOfMemoryError arrives wrapped in a WorkerError
        if "OutOfMemoryError" in str(e):
            return _OOM
        raise
    path = "runs"
    many_runs = len(packed_attention.equal_runs(lengths)) > packed_attention.VARLEN_MIN_RUNS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if many_runs and packed_attention.varlen_usable(
        torch.empty(0, device=dev, dtype=torch.bfloat16), 0.0
    ):
        path = "varlen"
    return {
        "step_s": statistics.median(times),
        "steps": times,
        "peak_gib": _peak_gib(),
        "params": engine.engine.num_parameters(),
        "attention": f"{path}: {kernels}",
        "losses": losses,
    }


def transformers_step(
    model: dict[str, Any],
    lengths: list[int],
    steps: int,
    warmup: int,
    amp: bool = True,
    micro_tokens: int = 16384,
    profile: str | None = None,
) -> dict[str, Any]:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    config = transformers.Qwen3Config(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"],
        intermediate_size=model["ffn_hidden_size"], num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"], head_dim=model["head_dim"],
        tie_word_embeddings=model["tie_embeddings"], max_position_embeddings=max(lengths),
        attn_implementation="sdpa",
    )  # fmt: skip
    net = transformers.AutoModelForCausalLM.from_config(config)
    if amp or not cuda:
        net = net.to(dev, torch.float32)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=cuda)
    else:
        net = net.to(dev, torch.bfloat16)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
    seqs = _sequences(model["vocab_size"], lengths)
    # Length buckets, each cut into micro-batches of at most micro_tokens (>= one sequence).
    micro: list[Any] = []
    total = sum(lengths)
    for length in sorted(set(lengths)):
        rows = [s for s in seqs if len(s) == length]
        per = max(1, micro_tokens // length) if amp else len(rows)
        for a in range(0, len(rows), per):
            micro.append(torch.tensor(rows[a : a + per], device=dev))

    losses: list[float] = []

    def step() -> None:
        total_loss = torch.zeros((), device=dev)
        for ids in micro:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp and cuda):
                loss = net(input_ids=ids, labels=ids).loss * (ids.numel() / total)
            loss.backward()
            total_loss += loss.detach().float()
        losses.append(total_loss)
        if amp:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        times = _timed(step, steps, warmup, profile)
        kernels = _attention_kernels(step)
    except torch.OutOfMemoryError:
        return _OOM
    return {
        "step_s": statistics.median(times),
        "steps": times,
        "peak_gib": _peak_gib(),
        "attention": f"{config._attn_implementation}: {kernels}",
        "micro_batches": len(micro),
        "losses": [float(x) for x in losses],
    }


def step_flops(model: dict[str, Any], params: int, lengths: list[int], palm: bool = False) -> float:
    """Model FLOPs of one train step (see the module docstring)."""
    untied_embedding = 0 if model["tie_embeddings"] else model["vocab_size"] * model["hidden_size"]
    matmul_params = params - untied_embedding
    attn = 6 * model["num_layers"] * model["num_attention_heads"] * model["head_dim"]
    attn *= 2 if palm else 1
    return 6.0 * matmul_params * sum(lengths) + attn * sum(n * n for n in lengths)


def _child(job: dict[str, Any]) -> dict[str, Any]:
    fn = {"trainctl": trainctl_step, "transformers": transformers_step}[job.pop("fn")]
    return fn(**job)  # type: ignore[no-any-return,operator]


def measure(timeout_s: float, label: str, **job: Any) -> dict[str, Any] | None:
    """One measurement in a fresh process; ``None`` (and its error on stderr) if it failed, so
    one failing cell does not cost the rest of the table."""
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(job)],
            capture_output=True, text=True, cwd=ROOT, timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"FAILED: {label}: no result in {timeout_s:.0f} s", file=sys.stderr, flush=True)
        return None
    if proc.returncode:
        print(f"FAILED: {label}:\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _unmeasured(result: dict[str, Any] | None) -> str | None:
    """What a cell says for a measurement with no numbers: "failed", "OOM", or None."""
    if result is None:
        return "failed"
    if result.get("not_run"):
        return "not run"
    return "OOM" if result.get("oom") else None


def profile(
    where: Path, timeout_s: float, model: dict[str, Any], lengths: list[int], steps: int
) -> int:
    """Both steps under the torch profiler; prints and keeps their kernel tables. Returns the
    number of failed runs."""
    where.mkdir(parents=True, exist_ok=True)
    failed = 0
    for fn in ("trainctl", "transformers"):
        path = where / f"profile_{fn}_{sum(lengths)}.txt"
        got = measure(
            timeout_s, fn, fn=fn, model=model, lengths=lengths, steps=steps, warmup=1,
            profile=str(path),
        )  # fmt: skip
        failed += got is None
        if got is not None and path.exists():
            print(f"## {fn}, {sum(lengths):,} tokens, {steps} steps: {got['step_s']:.3f} s a step")
            print(path.read_text(), flush=True)
    return failed


def _gpu() -> tuple[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return "CPU (no CUDA device)", None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return name, peak


class Table:
    """The rows of the result table, one per batch shape."""

    HEADER = (
        "| batch | tokens | trainctl tokens/s | MFU bench / PaLM | trainctl peak GiB "
        "| transformers AMP tokens/s | AMP peak GiB | transformers pure-bf16 tokens/s "
        "| bf16 peak GiB | trainctl / AMP |"
    )

    def __init__(self, model: dict[str, Any], peak: float | None) -> None:
        self.model, self.peak = model, peak
        self.rows: list[str] = []
        self.params = 0
        self.backends: list[str] = []

    def add(self, label: str, lengths: list[int], cells: dict[str, dict[str, Any] | None]) -> None:
        ours, amp, bf16 = cells["trainctl"], cells["amp"], cells["bf16"]
        tokens = sum(lengths)
        out = [label, f"{tokens:,}"]
        if no := _unmeasured(ours):
            out += [no] * 3
        else:
            assert ours is not None
            self.params = int(ours["params"])
            rate = [step_flops(self.model, self.params, lengths, palm) / ours["step_s"]
                    for palm in (False, True)]  # fmt: skip
            mfu = " / ".join(f"{100 * r / self.peak:.1f}%" for r in rate) if self.peak else "n/a"
            out += [f"{tokens / ours['step_s']:,.0f}", mfu, f"{ours['peak_gib']:.1f}"]
            self.backends.append(f"{label}: trainctl {ours.get('attention')}")
        for r in (amp, bf16):
            if no := _unmeasured(r):
                out += [no] * 2
            else:
                assert r is not None
                out += [f"{tokens / r['step_s']:,.0f}", f"{r['peak_gib']:.1f}"]
                self.backends.append(f"{label}: transformers {r.get('attention')}")
        ratio = "n/a"
        if not _unmeasured(ours) and not _unmeasured(amp):
            assert ours is not None and amp is not None
            ratio = f"{amp['step_s'] / ours['step_s']:.2f}x"
        out.append(ratio)
        self.rows.append("| " + " | ".join(out) + " |")
        print(self.rows[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16384,32768,65536", help="packed batch sizes")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--ragged", default="32x512+4x4096", help="the ragged row ('' for none)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--hf-micro-tokens", type=int, default=16384,
        help="transformers AMP: tokens per micro-batch",
    )  # fmt: skip
    ap.add_argument(
        "--hf-max-tokens", type=int, default=32768,
        help="transformers columns only up to this many tokens (OOM past it)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--child-timeout", type=float, default=300, help="seconds per measurement")
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
    model, sizes, seq_len, ragged = (
        QWEN3_06B,
        [int(t) for t in a.tokens.split(",")],
        a.seq_len,
        a.ragged,
    )
    if a.quick:
        model, sizes, seq_len, ragged = TINY, [512, 1024], 256, "4x64+1x256"
    if a.profile:
        lengths = lengths_of(sizes[0], seq_len, None)
        sys.exit(profile(Path(a.profile), a.child_timeout, model, lengths, a.steps))
    gpu, peak = _gpu()
    table, failed = Table(model, peak), 0
    raw: dict[str, Any] = {}
    shapes = [(f"{t // seq_len} x {seq_len}", lengths_of(t, seq_len, None)) for t in sizes]
    if ragged:
        shapes.append((ragged.replace("x", " x ").replace("+", " + "), lengths_of(0, 0, ragged)))
    for label, lengths in shapes:
        common = dict(model=model, lengths=lengths, steps=a.steps, warmup=a.warmup)
        cells: dict[str, dict[str, Any] | None] = {"amp": _NOT_RUN, "bf16": _NOT_RUN}
        cells["trainctl"] = measure(a.child_timeout, f"trainctl {label}", fn="trainctl", **common)
        failed += cells["trainctl"] is None
        for key, amp in (("amp", True), ("bf16", False)):
            if sum(lengths) > a.hf_max_tokens or (not amp and len(set(lengths)) > 1):
                continue
            cells[key] = measure(
                a.child_timeout, f"transformers {key} {label}", fn="transformers", amp=amp,
                micro_tokens=a.hf_micro_tokens, **common,
            )  # fmt: skip
            failed += cells[key] is None
        table.add(label, lengths, cells)
        raw[label] = cells
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    text = "\n".join(
        [
            f"{gpu}, {date}: {'a tiny' if a.quick else 'a Qwen3-0.6B-shaped'} model "
            f"({table.params / 1e6:.1f}M parameters, random weights), "
            f"{'bf16' if peak is not None else 'fp32'}; each cell the median of {a.steps} steps "
            f"after {a.warmup} warm-up steps. transformers AMP: fp32 masters, autocast bf16, "
            f"fused AdamW, clip 1.0, micro-batches of at most {a.hf_micro_tokens:,} tokens "
            "(length buckets for a ragged batch); pure bf16: bf16 weights and AdamW state, no "
            "clip (not run on a ragged batch); columns past "
            f"{a.hf_max_tokens:,} tokens not run (out of memory).",
            "",
            Table.HEADER,
            "|---|---|---|---|---|---|---|---|---|---|",
            *table.rows,
            "",
            "Attention kernels (one profiled step each):",
            "",
            *[f"- {b}" for b in table.backends],
        ]
    )
    print(text)
    if artifacts := os.environ.get("TRAINCTL_GPU_ARTIFACTS"):
        Path(artifacts, "gpu_bench.json").write_text(json.dumps(raw, indent=1, default=str))
    if not a.quick and peak is not None:
        RESULT.write_text(text + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")
    if failed:
        sys.exit(f"{failed} measurement(s) failed (their errors are above)")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
