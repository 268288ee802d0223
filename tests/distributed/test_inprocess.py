"""The GPU tier's cases (``tests/helpers/device_cases.py``) on the CPU, through the in-process
engine, in a rank-pool process: the code the GPU tier runs is run by every CI run. The bounds
are the GPU tier's."""

from __future__ import annotations

from pathlib import Path

from helpers import device_cases as cases
from helpers.rankpool import RankPool


def test_fp32_and_bf16_logprobs_against_transformers(pool1: RankPool, tmp_path: Path) -> None:
    [fp32] = pool1.run(cases.hf_logprob_parity, tmp_path / "fp32", "fp32")
    assert fp32.tokens > 100 and fp32.ours <= 1e-5, fp32
    [bf16] = pool1.run(cases.hf_logprob_parity, tmp_path / "bf16", "bf16")
    assert 0 < bf16.transformers_same_precision < 0.5, bf16
    assert bf16.ours <= 2 * bf16.transformers_same_precision, bf16


def test_train_loss_falls_in_process(pool1: RankPool) -> None:
    [losses] = pool1.run(cases.losses_over_steps, 6)
    assert losses[-1] < 0.7 * losses[0], losses


def test_memory_profile_round_trip_in_process(pool1: RankPool, tmp_path: Path) -> None:
    [s] = pool1.run(cases.memory_snapshot, tmp_path)
    assert s.path.name.endswith(".trace.json") and s.path.exists()  # the CPU profiler's file
    assert s.png.startswith(b"\x89PNG") and s.events > 0 and s.peak_bytes > 0


def test_tries_equal_flat_in_process(pool1: RankPool) -> None:
    [r] = pool1.run(cases.tree_vs_flat)
    assert r.computed_tokens[0] < r.computed_tokens[1]
    assert r.logprobs <= 1e-5
    for tree, flat in (r.loss, r.grad_norm):
        assert abs(tree - flat) <= 1e-5 * abs(flat), (tree, flat)
    assert r.grads <= 1e-5
    assert r.params <= 1e-5


def test_gradients_equal_transformers_at_each_head_chunk(pool1: RankPool, tmp_path: Path) -> None:
    """fp32: every gradient of one step equals transformers' within 1e-5 (relative L2) with
    the fused head in chunks of 64 (8 chunks), 256 and 1,024 (the CPU's default: one chunk);
    a head gradient 1% off would read 1e-2."""
    for chunk in (64, 256, 1024):
        [g] = pool1.run(cases.grads_vs_transformers, tmp_path / str(chunk), chunk)
        assert g.tensors >= 10 and abs(g.loss[0] - g.loss[1]) <= 1e-5 * g.loss[1], g
        assert g.worst <= 1e-5, g
        assert g.head_off_by_1pct > 1e-3, g


def test_gradients_equal_transformers_with_the_compiled_norm(
    pool1: RankPool, tmp_path: Path
) -> None:
    """``norm_kernel: compiled``: every residual-stream RMSNorm (two a layer and the final one)
    runs the compiled kernel, and every gradient still equals transformers' within 1e-5."""
    [g] = pool1.run(cases.grads_vs_transformers, tmp_path, 1024, (300, 200), "compiled")
    assert g.compiled_norms == 2 * 2 + 1, g  # the tiny model's two layers
    assert abs(g.loss[0] - g.loss[1]) <= 1e-5 * g.loss[1], g
    assert g.worst <= 1e-5, g


def test_elementwise_recompute_keeps_no_swiglu_product(pool1: RankPool) -> None:
    """``recompute: elementwise`` keeps what ``norms`` keeps but each dense layer's SwiGLU
    product (fc2's input) and what the SwiGLU itself kept beyond fc1's output (the eager
    ops: ``silu(gate)``; the fused kernel: nothing): exactly ``tokens x ffn`` elements a
    layer, or twice that, less at the forward's end; and ``norms`` keeps less than none."""
    none, norms, elementwise = (
        pool1.run(cases.kept_for_backward, mode)[0] for mode in ("none", "norms", "elementwise")
    )
    e = elementwise
    product = e.layers * e.rows * e.ffn * e.element
    assert norms.kept < none.kept, (norms, none)
    assert norms.kept - e.kept == product * (1 if e.fused_swiglu else 2), (norms, e)


def test_elementwise_recompute_keeps_no_expert_product(pool1: RankPool) -> None:
    """The same in MoE layers: each expert's weighted SwiGLU keeps ``silu(gate)`` and its
    product with ``up`` (the eager ops), and fc2 its input; ``elementwise`` keeps none of the
    three, exactly ``3 x rows x ffn`` a layer less than ``norms`` (rows: tokens x top-k)."""
    moe = {"num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 96}
    norms, e = (pool1.run(cases.kept_for_backward, m, moe)[0] for m in ("norms", "elementwise"))
    assert e.experts and e.rows == 2 * 48, e
    assert norms.kept - e.kept == 3 * e.layers * e.rows * e.ffn * e.element, (norms, e)


def test_attention_keeps_no_view_of_the_projection_output(pool1: RankPool) -> None:
    """The k norm's input and the kernel's value are copied out of the fused q/k/v
    projection's output, so that buffer (the query's share too) is freed after each layer's
    forward instead of held until its backward, with the rotation eager (the CPU's) and
    compiled (CUDA's)."""
    for compiled in (False, True):
        [v] = pool1.run(cases.projection_views_kept, compiled)
        assert v.layers == 2 and v.saved >= 5, v  # k norm's input, q/k/v, output, log-sum-exp
        assert v.pinning == 0, v
