"""Rotary embedding from per-micro-batch tables: megatron's formula bit for bit in eager mode,
and its compiled form (what CUDA runs) equal to it and compiled once for every pack size."""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from trainctl.workers.ops.rope import RotaryTables, apply_rope, compiled_rope


def _freqs(tokens: int, rot_dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (tokens,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    f = torch.outer(pos, inv)
    return torch.cat((f, f), dim=-1)[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [32, 16], ids=["whole-head", "rotary-percent-half"])
def test_equal_to_megatrons_rotary_bit_for_bit(dtype: torch.dtype, rot_dim: int) -> None:
    x = torch.randn(57, 4, 32).to(dtype)
    freqs = _freqs(57, rot_dim)
    tab = RotaryTables.of(freqs, dtype)
    assert torch.equal(apply_rope(x, tab.cos, tab.sin), _apply_rotary_pos_emb_bshd(x, freqs))


def test_compiled_equals_eager_and_compiles_once_for_every_pack_size() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled_rope.cache_clear()
    before = counters["stats"]["unique_graphs"]
    rope = compiled_rope()
    for tokens in (37, 100, 513):
        x = torch.randn(tokens, 4, 32, requires_grad=True)
        tab = RotaryTables.of(_freqs(tokens, 32, seed=tokens), torch.float32)
        got = rope(x, tab.cos, tab.sin)
        want = apply_rope(x, tab.cos, tab.sin)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        g = torch.randn_like(got)
        (dx,) = torch.autograd.grad(got, x, g)
        (dx_want,) = torch.autograd.grad(want, x, g)
        torch.testing.assert_close(dx, dx_want, rtol=0, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1, dict(counters["stats"])


@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "zero-centred"])
def test_norm_then_rotation_compiled_equals_the_modules_in_turn(zero_centered: bool) -> None:
    """Qwen3's q/k norm and the rotation as one compiled function equal the engine's norm
    module followed by the eager rotation; the eager form of the pair is bit for bit the two
    in turn. The weight's gradient sums over every token and head, in another order compiled:
    its tolerance is relative to its largest entry."""
    from trainctl.workers.ops.norm import rms_norm
    from trainctl.workers.ops.rope import compiled_norm_rope, norm_rope

    for tokens in (37, 100):
        torch.manual_seed(tokens)
        x = torch.randn(tokens, 4, 32, requires_grad=True)
        w = (torch.randn(32) * 0.1 + (0.0 if zero_centered else 1.0)).requires_grad_()
        tab = RotaryTables.of(_freqs(tokens, 32, seed=tokens), torch.float32)
        want = apply_rope(rms_norm(x, w, 1e-6, zero_centered), tab.cos, tab.sin)
        assert torch.equal(norm_rope(x, w, 1e-6, tab.cos, tab.sin, zero_centered), want)
        got = compiled_norm_rope()(x, w, 1e-6, tab.cos, tab.sin, zero_centered)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        g = torch.randn_like(got)
        for a, b in zip(
            torch.autograd.grad(got, (x, w), g), torch.autograd.grad(want, (x, w), g), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_the_compiled_rotation_takes_more_variants_than_torchs_default_in_a_worker_thread() -> None:
    """q and k (other heads and strides), grad on and off, two dtypes and two eps: 16 graphs of
    one function, in a thread other than the one that made it (dynamo's settings are per
    thread; a rank steps in a worker thread). torch's default limit of 8 failed the GPU tier."""
    import threading

    from trainctl.workers.ops.rope import compiled_norm_rope

    fn = compiled_norm_rope()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for dtype, eps, grad, heads in itertools.product(
                (torch.float32, torch.bfloat16), (1e-6, 1e-5), (True, False), (4, 2)
            ):
                tab = RotaryTables.of(_freqs(40, 16), dtype)
                x = torch.randn(40, heads, 16, dtype=dtype)
                w = torch.ones(16, dtype=dtype)
                with torch.set_grad_enabled(grad):
                    fn(x, w, eps, tab.cos, tab.sin)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
