"""The GPU benchmark: one train step of a Qwen3-0.6B-shaped model on one GPU, trainctl's
engine in process against a ladder of transformers configurations, behind a correctness gate.

    python bench/gpu.py                 # on a GPU: the table, bench/results/gpu.md and gpu.json
    python bench/gpu.py --smoke --out D # anywhere (CPU too): a tiny model, every code path

**Same start, same batch.** A child process writes one Hugging Face checkpoint (random
weights of a fixed seed, bf16); every side loads it (trainctl through ``init_hf``) and takes
the same token ids, loss (the token mean over the batch's predicted tokens), clipping (1.0)
and AdamW hyper-parameters.

**The gate** (``bench/gpu_gate.py``): each row's step-1 loss and gradient norm against the
reference row's (transformers with fp32 masters), and its loss falling over the steps. A row
that fails is printed with its reason and without numbers, and the run exits non-zero.
``--fault skip-layer-backward`` makes trainctl's step skip its first layer's backward, to show
that the gate catches a step that does less work.

**Rows**, each measured in a fresh process (its peak memory is its own) in the order given,
one shape after another: trainctl (``workers/control/inprocess.py``: the service's step code,
bf16 parameters, fp32 main gradients and AdamW masters, the fused LM head, the batch as one
packed micro-batch; its timed region includes the host's planning and packing) and the
transformers ladder (``bench/gpu_baselines.py``), each at the largest micro-batch of
``--micro-tokens`` that fits. ``--trainctl-variants`` adds trainctl rows that differ from the
default configuration in named ``EngineConfig`` fields (by default ``norm_kernel=eager``: what
the compiled RMSNorm buys; and ``recompute=elementwise``: what recomputing the norms and the
SwiGLU product costs), gated like every row, their speed-up read against the default row.
Shapes: packed rows (``--tokens`` in sequences of ``--seq-len``) and a ragged row (``ragged``
in ``bench/gpu_batches.py``: log-normal lengths between 128 and 4,096, 43 distinct at 32K,
which takes the varlen attention path).

Each cell is the median of ``--steps`` steps after ``--warmup``, with the minimum and maximum.
FLOPs per step: ``6 * N * tokens`` for the matrix products (``N``: every parameter but an
untied input embedding) plus ``6 * layers * heads * head_dim * L^2`` per sequence of length
``L``, causal attention's half square: the **bench** convention; the **PaLM** convention
(nanochat, torchtitan) counts the whole square. MFU divides by the card's dense bf16 peak,
looked up by its exact name (``bench/gpu_provenance.py``); a card not in that table gets none.
These are engine steps in process: the GPU machine has no Ray, so no service around them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_batches, gpu_gate, gpu_provenance  # noqa: E402
from bench.gpu_baselines import BY_NAME, LADDER  # noqa: E402
from bench.gpu_table import Table, no_numbers  # noqa: E402

RESULTS = ROOT / "bench" / "results"

QWEN3_06B: dict[str, Any] = dict(
    family="qwen3", vocab_size=151936, hidden_size=1024, ffn_hidden_size=3072, num_layers=28,
    num_attention_heads=16, num_query_groups=8, head_dim=128, tie_embeddings=True,
    rotary_base=1000000, norm_eps=1e-6,
)  # fmt: skip
TINY: dict[str, Any] = dict(
    family="qwen3", vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2,
    num_attention_heads=4, num_query_groups=2, head_dim=16, tie_embeddings=True,
    rotary_base=1000000, norm_eps=1e-6,
)  # fmt: skip
OPTIMIZER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, clip_grad=1.0)
"""One set of AdamW hyper-parameters for every side."""
REFERENCE = "hf_amp"
FAULTS = ("skip-layer-backward",)


def write_checkpoint(model: dict[str, Any], max_len: int, directory: str) -> dict[str, Any]:
    """A Hugging Face Qwen3 checkpoint of ``model``'s shape: transformers' own initialisation
    under seed 0, saved in bf16 (so fp32 and bf16 sides start from the same values)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"],
        intermediate_size=model["ffn_hidden_size"], num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"], head_dim=model["head_dim"],
        tie_word_embeddings=model["tie_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": model["rotary_base"]},
        rms_norm_eps=model["norm_eps"], max_position_embeddings=max_len,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    net.to(torch.bfloat16).save_pretrained(directory)
    return {"parameters": sum(p.numel() for p in net.parameters())}


