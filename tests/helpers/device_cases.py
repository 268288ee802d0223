"""The GPU tier's cases, on whatever device this process has: the in-process engine
(``workers/control/inprocess.py``) on CUDA when present, else on the CPU.

``tests/gpu`` runs them on a GPU; ``tests/distributed/test_inprocess.py`` runs the same code on
the CPU in a rank-pool process, so the GPU tier's code is exercised by every CI run even though
CI has no GPU. Each case returns numbers; the tests decide what they must be.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from helpers.hf_models import tiny_model

GRPO_PROMPT, GRPO_RESPONSES = 40, (24, 31, 9, 17)


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def batch(
    vocab: int, lengths: tuple[int, ...] = (48, 33, 64, 20), seed: int = 0
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def grpo_group(vocab: int, seed: int = 0) -> list[list[int]]:
    """One prompt, several responses: a trie with one shared prefix."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, GRPO_PROMPT).tolist()
    return [prompt + rng.integers(0, vocab, n).tolist() for n in GRPO_RESPONSES]


def _engine(**cfg: Any) -> Any:
    from trainctl.workers.control.inprocess import InProcessEngine
    from trainctl.workers.engine.config import EngineConfig

    return InProcessEngine(EngineConfig.from_dict(cfg))


@dataclass
class Parity:
    ours: float
    """max over tokens of |ours - transformers fp32| / max(1, |transformers fp32|)"""
    transformers_same_precision: float
    """the same for transformers at the run's precision (0 in fp32)"""
    tokens: int


def hf_logprob_parity(directory: Path, precision: str, **shape: Any) -> Parity:
    """A random Qwen3-shaped model saved by transformers, imported into the engine at
    ``precision``; every token's log-prob against transformers' fp32 forward of the same
    weights on the same device (and, for bf16, transformers' own bf16 forward)."""
    from trainctl.api import LogProbsRequest
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ModelConfig

    ref = tiny_model("qwen3", directory, **shape).to(device())
    model = hf.model_config_from_hf(hf.read_config(directory), ModelConfig())
    seqs = batch(model.vocab_size)
    engine = _engine(
        model=dataclasses.asdict(model), init_hf=str(directory), precision=precision,
        max_tokens_per_microbatch=max(256, model.max_seq_len),
    )  # fmt: skip
    try:
        got = engine.logprobs(LogProbsRequest(sequences=[{"tokens": t} for t in seqs]))
    finally:
        engine.close()
    want = _hf_logprobs(ref, seqs)
    ours = _worst(got.logprobs, want)
    same = 0.0
    if precision == "bf16":
        same = _worst(_hf_logprobs(ref.to(torch.bfloat16), seqs), want)
    return Parity(ours=ours, transformers_same_precision=same, tokens=sum(map(len, seqs)))


def _worst(got: list[Any], want: list[np.ndarray]) -> float:
    return max(
        float((np.abs(np.asarray(g) - w) / np.maximum(1.0, np.abs(w))).max())
        for g, w in zip(got, want, strict=True)
    )


@torch.no_grad()
def _hf_logprobs(model: Any, seqs: list[list[int]]) -> list[np.ndarray]:
    """transformers' per-token log-probs, aligned as ours: ``[t]`` of token ``t``, ``[0] = 0``."""
    out = []
    for s in seqs:
        ids = torch.tensor([s], device=device())
        logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(np.concatenate([[0.0], lp.double().cpu().numpy()]))
    return out


def losses_over_steps(steps: int, precision: str = "fp32", **model: Any) -> list[float]:
    """The train loss of ``steps`` steps on one fixed batch (it must fall)."""
    from trainctl.api import TrainBatchRequest

    engine = _engine(model=model, precision=precision, optimizer={"lr": 3e-3})
    try:
        seqs = batch(engine.cfg.model.vocab_size)
        req = TrainBatchRequest(sequences=[{"tokens": t} for t in seqs])
        return [engine.train_batch(req).loss for _ in range(steps)]
    finally:
        engine.close()


@dataclass
class Snapshot:
    path: Path
    png: bytes
    peak_bytes: float
    events: int
    snapshot: Any = None
    """The CUDA allocator snapshot (``torch.cuda.memory._snapshot``'s dict), None on CPU."""


