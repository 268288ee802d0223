"""The transformers side of the GPU benchmark: one train step of a Hugging Face Qwen3 model,
in the configurations a user who cares about speed would run, weakest first.

Each configuration starts from the same checkpoint as trainctl (``bench/gpu.py`` writes it),
takes the same batch, computes the same loss (the token mean over every predicted token of
the batch: each micro-batch's summed loss over the batch's predicted-token count), clips the
gradient norm at 1.0 and runs fused AdamW with trainctl's hyper-parameters. Only the
arithmetic's precision and the kernels differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_timing import OutOfMemory, Run, timed_run


@dataclass(frozen=True)
class Baseline:
    """One rung of the ladder."""

    name: str
    label: str
    fp32_masters: bool
    """fp32 parameters and AdamW state under bf16 autocast (HF Trainer's ``bf16=True``);
    otherwise bf16 parameters and state (no master weights)."""
    liger: bool = False
    """Liger's Triton kernels: RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy (no
    logits in memory). Needs CUDA."""
    compile: bool = False
    """``torch.compile`` of each decoder layer (torchtitan's way: one graph for 28 layers)."""

    @property
    def needs_cuda(self) -> str | None:
        return "Liger's kernels are Triton kernels for CUDA" if self.liger else None


LADDER = (
    Baseline("hf_amp", "transformers AMP (fp32 masters, autocast bf16)", fp32_masters=True),
    Baseline("hf_bf16", "transformers pure bf16", fp32_masters=False),
    Baseline("hf_liger", "transformers bf16 + Liger", fp32_masters=False, liger=True),
    Baseline(
        "hf_liger_compile", "transformers bf16 + Liger + torch.compile", fp32_masters=False,
        liger=True, compile=True,
    ),
)  # fmt: skip
BY_NAME = {b.name: b for b in LADDER}


def micro_batches(lengths: list[int], micro_tokens: int) -> list[list[int]]:
    """Indices of the batch's sequences per micro-batch: longest first, each micro-batch at
    most ``micro_tokens`` tokens once padded to its longest sequence (at least one sequence).
    Equal lengths need no padding; a ragged batch pads little, since neighbours in length
    order differ little, and runs a few micro-batches rather than one per distinct length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= micro_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def padded(ids: list[Any], rows: list[int]) -> dict[str, Any]:
    """One micro-batch's model inputs: right-padded token ids, the attention mask (None when
    nothing is padded) and labels with -100 on the padding."""
    import torch

    width = max(len(ids[i]) for i in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long, device=ids[0].device)
    mask = torch.zeros_like(batch)
    for r, i in enumerate(rows):
        batch[r, : len(ids[i])], mask[r, : len(ids[i])] = ids[i], 1
    labels = batch.masked_fill(mask == 0, -100)
    full = bool(mask.all())
    return {"input_ids": batch, "attention_mask": None if full else mask, "labels": labels}


def _model(checkpoint: Path, baseline: Baseline, dev: str) -> Any:
    import torch
    import transformers

    dtype = torch.float32 if baseline.fp32_masters or dev == "cpu" else torch.bfloat16
    net = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation="sdpa"
    ).to(dev)
    if baseline.liger:
        from liger_kernel.transformers import (  # pyright: ignore[reportMissingImports]
            apply_liger_kernel_to_qwen3,  # the GPU machine has it (scripts/gpu_wheels)
        )

        apply_liger_kernel_to_qwen3(model=net)
    if baseline.compile:
        for layer in net.model.layers:
            layer.compile()
    return net.train()


def _fits(backward: Callable[[list[list[int]]], float], groups: list[list[int]], opt: Any) -> bool:
    """Whether one forward/backward over ``groups`` fits on the GPU with room left for AdamW's
    two moments per parameter (3% of the card kept free); the gradients are dropped after, so
    the weights and the optimizer are as before. Always true on a CPU."""
    import torch

    if not torch.cuda.is_available():
        return True
    torch.cuda.reset_peak_memory_stats()
    try:
        backward(groups)
    except torch.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    params = [p for group in opt.param_groups for p in group["params"]]
    moments = 2 * sum(p.numel() * p.element_size() for p in params)
    _, total = torch.cuda.mem_get_info()
    return torch.cuda.max_memory_allocated() + moments <= 0.97 * total


def transformers_step(
    baseline: str,
    checkpoint: str,
    sequences: list[list[int]],
    steps: int,
    warmup: int,
    optimizer: dict[str, float],
    micro_tokens: list[int],
    profile: str | None = None,
) -> dict[str, Any]:
    """Times ``steps`` train steps after ``warmup``; the largest micro-batch of
    ``micro_tokens`` whose first step fits is the one timed."""
    import torch

    b = BY_NAME[baseline]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if b.needs_cuda and not cuda:
        return {"skipped": b.needs_cuda}
    net = _model(Path(checkpoint), b, dev)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=optimizer["lr"], betas=(optimizer["beta1"], optimizer["beta2"]),
        eps=optimizer["eps"], weight_decay=optimizer["weight_decay"], fused=True,
    )  # fmt: skip
    lengths = [len(s) for s in sequences]
    ids = [torch.tensor(s, device=dev) for s in sequences]
    predicted = sum(n - 1 for n in lengths)
    clip = optimizer["clip_grad"]

    def backward(groups: list[list[int]]) -> float:
        total = torch.zeros((), device=dev)
        for rows in groups:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=b.fp32_masters and cuda):
                loss = net(**padded(ids, rows), num_items_in_batch=predicted).loss
            loss.backward()
            total += loss.detach().float()
        return float(total)

    def step_with(groups: list[list[int]]) -> tuple[float, float]:
        loss = backward(groups)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, float(norm)

    # The largest micro-batch whose forward/backward leaves room for AdamW's moments (made at
    # the first step), tried without a step so step 1 still starts from the checkpoint.
    budgets = sorted(set(micro_tokens), reverse=True)
    groups = next(
        (g for g in (micro_batches(lengths, t) for t in budgets) if _fits(backward, g, opt)),
        None,
    )
    if groups is None:
        raise OutOfMemory(f"{baseline}: no micro-batch of {sorted(set(micro_tokens))} fits")
    first = step_with(groups)  # step 1, from the checkpoint's weights
    run = Run(losses=[first[0]], grad_norms=[first[1]])

    def step() -> None:
        loss, norm = step_with(groups)
        run.losses.append(loss)
        run.grad_norms.append(norm)

    timed_run(run, step, steps, max(0, warmup - 1), profile)
    return {
        **run.summary(),
        "config": b.label,
        "micro_batches": len(groups),
        "micro_tokens": max(len(g) * lengths[g[0]] for g in groups),
        "attention": f"sdpa: {run.kernels}",
    }