def _skip_backward_of_first_layer(chunk: Any) -> None:
    """The fault ``--fault skip-layer-backward`` injects: the first decoder layer's output
    leaves the autograd graph, so that layer (and the embedding's input side) gets no
    gradient while the forward, the loss and the speed stay as they were."""
    layer = next(m for name, m in chunk.named_modules() if name.endswith("decoder.layers.0"))

    def detach(_m: Any, _inputs: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (out[0].detach().requires_grad_(), *out[1:])
        return out.detach().requires_grad_()

    layer.register_forward_hook(detach)


def trainctl_step(
    model: dict[str, Any],
    checkpoint: str,
    sequences: list[list[int]],
    steps: int,
    warmup: int,
    fault: str | None = None,
    profile: str | None = None,
    engine_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """trainctl's step on ``sequences``; ``engine_overrides``: the ``EngineConfig`` fields in
    which a variant row differs from the default configuration."""
    import torch

    from bench.gpu_timing import Run, timed_run
    from trainctl.api import TrainBatchRequest
    from trainctl.workers.control.inprocess import InProcessEngine
    from trainctl.workers.engine.config import EngineConfig
    from trainctl.workers.ops import packed_attention

    lengths = [len(s) for s in sequences]
    cuda = torch.cuda.is_available()
    cfg = EngineConfig.from_dict(
        {
            "model": {**model, "max_seq_len": max(lengths)},
            "precision": "bf16" if cuda else "fp32",
            "max_tokens_per_microbatch": sum(lengths),
            "packing": "flat",
            "init_hf": checkpoint,
            "optimizer": OPTIMIZER,
            **(engine_overrides or {}),
        }
    )
    engine = InProcessEngine(cfg)
    if fault == "skip-layer-backward":
        _skip_backward_of_first_layer(engine.engine.chunks[0])
    req = TrainBatchRequest(sequences=[{"tokens": t} for t in sequences])
    run = Run()

    def step() -> None:
        result = engine.train_batch(req)
        run.losses.append(result.loss)
        run.grad_norms.append(result.metrics["grad_norm:value"])

    try:
        timed_run(run, step, steps, warmup, profile)
    except Exception as e:  # the rank's OutOfMemoryError arrives wrapped in a WorkerError
        if "OutOfMemoryError" in str(e):
            return {"oom": True}
        raise
    path = "runs"
    many_runs = len(packed_attention.equal_runs(lengths)) > packed_attention.VARLEN_MIN_RUNS
    dev = "cuda" if cuda else "cpu"
    probe = torch.empty(0, device=dev, dtype=torch.bfloat16)
    if many_runs and packed_attention.varlen_usable(probe, 0.0):
        path = "varlen"
    return {
        **run.summary(),
        "config": f"trainctl ({engine.cfg.precision}, fp32 masters, fused head chunk "
        f"{engine.cfg.resolved_chunk_size(cuda=cuda)}, RMSNorm "
        f"{engine.cfg.resolved_norm_kernel(cuda=cuda)})"
        + (f", variant: {variant_label(engine_overrides)}" if engine_overrides else ""),
        "micro_tokens": sum(lengths),
        "attention": f"{path}: {run.kernels}",
    }


def _child(job: dict[str, Any]) -> dict[str, Any]:
    from bench.gpu_baselines import transformers_step

    fns = {
        "checkpoint": write_checkpoint, "trainctl": trainctl_step,
        "transformers": transformers_step,
    }  # fmt: skip
    return fns[job.pop("fn")](**job)  # type: ignore[no-any-return,operator]


def measure(timeout_s: float, label: str, **job: Any) -> dict[str, Any]:
    """One job in a fresh process; its failure is a result (``{"failed": why}``), so one
    failing cell does not cost the rest of the table."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": gpu_provenance.ALLOCATOR, **os.environ}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child"], input=json.dumps(job),
            capture_output=True, text=True, cwd=ROOT, timeout=timeout_s, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        why = f"no result in {timeout_s:.0f} s"
        print(f"FAILED: {label}: {why}", file=sys.stderr, flush=True)
        return {"failed": why}
    if proc.returncode:
        oom = "OutOfMemory" in proc.stderr
        print(f"FAILED: {label}:\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
        return {"oom": True} if oom else {"failed": proc.stderr.strip().splitlines()[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _shapes(a: argparse.Namespace) -> list[tuple[str, list[int], list[str]]]:
    """(label, lengths, ladder) per row of the table."""
    ladder = [n for n in a.ladder.split(",") if n]
    out = [
        (f"{t // a.seq_len} x {a.seq_len}", gpu_batches.packed(t, a.seq_len), ladder)
        for t in (int(x) for x in a.tokens.split(",") if x)
    ]
    if a.ragged:
        if a.ragged == "lognormal":
            lengths = gpu_batches.ragged(a.ragged_tokens, a.ragged_low, a.ragged_high)
            label = (
                f"ragged: {len(lengths)} x {a.ragged_low}-{a.ragged_high} "
                f"({len(set(lengths))} lengths)"
            )
        else:
            lengths = gpu_batches.parse(a.ragged)
            label = a.ragged.replace("x", " x ").replace("+", " + ")
        out.append((label, lengths, [n for n in a.ragged_ladder.split(",") if n]))
    return out


def overrides(variant: str) -> dict[str, Any]:
    """``EngineConfig`` fields of a ``--trainctl-variants`` entry: ``field=value`` pairs joined
    by ``+`` (a value is read as JSON where it parses, else as a string)."""
    out: dict[str, Any] = {}
    for pair in variant.split("+"):
        field, sep, value = pair.partition("=")
        if not sep or not field:
            raise SystemExit(f"--trainctl-variants: {pair!r} is not field=value")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def variant_label(fields: dict[str, Any]) -> str:
    """A variant's fields as the table names them: ``norm_kernel=eager``."""
    return "+".join(f"{k}={v}" for k, v in fields.items())


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32768", help="packed batch sizes, comma-separated")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per packed sequence")
    ap.add_argument(
        "--ragged", default="lognormal",
        help="the ragged row: 'lognormal' (bench/gpu_batches.ragged), a spec such as "
        "'32x512+4x4096', or '' for none",
    )  # fmt: skip
    ap.add_argument("--ragged-tokens", type=int, default=32768)
    ap.add_argument("--ragged-low", type=int, default=128)
    ap.add_argument("--ragged-high", type=int, default=4096)
    names = ",".join(b.name for b in LADDER)
    ap.add_argument(
        "--ladder", default=names, help=f"transformers rows of a packed batch ({names})"
    )
    ap.add_argument(
        "--ragged-ladder", default=REFERENCE,
        help="transformers rows of the ragged batch (length buckets: one micro-batch per length)",
    )  # fmt: skip
    ap.add_argument(
        "--trainctl-variants", default="norm_kernel=eager,recompute=elementwise",
        help="trainctl rows beside the default configuration, comma-separated, each "
        "EngineConfig fields as field=value joined by '+'; '' for none",
    )  # fmt: skip
    ap.add_argument(
        "--micro-tokens", default="32768,16384,8192,4096",
        help="transformers micro-batch sizes to try, largest first",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median, min, max)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--smoke", action="store_true", help="a tiny model anywhere (CPU too)")
    ap.add_argument("--fault", choices=FAULTS, help="break trainctl's step (the gate must fail)")
    ap.add_argument("--out", type=Path, help="result files here (default: bench/results on a GPU)")
    ap.add_argument("--child-timeout", type=float, default=300, help="seconds per measurement")
    ap.add_argument(
        "--profile", metavar="DIR",
        help="instead of the table: profile trainctl's step and each --ladder row's at the "
        "first packed size, each one's kernel table (by self device time) into DIR",
    )  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the job on stdin
    a = ap.parse_args(argv)
    if a.smoke:
        a.tokens, a.seq_len, a.ragged_tokens, a.ragged_low, a.ragged_high = (
            "1024",
            256,
            4096,
            16,
            512,
        )
        a.steps, a.warmup, a.micro_tokens = min(a.steps, 4), min(a.warmup, 1), "1024,512"
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(sys.stdin.read()))))
        return 0
    with tempfile.TemporaryDirectory(prefix="trainctl-gpu-bench-") as workdir:
        return _run(a, str(Path(workdir) / "checkpoint"))


