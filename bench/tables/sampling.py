"""The ``sampling`` table of ``bench/run.py``: the weight sync against the disk path it
replaces, sampler throughput, and the RL loop's time per iteration."""

from __future__ import annotations

from typing import Any

from bench.sampling_cases import WIDE
from bench.tables.common import measure, table

EMBEDDED: dict[str, int] = {}
"""The embedded default's shape (2 layers, width 128, vocabulary 512)."""


def section(quick: bool) -> str:
    syncs, rl = (3, 5) if quick else (5, 20)
    shapes = [("embedded", EMBEDDED, rl)] + ([] if quick else [("wider (113M)", WIDE, 0)])
    runs: list[tuple[str, Any]] = [
        (name, measure("sampling_case", "sampling_cases", model=model, syncs=syncs,
                       rl_iterations=iters))
        for name, model, iters in shapes
    ]  # fmt: skip
    rows = [
        [name, f"{r['parameters'] / 1e6:.1f}M", f"{r['bytes'] / 2**20:.0f}",
         f"{r['gather_s'] * 1e3:.0f}", f"{r['load_s'] * 1e3:.0f}",
         f"{(r['gather_s'] + r['load_s']) * 1e3:.0f}", f"{r['export_s'] * 1e3:.0f}",
         f"{r['fresh_engine_s']:.1f}",
         f"{(r['export_s'] + r['fresh_engine_s']) / (r['gather_s'] + r['load_s']):.0f}x",
         f"{r['tokens_per_s']:.0f}"]
        for name, r in runs
    ]  # fmt: skip
    head = (
        "### Sampling and weight sync: `trainctl serve --samplers 1` (dp=1, one vLLM engine, "
        "fp32, CPU)\n\n"
        "sync = gather (every rank's shards merged into HF-named tensors, one object in Ray's "
        "object store) + load (vLLM's `reload_weights` in the engine), median of "
        f"{syncs}; the path it replaces = `export_hf` to disk + a fresh vLLM engine loading "
        "the export (engine construction only, not Python's imports). Sampler tokens/s: 32 "
        "prompts x n=4 x 64 new tokens in one request.\n\n"
    )
    text = head + table(
        ["model", "params", "MiB sent", "gather ms", "load ms", "sync ms", "export ms",
         "fresh engine s", "disk path / sync", "sampler tokens/s"],
        rows,
    )  # fmt: skip
    rl_run = runs[0][1].get("rl")
    if rl_run:
        total = rl_run["sample_s"] + rl_run["train_s"] + rl_run["sync_s"]
        text += (
            f"\n\n`examples/rl_loop.py` on the embedded model, {rl_run['iterations']} "
            "iterations of 8 prompts x 8 completions x 8 tokens (PPO, group-relative "
            f"advantages); reward {rl_run['reward_first']:.2f} -> {rl_run['reward_last']:.2f}; "
            "median seconds per iteration:\n\n"
            + table(
                ["sample", "train (forward_backward + optim_step)", "sync", "iteration"],
                [
                    [
                        f"{rl_run['sample_s']:.3f}",
                        f"{rl_run['train_s']:.3f}",
                        f"{rl_run['sync_s']:.3f}",
                        f"{total:.3f}",
                    ]
                ],
            )
        )
    return text
