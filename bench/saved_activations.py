"""What a decoder layer keeps for its backward, per token, by the module that kept it:
trainctl's engine against transformers' Qwen3, at Qwen3-0.6B's widths, in bf16.

    python bench/saved_activations.py                 # 2 layers, 2 x 1,024 tokens: ~1 min
    python bench/saved_activations.py --tokens 512 --sequences 4
    python bench/saved_activations.py --as-on-cuda    # CUDA's code choices, on the CPU
    python bench/saved_activations.py --as-on-cuda --engine recompute=elementwise

At 32K tokens the activations are most of a step's peak memory (28 layers x 32K tokens x
~50 KB), and their size per token does not depend on the device: what an op saves for its
backward is the same tensors on a CPU and a GPU, but for the attention kernel's own state
(cuDNN's and the CPU's flash kernel both keep q, k, v, the output and a log-sum-exp per head
row). So this CPU measure says where a GPU step's activation memory goes, and what a change
saves, before a GPU is lent.

How it counts: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op saves for
backward; each distinct storage counts once (a tensor saved by two ops, or a view of another,
costs nothing more), parameters count nothing (they are held anyway), and each storage is
charged to the innermost module whose forward was running when it was first saved. Bytes
are a storage's whole size when the outermost forward ends, so a view that pins a larger
buffer is charged the buffer, and a buffer released before the backward (a recomputed
norm's output) nothing.

Where the engine picks its code by device, a CPU run takes the CPU's: eager RMSNorm, q/k norm
and rotation, SwiGLU as separate ops. ``--as-on-cuda`` takes CUDA's instead (the compiled
norms, the compiled q/k norm + rotation and head passes, megatron's fused SwiGLU), so the
count is the GPU step's but for the attention kernel's own state.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu import QWEN3_06B, overrides, variant_label, write_checkpoint  # noqa: E402

LAYER_PREFIXES = ("decoder.layers.", "model.layers.")
"""Where each side's decoder layers live: a name below one is charged to its layer-relative
path (``self_attention.linear_qkv``), summed over the layers."""


@dataclass
class Ledger:
    """The saved storages of one forward (the first: a recording holds one micro-batch), by
    the module charged with each."""

    stack: list[str] = field(default_factory=list)
    """the sites whose forward is running, innermost last"""
    seen: set[int] = field(default_factory=set)
    """the storages charged so far (``_cdata``: held in ``pending``, so never reused)"""
    params: set[int] = field(default_factory=set)
    by_site: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dtypes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    closed: bool = False
    """the first outermost forward has ended: one forward is counted"""
    pending: list[tuple[str, Any, str]] = field(default_factory=list)
    """(site, storage, dtype) kept during the running forward, charged when it ends"""

    def pack(self, t: Any) -> Any:
        # Outside any module's forward (the loss), or after the first outermost forward
        # ended: a backward that recomputes a module runs its forward again.
        if self.closed or not self.stack:
            return t
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: its address may be freed and reused
        if storage.nbytes() == 0 or key in self.seen or key in self.params:
            return t
        self.seen.add(key)
        self.pending.append((self.stack[-1], storage, str(t.dtype).removeprefix("torch.")))
        return t

    def forward_ended(self) -> None:
        """Charge what this forward kept, at its size now: a buffer released during the
        forward (megatron's ``CheckpointWithoutOutput`` empties a norm's output once the
        next module has used it, and recomputes it in backward) costs nothing."""
        for site, storage, dtype in self.pending:
            if storage.nbytes():
                self.by_site[site] += storage.nbytes()
                self.dtypes[site].add(dtype)
        self.pending.clear()
        self.closed = True


def _site(name: str) -> str:
    """A module's name, its layer number dropped (``decoder.layers.3.mlp`` -> ``layer.mlp``)."""
    name = name.removeprefix("module.")  # megatron's DDP wrapper
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            _, _, inner = name[len(prefix) :].partition(".")
            return "layer." + (inner or "(the layer itself)")
    return name or "(top)"


@contextmanager
def recording(roots: list[Any]) -> Iterator[Ledger]:
    """Every tensor saved for backward while ``roots``' modules run forward, charged."""
    import torch
    from torch.nn.modules import module as nn_module

    names = {id(m): _site(n) for root in roots for n, m in root.named_modules()}
    ledger = Ledger()
    # Module's own methods: megatron's DDP wrapper shadows ``buffers`` with its grad buffers.
    held = [
        t for root in roots
        for t in (*torch.nn.Module.parameters(root), *torch.nn.Module.buffers(root))
    ]  # fmt: skip
    ledger.params = {t.untyped_storage()._cdata for t in held}

    def pre(mod: Any, _args: Any) -> None:
        if id(mod) in names:
            ledger.stack.append(names[id(mod)])

    def post(mod: Any, _args: Any, _out: Any) -> None:
        if id(mod) in names and ledger.stack:
            ledger.stack.pop()
            if not ledger.stack:
                ledger.forward_ended()

    hooks = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post),
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
            yield ledger
    finally:
        for h in hooks:
            h.remove()


def _qwen3(layers: int, vocab: int) -> dict[str, Any]:
    return {**QWEN3_06B, "num_layers": layers, "vocab_size": vocab}


