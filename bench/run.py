"""trainctl's benchmarks, one entry point: prints the tables and writes bench/results.md.

    python bench/run.py                 # every section
    python bench/run.py --only logprob  # logprob, cp_loss, mask (comma-separated)
    python bench/run.py --quick         # smaller sizes, for a smoke run (writes nothing)

Every measurement runs in a fresh process (``--child``) so peak memory is its own: the peak
resident set above the inputs (see bench/memory.py), never a number computed from shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.memory import child_env  # noqa: E402

RESULTS = ROOT / "bench" / "results.md"
SECTION_DIR = ROOT / "bench" / "results"
"""One file per section, so ``--only`` refreshes some tables and keeps the others."""


def measure(fn: str, module: str = "cases", **kwargs: Any) -> dict[str, float]:
    """Run ``bench.<module>.<fn>(**kwargs)`` in a fresh process and return its result.

    Memory cases (``cases``, ``parallel_cases``) run with ``child_env()`` (small allocations
    from mmap, so peaks are exact); the API cases time the service as users run it, with the
    plain environment.
    """
    job = json.dumps({"fn": fn, "module": module, "kwargs": kwargs})
    env = child_env() if module != "api_cases" else {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--child", job],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"{fn}({kwargs}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def section_logprob(quick: bool) -> str:
    n, v = (2048, 4096) if quick else (8192, 8192)
    base = measure("logprob_case", variant="full", n=n, v=v, chunks=1, repeats=3)
    rows = [
        [
            "non-chunked (saves softmax)",
            "-",
            f"{base['peak_over_G']:.2f}",
            "-",
            f"{base['time_s'] * 1e3:.0f}",
            "1.00",
        ]
    ]
    for chunks in (4, 8, 16):
        for variant, label in (
            ("list_cat", "chunked, list + cat backward"),
            ("streamed", "chunked, streamed backward (ours)"),
        ):
            r = measure("logprob_case", variant=variant, n=n, v=v, chunks=chunks, repeats=3)
            target = f"<= {1 + 2 / chunks:.3f}" if variant == "streamed" else "~2"
            rows.append(
                [
                    label,
                    str(chunks),
                    f"{r['peak_over_G']:.3f}",
                    target,
                    f"{r['time_s'] * 1e3:.0f}",
                    f"{r['time_s'] / base['time_s']:.2f}",
                ]
            )
    head = (
        f"### Streamed vocab-parallel log-prob: forward + backward, {n} tokens x {v} vocab, "
        f"fp32 (G = full gradient = {base['G_MiB']:.0f} MiB)\n\n"
    )
    return head + _table(
        ["kernel", "chunks", "peak above inputs / G", "target", "time (ms)", "time vs non-chunked"],
        rows,
    )


def section_fused_head(quick: bool) -> str:
    v, h, chunk = (32_768, 64, 1024) if quick else (151_936, 64, 1024)
    lengths = (2048, 8192) if quick else (8192, 32_768, 131_072)
    rows = []
    for n in lengths:
        logits_gib = n * v * 4 / (1 << 30)
        fused = measure("fused_head_case", variant="fused", n=n, h=h, v=v, chunk=chunk)
        if n == lengths[0]:
            unfused = measure("fused_head_case", variant="unfused", n=n, h=h, v=v, chunk=chunk)
            unfused_cell = f"{unfused['peak_MiB'] / 1024:.2f} GiB (measured)"
            unfused_gib = unfused["peak_MiB"] / 1024
        else:
            # Logits and their gradient, fp32: does not fit in this machine's 24 GiB.
            unfused_gib = 2 * logits_gib
            unfused_cell = f"{unfused_gib:.1f} GiB (computed: logits + gradient)"
        ratio = unfused_gib * 1024 / fused["peak_MiB"]
        rows.append(
            [
                str(n),
                f"{logits_gib:.2f}",
                unfused_cell,
                f"{fused['peak_MiB']:.0f} MiB",
                f"{fused['grads_MiB']:.0f} MiB",
                f"{ratio:.0f}x",
                f"{fused['time_s']:.1f}",
            ]
        )
    head = (
        f"### Fused LM head + log-prob: vocab {v}, hidden {h}, chunks of {chunk} tokens, fp32, "
        "peak above the inputs over forward + backward (target: >= 20x lower at 32K)\n\n"
    )
    return head + _table(
        [
            "tokens", "logits GiB", "unfused peak", "fused peak", "of which dh + dW",
            "unfused / fused", "fused time (s)",
        ],
        rows,
    )  # fmt: skip


def _relative_rows(runs: list[tuple[str, dict[str, float]]]) -> list[list[str]]:
    """Peak and time of each run, and their ratios to the first run's."""
    base = runs[0][1]
    return [
        [
            label,
            f"{r['peak_MiB']:.0f}",
            f"{r['peak_MiB'] / base['peak_MiB']:.2f}",
            f"{r['time_s']:.1f}",
            f"{r['time_s'] / base['time_s']:.2f}",
        ]
        for label, r in runs
    ]