def memory_snapshot(directory: Path, **model: Any) -> Snapshot:
    """Start a memory profile, take a train step, stop; the profile file and our PNG of it."""
    from trainctl.api import TrainBatchRequest
    from trainctl.workers.control.profile_plot import memory_timeline, render_png

    engine = _engine(model=model)
    try:
        seqs = batch(engine.cfg.model.vocab_size)
        engine.start_memory_profile(max_entries=200_000)
        engine.train_batch(TrainBatchRequest(sequences=[{"tokens": t} for t in seqs]))
        path = engine.stop_memory_profile(directory)
    finally:
        engine.close()
    data = path.read_bytes()
    ts, total = memory_timeline(path.name, data)
    png = render_png(path.name, ts, total)
    snap = pickle.loads(data) if path.suffix == ".pickle" else None
    peak = float(total.max()) if total.size else 0.0
    return Snapshot(path=path, png=png, peak_bytes=peak, events=int(ts.size), snapshot=snap)


@dataclass
class TreeVsFlat:
    logprobs: float
    """max |tree - flat| over every token's log-prob"""
    loss: tuple[float, float]
    grad_norm: tuple[float, float]
    grads: float
    """max over parameters of max |tree - flat| / max |flat| of the gradient"""
    params: float
    """the same of the parameters after the step"""
    computed_tokens: tuple[float, float]


def tree_vs_flat(**model: Any) -> TreeVsFlat:
    """A GRPO group packed as a trie against the same batch packed flat: log-probs, then one
    split step each from the same weights (two engines of one seed), its gradients read
    between ``forward_backward`` and ``optim_step``."""
    from trainctl.api import ForwardBackwardRequest, LogProbsRequest, OptimStepRequest

    results: dict[str, Any] = {}
    for packing in ("tree", "flat"):
        # Adam's first update is lr * g / (|g| + eps): with a small eps a gradient element
        # near 0 moves its parameter by up to 2 x lr on a rounding difference (seen on an
        # H200: 8e-5 of a tensor's largest parameter, with gradients equal to 1e-7 in norm).
        # eps = 1e-3 keeps the update within lr / eps = 1 x the gradient's difference; the
        # gradients themselves are compared directly.
        opt = {"eps": 1e-3, "clip_grad": 0.0}
        engine = _engine(model=model, precision="fp32", packing=packing, optimizer=opt)
        try:
            seqs = [{"tokens": t} for t in grpo_group(engine.cfg.model.vocab_size)]
            lp = engine.logprobs(LogProbsRequest(sequences=seqs))
            fb = engine.forward_backward(ForwardBackwardRequest(sequences=seqs))
            grads = {
                k: v.float().cpu() for k, v in engine.engine.canonical_shards(grads=True).items()
            }
            step = engine.optim_step(OptimStepRequest())
            params = {k: v.float().cpu() for k, v in engine.engine.canonical_shards().items()}
        finally:
            engine.close()
        results[packing] = (lp.logprobs, fb, step, grads, params)
    (lp_t, fb_t, st_t, g_t, p_t), (lp_f, fb_f, st_f, g_f, p_f) = results["tree"], results["flat"]
    assert p_t.keys() == p_f.keys() == g_t.keys() == g_f.keys() and p_t, "the same parameters"
    assert any(float(g.abs().max()) > 0 for g in g_f.values()), "the step made gradients"
    return TreeVsFlat(
        logprobs=max(float(np.abs(np.array(a) - b).max()) for a, b in zip(lp_t, lp_f, strict=True)),
        loss=(fb_t.loss, fb_f.loss),
        grad_norm=(st_t.metrics["grad_norm:value"], st_f.metrics["grad_norm:value"]),
        grads=_worst_relative(g_t, g_f),
        params=_worst_relative(p_t, p_f),
        computed_tokens=(fb_t.metrics["computed_tokens:sum"], fb_f.metrics["computed_tokens:sum"]),
    )


def _worst_relative(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """max over tensors of max |got - want| / max |want|"""
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-30)) for k in want
    )