@contextmanager
def cuda_code_choices() -> Iterator[dict[str, Any]]:
    """The engine's CUDA choices on the CPU, for as long as the block runs; the
    ``EngineConfig`` fields they need."""
    from trainctl.workers.engine import shard
    from trainctl.workers.ops import head_kernels, rope

    build = shard.transformer_config

    def as_on_cuda(cfg: Any, *, bf16: bool, cuda: bool = False) -> Any:
        return build(cfg, bf16=bf16, cuda=True)  # megatron's fused SwiGLU

    rope.force_compiled(True)
    head_kernels.force_kernels(head_kernels.COMPILED)
    shard.transformer_config = as_on_cuda  # type: ignore[assignment]
    try:
        yield {"norm_kernel": "compiled"}
    finally:
        shard.transformer_config = build  # type: ignore[assignment]
        head_kernels.force_kernels(None)
        rope.force_compiled(None)


def trainctl_ledger(
    model: dict[str, Any],
    lengths: list[int],
    checkpoint: str,
    as_on_cuda: bool = False,
    engine: dict[str, Any] | None = None,
) -> Ledger:
    """trainctl's engine (bf16, fused head; its default configuration but for the
    ``EngineConfig`` fields in ``engine``) on one packed micro-batch."""
    from trainctl.api import ForwardBackwardRequest
    from trainctl.workers.control.inprocess import InProcessEngine
    from trainctl.workers.engine.config import EngineConfig

    with contextlib.ExitStack() as stack:
        fields = stack.enter_context(cuda_code_choices()) if as_on_cuda else {}
        cfg = EngineConfig.from_dict(
            {
                "model": {**model, "max_seq_len": max(lengths)},
                "precision": "bf16",
                "max_tokens_per_microbatch": sum(lengths),
                "packing": "flat",
                "init_hf": checkpoint,
                **fields,
                **(engine or {}),
            }
        )
        eng = InProcessEngine(cfg)
        req = ForwardBackwardRequest(sequences=[{"tokens": _tokens(n, model)} for n in lengths])
        try:
            with recording(list(eng.engine.chunks)) as ledger:
                eng.forward_backward(req)
        finally:
            eng.close()
    return ledger


def transformers_ledger(lengths: list[int], checkpoint: str) -> Ledger:
    """transformers' Qwen3 in pure bf16 (SDPA attention), the whole batch in one call, the
    full-logit cross-entropy: the ladder's "pure bf16" rung without its optimizer."""
    import torch
    import transformers

    net = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).train()
    # One forward for the whole batch (equal lengths: no padding), so that no storage is
    # freed and its address reused while the ledger counts.
    if len(set(lengths)) != 1:
        raise ValueError(f"transformers_ledger takes sequences of one length, not {lengths}")
    ids = torch.tensor([_tokens(n, {"vocab_size": net.config.vocab_size}) for n in lengths])
    with recording([net]) as ledger:
        out = net(input_ids=ids, labels=ids)
    out.loss.backward()
    return ledger


def _tokens(n: int, model: dict[str, Any], seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, model["vocab_size"], n).tolist()


@dataclass(frozen=True)
class Row:
    site: str
    bytes_per_token: float
    dtypes: str


def per_token_per_layer(ledger: Ledger, tokens: int, layers: int) -> list[Row]:
    """A layer's sites in bytes per token per layer, then what lies outside the layers in
    bytes per token, largest first within each."""
    inside = [(s, b / tokens / layers) for s, b in ledger.by_site.items() if s.startswith("layer.")]
    outside = [(s, b / tokens) for s, b in ledger.by_site.items() if not s.startswith("layer.")]
    return [
        Row(s, v, ",".join(sorted(ledger.dtypes[s])))
        for part in (inside, outside)
        for s, v in sorted(part, key=lambda x: -x[1])
    ]


def layer_bytes(rows: list[Row]) -> float:
    """What a layer keeps, a token: its sites summed."""
    return sum(r.bytes_per_token for r in rows if r.site.startswith("layer."))


def table(title: str, rows: list[Row]) -> str:
    lines = [f"### {title}", "", "| site | bytes / token | dtypes |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.site} | {r.bytes_per_token:,.0f} | {r.dtypes} |")
    lines.append(f"| **a layer, in all** | **{layer_bytes(rows):,.0f}** | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1024, help="tokens a sequence")
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--as-on-cuda", action="store_true", help="CUDA's code choices (see above)")
    p.add_argument(
        "--engine", default="", help="EngineConfig fields as field=value joined by '+' "
        "(bench/gpu.py's --trainctl-variants form), e.g. recompute=elementwise",
    )  # fmt: skip
    a = p.parse_args(argv)
    engine = overrides(a.engine) if a.engine else {}
    model = _qwen3(a.layers, a.vocab)
    lengths = [a.tokens] * a.sequences
    total = sum(lengths)
    runs: dict[str, Callable[[str], Ledger]] = {
        f"trainctl (bf16, {variant_label(engine) if engine else 'default configuration'}"
        f"{', as on CUDA' if a.as_on_cuda else ''})": (
            lambda d: trainctl_ledger(model, lengths, d, a.as_on_cuda, engine)
        ),
        "transformers pure bf16 (SDPA)": lambda d: transformers_ledger(lengths, d),
    }
    summary = [
        "| side | a layer, bytes / token | at 28 layers x 32K tokens, GiB |",
        "|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(model, max(lengths), d)
        for title, run in runs.items():
            rows = per_token_per_layer(run(d), total, a.layers)
            print(table(title, rows), end="\n\n", flush=True)
            layer = layer_bytes(rows)
            summary.append(f"| {title} | {layer:,.0f} | {layer * 28 * 32768 / 2**30:.1f} |")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