def section_recompute(quick: bool) -> str:
    tokens = 2048 if quick else 8192
    runs = [
        (mode, measure("activation_case", recompute=mode, tokens=tokens))
        for mode in ("none", "selective", "full")
    ]
    head = (
        f"### Activation recomputation: one forward/backward of a {tokens}-token sequence, "
        "4 layers, hidden 256, 4 heads, fp32, peak above the weights\n\n"
    )
    return head + _table(
        ["recompute", "peak MiB", "vs none", "forward+backward (s)", "time vs none"],
        _relative_rows(runs),
    )


def section_sequence_parallel(quick: bool) -> str:
    tokens = 2048 if quick else 8192
    runs = [
        (
            mode,
            measure("sp_activation_case", "parallel_cases", sequence_parallel=mode, tokens=tokens),
        )
        for mode in ("off", "on")
    ]
    base = runs[0][1]["loss"]
    rows = [
        [*row, f"{abs(r['loss'] - base) / abs(base):.1e}"]
        for row, (_, r) in zip(_relative_rows(runs), runs, strict=True)
    ]
    from bench.parallel_cases import SP_MODEL

    m = SP_MODEL
    head = (
        f"### Sequence parallelism at tp2: one forward/backward of a {tokens}-token sequence, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"{m['num_attention_heads']} heads, fp32; per-rank peak above the weights (the larger "
        "rank)\n\n"
        "Under sequence parallelism the norms, the residual stream and the inputs the linears "
        "keep for backward hold 1/tp of the tokens; attention and the MLP's inner activations "
        "are split by heads and columns either way.\n\n"
    )
    return head + _table(
        ["sequence parallel", "peak MiB", "vs off", "forward+backward (s)", "time vs off",
         "loss rel. diff"],
        rows,
    )  # fmt: skip


TREE_SHAPES = [
    "grpo-8-1024-256",
    "grpo-8-1024-1024",
    "grpo-16-1024-256",
    "grpo-16-1024-1024",
    "turns",
]


def section_tree(quick: bool) -> str:
    """Tree against flat packing: train-step throughput beside the token ratio, attention time
    beside the ideal tree cost, and peak memory."""
    from bench.tree_cases import BUDGET, MODELS

    shapes = TREE_SHAPES[:1] + TREE_SHAPES[-1:] if quick else TREE_SHAPES
    rows, attention = [], []
    for model in MODELS:
        for shape in shapes:
            flat, tree = (
                measure("tree_step_case", "tree_cases", model=model, shape=shape, packing=p,
                        steps=1 if quick else 2)
                for p in ("flat", "tree")
            )  # fmt: skip
            speedup = flat["step_s"] / tree["step_s"]
            ratio = tree["tokens"] / tree["computed"]
            rows.append(
                [
                    model, shape, f"{flat['tokens']:.0f}", f"{tree['computed']:.0f}",
                    f"{flat['tokens'] / flat['step_s']:.0f}",
                    f"{tree['tokens'] / tree['step_s']:.0f}",
                    f"{speedup:.2f}", f"{ratio:.2f}", f"{speedup / ratio:.2f}",
                    f"{flat['peak_MiB']:.0f}", f"{tree['peak_MiB']:.0f}",
                ]
            )  # fmt: skip
            attention.append(
                [
                    model, shape, f"{flat['attention_s'] * 1e3:.0f}",
                    f"{tree['attention_s'] * 1e3:.0f}",
                    f"{flat['attention_s'] / tree['attention_s']:.2f}",
                    f"{flat['pairs'] / tree['pairs']:.2f}",
                ]
            )  # fmt: skip
    wide = MODELS["wide"]["model"]
    head = (
        "### Tree against flat packing: one rank, one train step (median of 2), budget "
        f"{BUDGET} tokens per micro-batch, max_seq_len 4096\n\n"
        "Shapes: `grpo-G-P-R` is G responses of R tokens to one P-token prompt; `turns` a "
        "512-token first turn, 4 second turns of 256, each with 2 third turns of 256. Models: "
        "the embedded one (2 layers, hidden 128, vocab 512) and a wide one (2 layers, hidden "
        f"{wide['hidden_size']}, ffn {wide['ffn_hidden_size']}, vocab {wide['vocab_size']}) "
        "where the MLP and the LM head dominate. tokens/s counts the batch's tokens; the token "
        "ratio is tokens / computed tokens. Target: speed-up >= 0.8 x the token ratio on the "
        "wide GRPO shapes.\n\n"
    )
    table = _table(
        ["model", "shape", "tokens", "computed", "flat tok/s", "tree tok/s", "speed-up",
         "token ratio", "speed-up / ratio", "flat peak MiB", "tree peak MiB"],
        rows,
    )  # fmt: skip
    attn = _table(
        ["model", "shape", "flat attention ms", "tree attention ms", "time ratio",
         "ideal ratio (query-key pairs)"],
        attention,
    )  # fmt: skip
    return (
        head + table + "\n\nCore attention, forward of one eval pass (all layers), against "
        "the ideal tree cost: the ratio of (query, key) pairs attended, flat over tree.\n\n" + attn
    )


def section_state_bytes(quick: bool) -> str:
    """Bytes per parameter of training state on one rank: fp32 + Adam vs bf16 mixed precision,
    at dp 1, 2, 4, with and without ZeRO-1, beside the arithmetic bound."""
    rows = []
    for precision in ("fp32", "bf16"):
        for dp in (1, 2) if quick else (1, 2, 4):
            for zero in ("off", "on") if dp > 1 else ("off",):
                r = measure("state_bytes_case", dp=dp, precision=precision, zero=zero)
                # Parameters + fp32 main gradients + (bf16 only) fp32 master weights + Adam's
                # two fp32 moments; under ZeRO the last two are divided by dp.
                shard = dp if zero == "on" else 1
                bound = (4 + 4 + 8 / shard) if precision == "fp32" else (2 + 4 + 12 / shard)
                tensors = sum(r[f"{k}_per_param"] for k in ("params", "grads", "masters", "adam"))
                rows.append(
                    [
                        precision,
                        str(dp),
                        zero,
                        f"{r['params_per_param']:.2f}",
                        f"{r['grads_per_param']:.2f}",
                        f"{r['masters_per_param']:.2f}",
                        f"{r['adam_per_param']:.2f}",
                        f"**{tensors:.2f}**",
                        f"{bound:.2f}",
                        f"{r['rss_per_param']:.2f}",
                    ]
                )
    head = (
        f"### Training state per parameter on one rank ({r['parameters'] / 1e6:.1f}M-parameter "
        "model, after one step; the largest rank)\n\n"
        "Read off the rank's live tensors (each storage once), beside the bound "
        "(fp32: 4 + 4 + 8/d; bf16: 2 + 4 + (4 + 8)/d, d = dp under ZeRO-1, else 1) and the "
        "process's resident-set growth from before the engine was built (which also holds "
        "allocator slack, megatron's buffers and the step's leftovers).\n\n"
    )
    return head + _table(
        ["precision", "dp", "ZeRO-1", "params", "main grads", "master weights", "Adam",
         "total B/param", "bound", "RSS growth B/param"],
        rows,
    )  # fmt: skip


def section_cp_loss(quick: bool) -> str:
    t, v = (4096, 4096) if quick else (8192, 8192)
    rows = []
    for cp in (2, 4):
        local = measure("cp_loss_case", variant="cp_local", cp=cp, t=t, v=v)
        gather = measure("cp_loss_case", variant="gather", cp=cp, t=t, v=v)
        rows.append(
            [
                str(cp),
                f"{gather['peak_MiB']:.0f}",
                f"{local['peak_MiB']:.0f}",
                f"{local['peak_MiB'] / gather['peak_MiB']:.2f} (1/cp = {1 / cp:.2f})",
                f"{gather['bytes_sent'] / 2**20:.1f} MiB",
                f"{local['bytes_sent']:.0f} B",
            ]
        )
    head = (
        f"### CP-local loss vs gather-logits-then-loss: {t} tokens x {v} vocab per "
        f"micro-batch, fp32, per-rank peak over the loss (forward + backward)\n\n"
    )
    return head + _table(
        [
            "cp",
            "gather: peak MiB",
            "CP-local: peak MiB",
            "ratio",
            "gather: sent per rank",
            "CP-local: sent per rank",
        ],
        rows,
    )


def section_step(quick: bool) -> str:
    n_seqs, seq_len, steps = (4, 128, 2) if quick else (16, 256, 5)
    rows = []
    for name, layout in (
        ("dp1", {"dp": 1}),
        ("dp2", {"dp": 2}),
        ("cp2", {"dp": 1, "cp": 2}),
        ("tp2", {"dp": 1, "tp": 2}),
    ):
        r = measure("step_case", layout=layout, n_seqs=n_seqs, seq_len=seq_len, steps=steps)
        rows.append(
            [
                name,
                f"{r['tokens_per_s']:.0f}",
                f"{r['step_s'] * 1e3:.0f}",
                f"{r['forward_s'] * 1e3:.0f}",
                f"{r['backward_s'] * 1e3:.0f}",
                f"{r['grad_sync_s'] * 1e3:.0f}",
                f"{r['optimizer_s'] * 1e3:.0f}",
            ]
        )
    head = (
        f"### Train step of the embedded model (2 layers, hidden 128, vocab 512): "
        f"{n_seqs} x {seq_len} tokens, one thread per rank, median of {steps} steps\n\n"
        "backward = forward/backward minus forward and the DP/CP gradient all-reduce; TP "
        "and CP communication inside the layers is counted in forward and backward.\n\n"
    )
    return head + _table(
        [
            "layout",
            "tokens/s",
            "step ms",
            "forward ms",
            "backward ms",
            "grad sync ms",
            "optimizer ms",
        ],
        rows,
    )


def section_wire(quick: bool) -> str:
    n_seqs, seq_len = (64, 1024) if quick else (256, 4096)
    rows = []
    for encoding in ("json", "binary", "binary+zlib"):
        r = measure("wire_case", "api_cases", encoding=encoding, n_seqs=n_seqs, seq_len=seq_len,
                    repeats=3)  # fmt: skip
        rows.append(
            [
                encoding,
                f"{r['body_MB']:.1f}",
                f"{r['encode_s'] * 1e3:.0f}",
                f"{r['decode_s'] * 1e3:.1f}",
                f"{r['raw_MB'] / r['decode_s']:.0f}",
                f"{r['raw_MB'] / (r['encode_s'] + r['decode_s']):.0f}",
            ]
        )
    head = (
        f"### Wire format: {n_seqs} x {seq_len} = {n_seqs * seq_len / 2**20:.2f}M-token PPO batch "
        "(tokens, loss mask, advantages, old log-probs)\n\n"
        "encode: numpy arrays per sequence to the request body; decode+validate: the body to "
        "a validated `TrainBatchRequest` (numpy columns, checked vectorised: lengths, 0/1 masks, "
        "finite floats, dtypes, token ids against a 151,936-token vocabulary, lengths against "
        "the model's maximum). MB/s counts the batch's raw numeric bytes (int64 tokens, uint8 "
        "mask, float32 floats) per second. Target: decode+validate >= 1000 MB/s on the binary "
        "row. Best of 3.\n\n"
    )
    return head + _table(
        ["encoding", "body MB", "encode ms", "decode+validate ms", "decode+validate MB/s",
         "encode+decode MB/s"],
        rows,
    )  # fmt: skip


def section_gateway(quick: bool) -> str:
    n_seqs, seq_len, steps = (16, 1024, 2) if quick else (64, 1024, 5)
    direct = measure("direct_step_case", "api_cases", n_seqs=n_seqs, seq_len=seq_len, steps=steps)
    served = measure(
        "gateway_case", "api_cases", n_seqs=n_seqs, seq_len=seq_len, steps=steps,
        trivial=50 if quick else 300,
    )  # fmt: skip
    ratio = served["step_s"] / direct["step_s"]
    inside = served["step_s"] - served["outside_engine_s"]
    rows = [
        ["direct engine call in one process (plan + step)", f"{direct['step_s'] * 1e3:.0f}",
         "1.00", "-"],
        ["through the gateway (SDK, HTTP, Serve, controller, rank)",
         f"{served['step_s'] * 1e3:.0f}", f"{ratio:.3f}", "< 1.10"],
        ["... of which outside the engine (client, gateway, controller, Ray)",
         f"{served['outside_engine_s'] * 1e3:.0f}",
         f"{served['step_s'] / inside:.3f} of the in-service engine time", "< 1.10"],
    ]  # fmt: skip
    trivial = _table(
        ["trivial call", "p50 ms", "p99 ms"],
        [
            ["GET /v1/health (gateway only)", f"{served['health_p50_ms']:.1f}",
             f"{served['health_p99_ms']:.1f}"],
            ["eval_batch of 3 tokens (controller + rank)", f"{served['tiny_eval_p50_ms']:.1f}",
             f"{served['tiny_eval_p99_ms']:.1f}"],
        ],
    )  # fmt: skip
    head = (
        f"### Gateway overhead: train_batch of {n_seqs} x {seq_len} = "
        f"{n_seqs * seq_len // 1024}K tokens on the embedded model, dp=1, one thread, median of "
        f"{steps} steps\n\n"
        "The direct call and the rank inside the service run the same engine code on one "
        "thread; on this 2-core machine the rank shares the cores with Ray's daemons, so its "
        "compute time varies by about 10% from run to run. The last row separates what the "
        "service adds (per-call time outside the engine, from the step's own timings).\n\n"
    )
    return head + _table(["path", "ms", "ratio", "target"], rows) + "\n\n" + trivial


def section_load(quick: bool) -> str:
    duration, clients = (15.0, 4) if quick else (60.0, 8)
    r: Any = measure("load_case", "api_cases", duration_s=duration, clients=clients)
    rows = [
        [kind, str(r[kind]["n"]), f"{r[kind]['p50_ms']:.0f}", f"{r[kind]['p95_ms']:.0f}",
         f"{r[kind]['p99_ms']:.0f}"]
        for kind in ("train_batch", "eval_batch", "logprobs") if kind in r
    ]  # fmt: skip
    errors = ", ".join(f"{k}: {n}" for k, n in sorted(r["errors"].items())) or "none"
    head = (
        f"### Load run: {clients} concurrent clients for {duration:.0f} s against `trainctl "
        "serve` (dp=2), each call a random train_batch, eval_batch or logprobs of 4 sequences "
        "of 16-255 tokens; no client retries\n\n"
        f"served {r['served']} requests ({r['served'] / duration:.1f}/s), {r['steps']} optimizer "
        f"steps; errors by type: {errors}; 5xx: {r['errors_5xx']} (target 0)\n\n"
    )
    return head + _table(["call", "served", "p50 ms", "p95 ms", "p99 ms"], rows)


SECTIONS: dict[str, Callable[[bool], str]] = {
    "step": section_step,
    "wire": section_wire,
    "gateway": section_gateway,
    "load": section_load,
    "logprob": section_logprob,
    "fused_head": section_fused_head,
    "recompute": section_recompute,
    "sequence_parallel": section_sequence_parallel,
    "tree": section_tree,
    "state_bytes": section_state_bytes,
    "cp_loss": section_cp_loss,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import importlib

        job = json.loads(args.child)
        module = importlib.import_module(f"bench.{job.get('module', 'cases')}")
        print(json.dumps(getattr(module, job["fn"])(**job["kwargs"])))
        return 0
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {_cpus()} CPUs, torch {_torch_version()}, CPU"
    for name in args.only.split(","):
        text = SECTIONS[name](args.quick)
        print(text + "\n", flush=True)
        if not args.quick:
            SECTION_DIR.mkdir(exist_ok=True)
            (SECTION_DIR / f"{name}.md").write_text(f"{text}\n\n_Measured {stamp}; {machine}._\n")
    if not args.quick:
        sections = [SECTION_DIR / f"{n}.md" for n in SECTIONS]
        body = "\n".join(f.read_text() for f in sections if f.is_file())
        RESULTS.write_text(f"## Benchmarks\n\n{body}")
        print(f"wrote {RESULTS}")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
