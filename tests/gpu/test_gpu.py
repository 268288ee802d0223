"""The engine on one CUDA device, in process (``workers/control/inprocess.py``): log-prob
parity with transformers, a memory snapshot round trip, a falling loss, and prefix tries on
FlexAttention equal to flat packing. The cases live in ``tests/helpers/device_cases.py``; the
distributed tier runs them on the CPU too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import device_cases as cases

# Qwen3-0.6B's attention shape (head_dim 128, 2 query heads per key/value head, tied
# embeddings), fewer and narrower layers: random weights, a few seconds per case.
HF_SHAPE = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=512,
)  # fmt: skip
ENGINE_SHAPE = dict(
    family="qwen3", vocab_size=4096, hidden_size=512, ffn_hidden_size=1536, num_layers=4,
    num_attention_heads=8, num_query_groups=4, head_dim=128, tie_embeddings=True,
    max_seq_len=512,
)  # fmt: skip


# The benchmark's head and sequence length (Qwen3-0.6B: vocabulary 151,936, tied, width 1,024;
# 4K sequences) on two of its layers.
BENCH_HEAD = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
)  # fmt: skip


@pytest.mark.parametrize(
    ("chunk", "norm_kernel"), [(1024, "eager"), (4096, "eager"), (4096, "auto")]
)
def test_gradients_equal_transformers_at_the_bench_shape(
    tmp_path: Path, chunk: int, norm_kernel: str
) -> None:
    """fp32, two 4,096-token sequences: every gradient of one step against transformers'
    within 1e-4 (relative L2), at each head chunk the engine uses (1,024 on a CPU, 4,096 on
    CUDA) and with either RMSNorm kernel (``auto`` is the compiled one on CUDA). A head
    gradient 1% off reads about 1e-2 (``head_off_by_1pct``)."""
    g = cases.grads_vs_transformers(
        tmp_path, chunk, (4096, 4096), norm_kernel=norm_kernel, **BENCH_HEAD
    )
    print(f"chunk {chunk}, norm {norm_kernel}: {g}")
    assert g.compiled_norms == (2 * 2 + 1 if norm_kernel == "auto" else 0), g
    assert abs(g.loss[0] - g.loss[1]) <= 1e-5 * g.loss[1], g
    assert g.worst <= 1e-4, g
    assert g.head_off_by_1pct > 1e-3, g


def test_fp32_logprobs_equal_transformers(tmp_path: Path) -> None:
    p = cases.hf_logprob_parity(tmp_path, "fp32", **HF_SHAPE)
    assert p.tokens > 100
    assert p.ours <= 1e-5, f"fp32 log-probs differ from transformers by {p.ours:.2e}"


def test_bf16_logprobs_are_as_close_as_transformers_own_bf16(tmp_path: Path) -> None:
    """bf16 keeps 8 bits of mantissa: a log-prob moves by ~1e-2 through a few layers whoever
    computes it. The bound is transformers' own bf16 error against the same fp32 reference:
    ours must not be more than twice it (different kernels round differently, no more)."""
    p = cases.hf_logprob_parity(tmp_path, "bf16", **HF_SHAPE)
    assert 0 < p.transformers_same_precision < 0.5
    assert p.ours <= 2 * p.transformers_same_precision, (
        f"bf16 log-probs off by {p.ours:.3e}, transformers' bf16 by "
        f"{p.transformers_same_precision:.3e}"
    )


def test_memory_snapshot_round_trip(artifacts: Path) -> None:
    """start, a train step, stop: an allocator snapshot that torch's own memory_viz reads,
    and our picture of it."""
    from torch.cuda import _memory_viz

    s = cases.memory_snapshot(artifacts, **ENGINE_SHAPE)
    assert s.path.suffix == ".pickle"
    assert {"segments", "device_traces"} <= set(s.snapshot)
    assert any(e.get("action") == "alloc" for trace in s.snapshot["device_traces"] for e in trace)
    # What pytorch.org/memory_viz renders: both views build from our file.
    assert "<html" in _memory_viz.trace_plot(s.snapshot).lower()
    assert "<html" in _memory_viz.segment_plot(s.snapshot).lower()
    assert s.png.startswith(b"\x89PNG") and s.events > 0 and s.peak_bytes > 0
    (artifacts / "memory_snapshot.png").write_bytes(s.png)


def test_bf16_train_loss_falls() -> None:
    losses = cases.losses_over_steps(6, precision="bf16", **ENGINE_SHAPE)
    assert losses[-1] < 0.7 * losses[0], losses


def test_tries_on_flex_attention_equal_flat() -> None:
    """On CUDA, tries attend through one FlexAttention kernel: log-probs, loss, grad norm,
    every gradient and the parameters after a step equal flat packing's within 1e-5 (fp32)."""
    assert torch.cuda.is_available()
    r = cases.tree_vs_flat(**ENGINE_SHAPE)
    assert r.computed_tokens[0] < r.computed_tokens[1]
    assert r.logprobs <= 1e-5
    for tree, flat in (r.loss, r.grad_norm):
        assert abs(tree - flat) <= 1e-5 * abs(flat), (tree, flat)
    assert r.grads <= 1e-5
    assert r.params <= 1e-5


def test_attention_keeps_no_view_of_the_projection_output() -> None:
    """With CUDA's compiled q/k norm + rotation and with the eager one, nothing the attention
    keeps for backward is a view of the fused q/k/v projection's output (which would hold the
    whole buffer until the layer's backward)."""
    for compiled in (True, False):
        v = cases.projection_views_kept(compiled, **ENGINE_SHAPE)
        assert v.layers == ENGINE_SHAPE["num_layers"] and v.saved >= 5, v
        assert v.pinning == 0, v


def test_elementwise_recompute_keeps_no_swiglu_product() -> None:
    """On CUDA (bf16, megatron's fused SwiGLU, which keeps only its input), ``recompute:
    elementwise`` keeps exactly one ``tokens x ffn`` a layer less than ``norms``."""
    norms, e = (cases.kept_for_backward(m, ENGINE_SHAPE) for m in ("norms", "elementwise"))
    assert e.fused_swiglu and e.element == 2, e
    assert norms.kept - e.kept == e.layers * e.rows * e.ffn * e.element, (norms, e)
