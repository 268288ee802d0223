"""The staged GPU probe: each part of the train step timed alone, in variants, at the
Qwen3-0.6B shape, so a short GPU lease says where the step's time goes and which variant wins.

    python bench/gpu_probe.py --out DIR          # on a GPU: about 3 minutes on an H200
    python bench/gpu_probe.py --smoke --out DIR  # anywhere, CPU too: tiny sizes (CI runs it)
    python bench/gpu_probe.py --only attention,head

Sections, each written to ``DIR/probe.json`` as soon as it finishes (a lease that ends early
keeps what ran), and printed as a table:

* ``env``: torch, the device, the varlen attention signature, whether ``addmm`` accumulates
  bf16 products into fp32 here;
* ``attention``: one layer's core attention, forward + backward, at 4 x 4096 and 32 x 512 tokens
  (16 query / 8 key-value heads of 128, bf16): the per-sequence slicing with K/V copies it
  replaced (``slices``), one batched call per run of equal lengths with grouped heads native
  (``runs``) or copied (``runs_copy``), and varlen flash attention (``varlen``); the SDPA kernel
  each ran, and its output against ``runs``;
* ``optimizer``: torch AdamW foreach against fused on the model's tensors (fp32 masters), the
  old per-tensor fp64 gradient norm against ``NormPlan``, the master-to-model copy loop against
  one ``_foreach_copy_``;
* ``elementwise``: rotary embedding eager against compiled, SwiGLU eager against megatron's
  compiled ``bias_swiglu_impl`` (when megatron-core is importable);
* ``head``: the LM head + log-prob + backward at 16K and 32K tokens: a full-logit
  cross-entropy (what transformers does), the fused head with eager passes (each pass widens
  the chunk to fp32) and with compiled passes, at chunks of 1,024 and 4,096, and the compiled
  head with the loss's gradient taken in the forward pass (``fused_head_loss``).

Times are the median of ``--reps`` CUDA-event-timed runs after warm-up, on fresh random inputs
(never zeros). Each variant's output is checked against a reference before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden=1024, heads=16, groups=8, head_dim=128, ffn=3072, layers=28, vocab=151936)
SMOKE = dict(hidden=64, heads=4, groups=2, head_dim=16, ffn=128, layers=2, vocab=2048)


class Probe:
    """Times callables and keeps the results, writing them out after every section."""

    def __init__(self, out: Path, reps: int, device: torch.device) -> None:
        self.out, self.reps, self.device = out, reps, device
        self.results: dict[str, Any] = {}
        out.mkdir(parents=True, exist_ok=True)

    def time_ms(self, fn: Callable[[], Any], warmup: int = 2) -> float:
        """Median milliseconds of ``fn`` over ``reps`` runs (device events on CUDA)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception as e:  # one failing section must not cost the others
            self.results[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        self.results[name]["section_s"] = round(time.perf_counter() - t0, 1)
        (self.out / "probe.json").write_text(json.dumps(self.results, indent=1, default=str))
        print(f"## {name} ({self.results[name]['section_s']} s)")
        _print(self.results[name])
        sys.stdout.flush()


def _print(d: dict[str, Any], indent: str = "") -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            print(f"{indent}{k}:")
            _print(v, indent + "  ")
        else:
            print(f"{indent}{k}: {v}")


def _kernels(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Names of the device kernels one run of ``fn`` launched that look like attention."""
    if device.type != "cuda":
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")
    return sorted(n[:80] for n in names if any(k in n.lower() for k in keys))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# -- env ------------------------------------------------------------------------------------


def env(p: Probe) -> dict[str, Any]:
    import inspect

    out: dict[str, Any] = {"torch": torch.__version__, "device": str(p.device)}
    if p.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as e:
        out["varlen_signature"] = f"none ({e})"
    a = torch.randn(64, 32, device=p.device, dtype=torch.bfloat16)
    c = torch.zeros(32, 32, device=p.device)
    try:
        torch.addmm(c, a.t(), a, out_dtype=torch.float32, out=c)
        out["addmm_out_dtype_fp32"] = _rel(c, a.t().float() @ a.float()) < 1e-2
    except (RuntimeError, TypeError) as e:
        out["addmm_out_dtype_fp32"] = f"no: {str(e)[:80]}"
    return out


# -- attention ------------------------------------------------------------------------------


def _slices_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float
) -> torch.Tensor:
    """The attention ``runs`` replaced: a slice per sequence, K/V copied to the query heads,
    outputs concatenated."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _attention_variant(name: str, cu: list[int], cu_dev: torch.Tensor, scale: float) -> Any:
    from trainctl.workers.ops import packed_attention as pa

    if name == "slices":
        return lambda q, k, v: _slices_reference(q, k, v, cu, scale)
    backend = "varlen" if name == "varlen" else "runs"
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return lambda q, k, v: pa.packed_attention(
        q, k, v, cu, scale=scale, cu_device=cu_dev, max_len=longest, backend=backend
    )


def _attention_pack(p: Probe, shape: dict[str, int], lengths: list[int]) -> dict[str, Any]:
    """One pack: each variant checked against ``slices``, then timed (forward + backward)."""
    from trainctl.workers.ops import packed_attention as pa

    dt = torch.bfloat16 if p.device.type == "cuda" else torch.float32
    hn, nq, ng = shape["head_dim"], shape["heads"], shape["groups"]
    cu = [0, *itertools.accumulate(lengths)]
    t, scale = cu[-1], hn**-0.5
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=p.device)

    def fresh() -> tuple[torch.Tensor, ...]:
        q = torch.randn(t, nq, hn, device=p.device, dtype=dt, requires_grad=True)
        k = torch.randn(t, ng, hn, device=p.device, dtype=dt, requires_grad=True)
        v = torch.randn(t, ng, hn, device=p.device, dtype=dt, requires_grad=True)
        return q, k, v, torch.randn(t, nq, hn, device=p.device, dtype=dt)

    names = ["slices", "runs", "runs_copy"]
    if pa.varlen_usable(torch.empty(0, device=p.device, dtype=dt), 0.0):
        names.append("varlen")
    q0, k0, v0, _ = fresh()
    ref = _slices_reference(q0, k0, v0, cu, scale)
    row: dict[str, Any] = {"tokens": t, "sequences": len(lengths)}
    for name in names:
        native = pa.gqa_native
        if name == "runs_copy":
            pa.gqa_native = lambda q, masked: False  # type: ignore[assignment]
        try:
            fn = _attention_variant(name, cu, cu_dev, scale)
            row[f"{name}_vs_slices"] = f"{_rel(fn(q0, k0, v0).detach(), ref.detach()):.1e}"
            q, k, v, g = fresh()

            def step(fn: Any = fn, q: Any = q, k: Any = k, v: Any = v, g: Any = g) -> None:
                torch.autograd.grad(fn(q, k, v), (q, k, v), g)

            row[f"{name}_ms"] = round(p.time_ms(step), 3)
            kernels = _kernels(step, p.device)
            if kernels:
                row[f"{name}_kernels"] = ", ".join(kernels)[:300]
        except Exception as e:
            row[f"{name}_ms"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        finally:
            pa.gqa_native = native  # type: ignore[assignment]
    return row


def attention(p: Probe, shape: dict[str, int], packs: dict[str, list[int]]) -> dict[str, Any]:
    return {label: _attention_pack(p, shape, lengths) for label, lengths in packs.items()}


# -- optimizer ------------------------------------------------------------------------------


def _model_tensors(shape: dict[str, int], device: torch.device) -> list[torch.Tensor]:
    """The parameter shapes of the model (fp32), one tensor each, random."""
    h, f, nq, ng, hn = (
        shape["hidden"],
        shape["ffn"],
        shape["heads"],
        shape["groups"],
        shape["head_dim"],
    )
    per_layer = [
        (h,),
        ((nq + 2 * ng) * hn, h),
        (h, nq * hn),
        (hn,),
        (hn,),
        (h,),
        (2 * f, h),
        (h, f),
    ]
    shapes = [(shape["vocab"], h), (h,)] + per_layer * shape["layers"]
    return [torch.randn(s, device=device) * 0.02 for s in shapes]


def optimizer(p: Probe, shape: dict[str, int]) -> dict[str, Any]:
    from trainctl.workers.engine.optim_phase import NormPlan

    params = [t.requires_grad_() for t in _model_tensors(shape, p.device)]
    for t in params:
        t.grad = torch.randn_like(t) * 1e-3
    out: dict[str, Any] = {
        "tensors": len(params),
        "parameters_M": round(sum(t.numel() for t in params) / 1e6, 1),
    }
    for mode in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, lr=1e-5, **{mode: True})
        opt.step()  # state
        out[f"adamw_{mode}_ms"] = round(p.time_ms(opt.step), 3)
        del opt
    grads = [t.grad for t in params]

    def old_norm() -> float:
        sq = torch.zeros((), dtype=torch.float64, device=p.device)
        for g in grads:
            sq += g.double().pow(2).sum()
        return float(sq.sqrt())

    plan = NormPlan.build([(g, "dense") for g in grads], p.device, key=())

    def new_norm() -> float:
        dense, experts = plan.squares()
        return float((dense + experts).sqrt())

    out["norm_rel_diff"] = f"{abs(new_norm() - old_norm()) / old_norm():.1e}"
    out["norm_per_tensor_fp64_ms"] = round(p.time_ms(old_norm), 3)
    out["norm_plan_ms"] = round(p.time_ms(new_norm), 3)
    model = [t.detach().to(torch.bfloat16) for t in params]
    main = [t.detach() for t in params]

    def loop() -> None:
        for a, b in zip(model, main, strict=True):
            a.copy_(b)

    out["copy_loop_ms"] = round(p.time_ms(loop), 3)
    out["copy_foreach_ms"] = round(p.time_ms(lambda: torch._foreach_copy_(model, main)), 3)
    return out


# -- elementwise ----------------------------------------------------------------------------


def elementwise(p: Probe, shape: dict[str, int], tokens: int) -> dict[str, Any]:
    from trainctl.workers.ops.norm import compiled_rms_norm, rms_norm
    from trainctl.workers.ops.rope import (
        RotaryTables,
        apply_rope,
        compiled_norm_rope,
        compiled_rope,
        norm_rope,
    )

    dt = torch.bfloat16 if p.device.type == "cuda" else torch.float32
    hn, nq, ffn = shape["head_dim"], shape["heads"], shape["ffn"]
    out: dict[str, Any] = {"tokens": tokens}
    pos = torch.arange(tokens, device=p.device) % 4096
    inv = 1.0 / (1e6 ** (torch.arange(0, hn, 2, device=p.device).float() / hn))
    freqs = torch.outer(pos.float(), inv)
    tab = RotaryTables.of(torch.cat((freqs, freqs), -1)[:, None, :], dt)
    # The query as the engine gets it: a strided view of the fused q/k/v projection.
    ng = shape["groups"]
    qkv = torch.randn(tokens, ng, (nq // ng + 2) * hn, device=p.device, dtype=dt)
    x = qkv[..., : (nq // ng) * hn].reshape(tokens, nq, hn).requires_grad_()
    g = torch.randn(tokens, nq, hn, device=p.device, dtype=dt)
    w = (1.0 + 0.1 * torch.randn(hn, device=p.device)).to(dt).requires_grad_()
    variants_rope: dict[str, Callable[[], Any]] = {
        "rope_eager": lambda: apply_rope(x, tab.cos, tab.sin),
        "rope_compiled": lambda: compiled_rope()(x, tab.cos, tab.sin),
        "qknorm_rope_eager": lambda: norm_rope(x, w, 1e-6, tab.cos, tab.sin),
        "qknorm_rope_compiled": lambda: compiled_norm_rope()(x, w, 1e-6, tab.cos, tab.sin),
    }
    for name, fn in variants_rope.items():
        if name.endswith("compiled"):
            eager = variants_rope[name.replace("compiled", "eager")]
            out[f"{name}_vs_eager"] = f"{_rel(fn().detach(), eager().detach()):.1e}"
        out[f"{name}_ms"] = round(p.time_ms(lambda fn=fn: torch.autograd.grad(fn(), x, g)), 3)
    # The residual stream's norm (EngineConfig.norm_kernel), both gradients: the weight's is
    # the reduction over every token that eager CUDA runs slowly.
    h = torch.randn(tokens, 1, shape["hidden"], device=p.device, dtype=dt, requires_grad=True)
    hw = (1.0 + 0.1 * torch.randn(shape["hidden"], device=p.device)).to(dt).requires_grad_()
    gh = torch.randn_like(h)
    norms = {"eager": rms_norm, "compiled": compiled_rms_norm()}
    for name, norm in norms.items():
        if name != "eager":
            got, want = norm(h, hw, 1e-6), rms_norm(h, hw, 1e-6)
            out[f"rmsnorm_{name}_vs_eager"] = f"{_rel(got.detach(), want.detach()):.1e}"
        out[f"rmsnorm_{name}_ms"] = round(
            p.time_ms(lambda norm=norm: torch.autograd.grad(norm(h, hw, 1e-6), (h, hw), gh)), 3
        )
    y = torch.randn(tokens, 2 * ffn, device=p.device, dtype=dt, requires_grad=True)
    gy = torch.randn(tokens, ffn, device=p.device, dtype=dt)

    def swiglu_eager(y: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(y, 2, dim=-1)
        return F.silu(a) * b

    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"eager": swiglu_eager}
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        variants["megatron_fused"] = lambda y: bias_swiglu_impl(y, None)
    except Exception as e:  # megatron-core is carried as a wheel; the probe runs without it
        out["swiglu_megatron"] = f"not importable: {type(e).__name__}"
    for name, fn in variants.items():
        if name != "eager":
            out[f"swiglu_{name}_vs_eager"] = f"{_rel(fn(y), swiglu_eager(y)):.1e}"
        out[f"swiglu_{name}_ms"] = round(
            p.time_ms(lambda fn=fn: torch.autograd.grad(fn(y), y, gy)), 3
        )
    return out


# -- head -----------------------------------------------------------------------------------


def _head_size(p: Probe, w: torch.Tensor, n: int, chunks: list[int]) -> dict[str, Any]:
    """One size: the full-logit cross-entropy, then the fused head with each kind of pass and
    chunk; each log-prob checked against the cross-entropy's, each timed with its backward,
    each peak taken above what the inputs hold."""
    from trainctl.workers.ops import head_kernels
    from trainctl.workers.ops.fused_head import fused_head_logprob, fused_head_loss

    vocab, h_dim = w.shape
    row: dict[str, Any] = {}
    hid = torch.randn(n, h_dim, device=p.device, dtype=w.dtype, requires_grad=True)
    tgt = torch.randint(0, vocab, (n,), device=p.device)
    seed = torch.randn(n, device=p.device)

    def full_ce() -> None:
        lp = -F.cross_entropy((hid @ w.t()).float(), tgt, reduction="none")
        torch.autograd.grad((lp * seed).sum(), (hid, w))

    def fused(chunk: int) -> tuple[torch.Tensor, ...]:
        lp = fused_head_logprob(hid, w, tgt, chunk_size=chunk)
        return torch.autograd.grad((lp * seed).sum(), (hid, w))

    def share_of(lp: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return (lp * seed[a:b]).sum()

    def in_forward(chunk: int) -> tuple[torch.Tensor, ...]:
        share, _ = fused_head_loss(hid, w, tgt, share_of, chunk_size=chunk)
        return torch.autograd.grad(share, (hid, w))

    with torch.no_grad():
        ref = -F.cross_entropy((hid @ w.t()).float(), tgt, reduction="none")
    lp = -F.cross_entropy((hid @ w.t()).float(), tgt, reduction="none")
    ref_grads = torch.autograd.grad((lp * seed).sum(), (hid, w))
    del lp
    base = _allocated(p.device)
    try:
        row["full_ce_ms"] = round(p.time_ms(full_ce), 2)
        row["full_ce_peak_GiB"] = _peak(p.device, base)
    except torch.OutOfMemoryError:
        row["full_ce_ms"] = "OOM"
    for kind in ("eager", "compiled"):
        head_kernels.force_kernels(head_kernels.EAGER if kind == "eager" else head_kernels.COMPILED)
        try:
            for chunk in chunks:
                key = f"fused_{kind}_c{chunk}"
                with torch.no_grad():
                    got = fused_head_logprob(hid, w, tgt, chunk_size=chunk)
                row[f"{key}_lp_vs_ce"] = f"{float((got - ref).abs().max()):.1e}"
                check = chunk == chunks[0]
                _measure(p, row, key, lambda c=chunk: fused(c), ref_grads if check else None)
            if kind == "compiled":  # the gradient taken in the forward pass
                for chunk in chunks:
                    check = chunk == chunks[0]
                    step = lambda c=chunk: in_forward(c)  # noqa: E731
                    _measure(
                        p, row, f"loss_in_forward_c{chunk}", step, ref_grads if check else None
                    )
        finally:
            head_kernels.force_kernels(None)
    return row


def _measure(
    p: Probe, row: dict[str, Any], key: str, step: Callable[[], Any], ref: Any = None
) -> None:
    """Time ``step`` (a forward and backward returning its gradients) and its peak into
    ``row``; with ``ref``, first its gradients against those (relative error each)."""
    if ref is not None:
        rel = [_rel(a, b) for a, b in zip(step(), ref, strict=True)]
        row[f"{key}_grads_vs_ce"] = " / ".join(f"{r:.1e}" for r in rel)
    base = _allocated(p.device)
    row[f"{key}_ms"] = round(p.time_ms(step), 2)
    row[f"{key}_peak_GiB"] = _peak(p.device, base)


def head(p: Probe, shape: dict[str, int], sizes: list[int], chunks: list[int]) -> dict[str, Any]:
    dt = torch.bfloat16 if p.device.type == "cuda" else torch.float32
    w = (torch.randn(shape["vocab"], shape["hidden"], device=p.device) * 0.02).to(dt)
    return {f"{n}_tokens": _head_size(p, w.requires_grad_(), n, chunks) for n in sizes}


def _allocated(device: torch.device) -> int:
    """Bytes allocated now; resets the peak counter to it (CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: torch.device, base: int) -> float | None:
    """GiB of the peak above ``base`` (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return None
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-results")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device (CI)")
    ap.add_argument("--only", default="env,attention,optimizer,elementwise,head")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE if a.smoke else SHAPE
    if a.smoke:
        packs = {"4x64": [64] * 4, "8x16+2x64": [16] * 8 + [64] * 2}
        sizes, chunks, tokens, reps = [512], [256], 512, min(a.reps, 3)
    else:
        packs = {
            "4x4096": [4096] * 4,
            "32x512": [512] * 32,
            "32x512+4x4096": [512] * 32 + [4096] * 4,
        }
        sizes, chunks, tokens, reps = [16384, 32768], [1024, 4096], 32768, a.reps
    p = Probe(a.out, reps, device)
    stages: dict[str, Callable[[], dict[str, Any]]] = {
        "env": lambda: env(p),
        "attention": lambda: attention(p, shape, packs),
        "optimizer": lambda: optimizer(p, shape),
        "elementwise": lambda: elementwise(p, shape, tokens),
        "head": lambda: head(p, shape, sizes, chunks),
    }
    for name in a.only.split(","):
        p.section(name, stages[name])
    failed = [k for k, v in p.results.items() if "error" in v]
    print(f"probe: {len(p.results) - len(failed)} sections ok, failed: {failed or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