def _jobs(
    a: argparse.Namespace,
    model: dict[str, Any],
    checkpoint: str,
    lengths: list[int],
    ladder: list[str],
    warmup: int,
) -> dict[str, dict[str, Any]]:
    """The measurements of one batch: trainctl's step, then each rung of ``ladder``."""
    common = dict(
        checkpoint=checkpoint, sequences=gpu_batches.sequences(model["vocab_size"], lengths),
        steps=a.steps, warmup=warmup,
    )  # fmt: skip
    micro = [int(x) for x in a.micro_tokens.split(",")]
    jobs = {"trainctl": dict(fn="trainctl", model=model, fault=a.fault, **common)}
    for variant in (v for v in a.trainctl_variants.split(",") if v):
        jobs[f"trainctl {variant}"] = dict(
            fn="trainctl", model=model, fault=a.fault, engine_overrides=overrides(variant),
            **common,
        )  # fmt: skip
    for name in ladder:
        jobs[name] = dict(
            fn="transformers", baseline=name, optimizer=OPTIMIZER, micro_tokens=micro, **common
        )
    return jobs


def _run(a: argparse.Namespace, checkpoint: str) -> int:
    import torch

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", gpu_provenance.ALLOCATOR)
    cuda = torch.cuda.is_available()  # NVML only: this process makes no CUDA context
    model = TINY if a.smoke else QWEN3_06B
    out = a.out or (RESULTS if cuda and not a.smoke else None)
    provenance = gpu_provenance.record()
    shapes = _shapes(a)
    timeout = a.child_timeout
    made = measure(
        timeout, "checkpoint", fn="checkpoint", model=model,
        max_len=max(max(lengths) for _, lengths, _ in shapes), directory=checkpoint,
    )  # fmt: skip
    if "failed" in made:
        print(f"no checkpoint: {made['failed']}", file=sys.stderr)
        return 1
    if a.profile:
        where = Path(a.profile)
        where.mkdir(parents=True, exist_ok=True)
        _, lengths, ladder = shapes[0]
        failed = 0
        for name, job in _jobs(a, model, checkpoint, lengths, ladder, warmup=1).items():
            path = where / f"profile_{re.sub(r'[^a-z0-9]+', '_', name)}_{sum(lengths)}.txt"
            got = measure(timeout, name, profile=str(path), **job)
            failed += no_numbers(got) is not None
            if path.exists():
                print(f"## {name}, {sum(lengths):,} tokens: {got.get('step_s', 0):.3f} s a step")
                print(path.read_text(), flush=True)
        return 1 if failed else 0

    device = provenance["software"]["device"]
    table = Table(model, gpu_provenance.peak_flops(device), int(made["parameters"]), REFERENCE)
    raw: dict[str, Any] = {}
    for label, lengths, ladder in shapes:
        cells: dict[str, dict[str, Any]] = {}
        for name, job in _jobs(a, model, checkpoint, lengths, ladder, a.warmup).items():
            if name in BY_NAME and BY_NAME[name].needs_cuda and not cuda:
                cells[name] = {"skipped": BY_NAME[name].needs_cuda}
            else:
                cells[name] = measure(timeout, f"{name} {label}", **job)
        table.add(label, lengths, cells)
        raw[label] = {"lengths": lengths, "cells": cells}
    provenance["card_after"] = gpu_provenance.card()
    unmeasured = [
        f"{label}: {name}: {why}"
        for label, shape in raw.items()
        for name, cell in shape["cells"].items()
        if (why := no_numbers(cell)) and not why.startswith("skipped")
    ]
    text = table.text(_caption(a, table, device), provenance)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.md").write_text(text + "\n")
        record = {"provenance": provenance, "args": vars(a), "rows": raw}
        (out / "gpu.json").write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}")
    if table.failed_gate:
        print("FAILED THE GATE:\n" + "\n".join(table.failed_gate), file=sys.stderr)
    if unmeasured:
        print("NOT MEASURED:\n" + "\n".join(unmeasured), file=sys.stderr)
    return 1 if table.failed_gate or unmeasured else 0


def _caption(a: argparse.Namespace, table: Table, device: str) -> str:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{device}, {date}: engine steps in process (no Ray, no service), "
        f"{'a tiny' if a.smoke else 'a Qwen3-0.6B-shaped'} model ({table.params / 1e6:.1f}M "
        "parameters) from one random bf16 checkpoint, the same batch and AdamW "
        f"(lr {OPTIMIZER['lr']}, clip {OPTIMIZER['clip_grad']}) on every side; each cell the "
        f"median of {a.steps} steps after {a.warmup} warm-up steps, [min, max] beside it. Gate: "
        f"step-1 loss within {gpu_gate.LOSS_ABS} and grad norm within "
        f"{100 * gpu_gate.GRAD_NORM_REL:.0f}% of {BY_NAME[REFERENCE].label}, and the loss "
        "falling. 'trainctl speed-up' is this row's step time over trainctl's."
    )


if __name__ == "__main__":
    sys.exit(main())
