"""The parallel layouts the distributed tier holds to one rank: the model and engine config
each runs, and the comparison of a layout's step with the single rank's."""

from __future__ import annotations

from typing import Any

import numpy as np

from helpers.single_process import RTOL, close

LOSSES: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("cross_entropy", "token_mean", {}),
    ("importance_sampling", "seq_mean_token_mean", {}),
    ("ppo", "token_mean", {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.05}),
)
"""(kind, normalisation, options) of every loss the engine tests run; the last one steps."""


LR = 1e-3
MODEL = {"num_layers": 4, "max_seq_len": 64, "num_attention_heads": 4, "num_query_groups": 2}


def engine_cfg(*, sequence_parallel: str = "auto", **layout: int) -> dict:
    return {
        "layout": layout,
        "max_tokens_per_microbatch": 96,
        "model": MODEL,
        "optimizer": {"clip_grad": 0.0, "eps": 1e-5},
        "sequence_parallel": sequence_parallel,
    }


LAYOUTS = [
    {"dp": 2},
    {"cp": 2},
    {"tp": 2},
    {"pp": 2},
    {"dp": 2, "cp": 2},
    {"tp": 2, "pp": 2},
    {"cp": 2, "tp": 2},
    {"dp": 2, "cp": 2, "tp": 2},
    {"pp": 2, "vp": 2},
]


MOE = {**MODEL, "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 128}
STARVE_EP1 = [0.0, 0.0, -1e4, -1e4]  # experts 2 and 3 (EP rank 1's) never chosen


FAMILY_SHAPES = {
    "qwen2": {**MODEL, "family": "qwen2", "tie_embeddings": True},
    "qwen3": {**MODEL, "family": "qwen3", "head_dim": 48},
    # Qwen3.5: three Gated DeltaNet layers and one gated full attention, RoPE on a quarter of
    # each head, zero-centred norms.
    "qwen3_5": {
        **MODEL, "family": "qwen3_5", "head_dim": 16, "rotary_percent": 0.25,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
    },
}  # fmt: skip
# Qwen3.5-MoE: the same layers, each with routed experts and a gated shared expert.
FAMILY_SHAPES["qwen3_5_moe"] = {
    **FAMILY_SHAPES["qwen3_5"], "family": "qwen3_5_moe", "num_experts": 4, "moe_topk": 2,
    "moe_ffn_hidden_size": 48, "moe_shared_ffn_hidden_size": 80,
}  # fmt: skip


def world_size(layout: dict) -> int:
    world = 1
    for axis in ("dp", "cp", "tp", "pp"):
        world *= layout.get(axis, 1)
    return world


def layout_id(d: dict) -> str:
    return "".join(f"{k}{v}" for k, v in d.items())


def assert_same_step(
    results: list[dict],
    reference: list[dict],
    losses: tuple[str, ...] = tuple(k for k, _, _ in LOSSES),
    grad_floor: float = RTOL,
) -> None:
    """``grad_floor``: gradient elements are held to this fraction of their tensor's largest
    element in absolute terms (besides 1e-5 relative)."""
    (ref,) = reference
    for kind in losses:
        want = ref["per_loss"][kind]
        for r in results:
            got = r["per_loss"][kind]
            if r["is_last_stage"]:
                assert close(got["loss"], want["loss"]), (kind, got["loss"], want["loss"])
                assert close(got["eval_loss"], want["eval_loss"]), kind
            assert close(got["grad_norm"], want["grad_norm"]), (
                kind,
                got["grad_norm"],
                want["grad_norm"],
            )
        grads = full_tensors(results, "shard_grads", kind)
        ref_grads = full_tensors(reference, "shard_grads", kind)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            # Elements near zero are held to 1e-5 of the tensor's largest one: fp32 sums in
            # another order differ by ~1e-7 absolute, which is all of a tiny element.
            atol = grad_floor * float(np.abs(g).max())
            np.testing.assert_allclose(
                grads[name], g, rtol=RTOL, atol=atol, err_msg=f"{kind} {name}"
            )
    params = full_tensors(results, "shard_params")
    for name, p in full_tensors(reference, "shard_params").items():
        # Adam's first step is about lr * g / (|g| + eps): near g = 0 a gradient difference d
        # moves the step by lr * d / eps. The gradients above agree to ~1e-8 absolute, so
        # eps = 1e-5 bounds that at 1e-6 (0.1% of a step); we ask for 1% of one step.
        np.testing.assert_allclose(params[name], p, rtol=RTOL, atol=1e-2 * LR, err_msg=name)


def full_tensors(
    results: list[dict[str, Any]], key: str, loss: str | None = None
) -> dict[str, np.ndarray]:
    """Merge the DP-replica-0 shards of every rank into full canonical tensors."""
    import torch

    from trainctl.workers.engine.weights import shard_rule

    by_name: dict[str, dict[int, np.ndarray]] = {}
    for r in results:
        src = r["per_loss"][loss][key] if loss else r[key]
        for name, shard in src.items():
            by_name.setdefault(name, {})[r["coords"]["tp"]] = shard
    out = {}
    for name, shards in by_name.items():
        ordered = [torch.from_numpy(shards[k]) for k in sorted(shards)]
        out[name] = shard_rule(name).unshard(ordered).numpy()
    return out