@dataclass
class GradParity:
    """One step's gradients, the engine's against transformers' fp32 autograd."""

    worst: float
    """max over tensors of ||ours - transformers|| / ||transformers|| (relative L2)"""
    worst_name: str
    head: float
    """the same for the LM head's gradient (the tied embedding's, where tied)"""
    head_off_by_1pct: float
    """what ``head`` would read were the head's gradient 1% too large: the bound's margin"""
    loss: tuple[float, float]
    tensors: int
    compiled_norms: int
    """the engine's norm modules that ran ``compiled_rms_norm``"""


def grads_vs_transformers(
    directory: Path,
    chunk: int,
    lengths: tuple[int, ...] = (300, 200),
    norm_kernel: str = "eager",
    **shape: Any,
) -> GradParity:
    """A random Qwen3-shaped model saved by transformers, imported into the engine in fp32
    with a fused-head chunk of ``chunk`` tokens and its RMSNorms run by ``norm_kernel``
    (``EngineConfig.norm_kernel``); one ``forward_backward`` on a batch of
    ``lengths``, its gradients (by transformers' names) against transformers' fp32 backward
    of the same token-mean loss on the same device. A split step's gradients hold the sum
    over tokens until ``optim_step`` divides them by the window's token count
    (``workers/engine/accumulation.py``): they are divided here."""
    from trainctl.api import ForwardBackwardRequest
    from trainctl.workers.engine import hf
    from trainctl.workers.engine.config import ModelConfig

    ref = tiny_model("qwen3", directory, **shape).to(device()).train()
    model = hf.model_config_from_hf(hf.read_config(directory), ModelConfig())
    seqs = batch(model.vocab_size, lengths)
    engine = _engine(
        model=dataclasses.asdict(model), init_hf=str(directory), precision="fp32",
        max_tokens_per_microbatch=max(sum(lengths), model.max_seq_len), packing="flat",
        logprob_chunk_size=chunk, norm_kernel=norm_kernel,
    )  # fmt: skip
    try:
        fb = engine.forward_backward(
            ForwardBackwardRequest(sequences=[{"tokens": t} for t in seqs])
        )
        canonical = engine.engine.canonical_shards(grads=True)
        compiled = sum(
            getattr(m, "compiled", False) is True
            for chunk_ in engine.engine.chunks
            for m in chunk_.modules()
        )
    finally:
        engine.close()
    predicted = sum(n - 1 for n in lengths)
    ours = {k: v.double().cpu() / predicted for k, v in hf.to_hf(canonical, model).items()}
    total = 0.0
    for s in seqs:
        ids = torch.tensor([s], device=device())
        logits = ref(ids).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / predicted
        loss.backward()
        total += float(loss)
    theirs = {n: p.grad.float().cpu() for n, p in ref.named_parameters() if p.grad is not None}
    assert ours.keys() <= theirs.keys() and ours, (sorted(ours)[:3], sorted(theirs)[:3])
    assert all(float(g.abs().max()) > 0 for g in theirs.values()), "every tensor has a gradient"
    errors = {k: _relative_l2(ours[k], theirs[k]) for k in ours}
    head = "lm_head.weight" if "lm_head.weight" in ours else "model.embed_tokens.weight"
    name = max(errors, key=errors.__getitem__)
    return GradParity(
        worst=errors[name], worst_name=name, head=errors[head],
        head_off_by_1pct=_relative_l2(ours[head] * 1.01, theirs[head]),
        loss=(fb.loss, total), tensors=len(errors), compiled_norms=compiled,
    )  # fmt: skip


def _relative_l2(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


@dataclass
class ProjectionViews:
    """What each layer's attention keeps for backward, against its q/k/v projection's output."""

    layers: int
    """layers whose projection and attention ran"""
    saved: int
    """tensors the attention kept for backward, every layer"""
    pinning: int
    """of those, the ones whose storage is the projection's output (a view of it): each keeps
    the whole ``[t, (heads + 2 x groups) x dim]`` buffer alive until the layer's backward"""


def projection_views_kept(compiled_rotation: bool, **model: Any) -> ProjectionViews:
    """One ``forward_backward`` of a grouped-query model with q/k norms (Qwen3's shape), its
    rotation compiled (CUDA's choice) or eager (the CPU's). A tensor saved while a layer's
    core attention runs, whose storage is that layer's projection output (alive for that
    whole time, so an address cannot have been reused), pins the buffer."""
    from trainctl.api import ForwardBackwardRequest
    from trainctl.workers.ops import rope

    shape = dict(
        family="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128,
        num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=512,
    )  # fmt: skip
    engine = _engine(model={**shape, **model})
    window: list[int] = []  # the running attention's projection output, by address
    seen = ProjectionViews(layers=0, saved=0, pinning=0)

    def projected(_m: Any, _args: Any, out: Any) -> None:
        window[:] = [(out[0] if isinstance(out, tuple) else out).untyped_storage().data_ptr()]

    def attending(_m: Any, _args: Any) -> None:
        seen.layers += 1

    def attended(_m: Any, _args: Any, _out: Any) -> None:
        window.clear()

    def pack(t: Tensor) -> Tensor:
        if window:
            seen.saved += 1
            seen.pinning += t.untyped_storage().data_ptr() == window[0]
        return t

    hooks = []
    for chunk in engine.engine.chunks:
        for name, m in chunk.named_modules():
            if name.endswith("linear_qkv"):
                hooks.append(m.register_forward_hook(projected))
            elif name.endswith("core_attention"):
                hooks.append(m.register_forward_pre_hook(attending))
                hooks.append(m.register_forward_hook(attended))
    rope.force_compiled(compiled_rotation)
    try:
        seqs = [{"tokens": t} for t in batch(engine.cfg.model.vocab_size)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.forward_backward(ForwardBackwardRequest(sequences=seqs))
    finally:
        rope.force_compiled(None)
        for h in hooks:
            h.remove()
        engine.close()
    return seen


@dataclass
class KeptBytes:
    """What one forward keeps for its backward, counted when the forward ends."""

    kept: int
    """bytes of every distinct storage autograd saved that still holds memory then"""
    rows: int
    """rows through each layer's MLP: the tokens, or for experts the tokens x top-k"""
    layers: int
    ffn: int
    """the MLP's (or an expert's) inner width"""
    element: int
    """bytes of one activation element (4 in fp32, 2 in bf16)"""
    fused_swiglu: bool
    """megatron's fused SwiGLU (CUDA, dense layers), which keeps its input only; the eager
    ops keep ``silu(gate)`` too, one more ``rows x ffn`` a layer"""
    experts: bool


def kept_for_backward(recompute: str, model: dict[str, Any] | None = None) -> KeptBytes:
    """One ``forward_backward`` of a model (``model``'s shape, else the embedded one) under
    ``recompute``: the bytes of the storages autograd kept at the end of the forward
    (a storage a recompute emptied, which its gradient hook refills in backward, counts
    nothing)."""
    from trainctl.api import ForwardBackwardRequest
    from trainctl.workers.engine.mlp import SwiGLU

    engine = _engine(recompute=recompute, **({"model": model} if model else {}))
    model_cfg = engine.cfg.model
    kept: dict[int, Any] = {}
    at_end: list[int] = []

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        kept.setdefault(storage._cdata, storage)
        return t

    def forward_ended(_m: Any, _args: Any, _out: Any) -> None:
        if not at_end:
            at_end.append(sum(s.nbytes() for s in kept.values()))

    chunk = engine.engine.chunks[0]
    hook = chunk.register_forward_hook(forward_ended)
    seqs = [{"tokens": t} for t in batch(model_cfg.vocab_size)[:1]]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.forward_backward(ForwardBackwardRequest(sequences=seqs))
    finally:
        hook.remove()
        engine.close()
    element = next(p for p in chunk.parameters()).element_size()
    fused = any(m.fused for m in chunk.modules() if isinstance(m, SwiGLU))
    experts = model_cfg.num_experts > 0
    rows = len(seqs[0]["tokens"]) * (model_cfg.moe_topk if experts else 1)
    ffn = model_cfg.moe_ffn_hidden_size if experts else model_cfg.ffn_hidden_size
    return KeptBytes(at_end[0], rows, model_cfg.num_layers, ffn, element, fused, experts)
