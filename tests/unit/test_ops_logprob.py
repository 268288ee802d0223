"""Log-prob kernels on one rank (docs/algorithms.md §3; T3.3-T3.7).

TP > 1 is in tests/distributed."""

from __future__ import annotations

import math

import pytest
import torch

from trainctl.workers.ops import logprob as lp_mod
from trainctl.workers.ops.logprob import vocab_parallel_entropy, vocab_parallel_logprob


def _inputs(b: int, s: int, v: int, oov: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=gen)
    target = torch.randint(0, v, (b, s), generator=gen)
    if oov:
        target[:, ::3] = v + 5  # no rank owns these
    return logits, target


def _grad(logits: torch.Tensor, target: torch.Tensor, cs: int) -> tuple[torch.Tensor, ...]:
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprob(x, target, chunk_size=cs)
    seed = torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)
    lp.backward(seed)
    return lp.detach(), x.grad


@pytest.mark.parametrize("oov", [False, True])
def test_t3_1_forward_matches_log_softmax(oov: bool) -> None:
    logits, target = _inputs(4, 30, 256, oov)
    lp = vocab_parallel_logprob(logits, target)
    ref = torch.log_softmax(logits.double(), -1)
    inside = target < 256
    want = torch.where(inside, ref.gather(-1, target.clamp(max=255)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cs", [1, 3, 7, 16, 32, 64])
@pytest.mark.parametrize("oov", [False, True])
def test_t3_3_chunked_bit_identical(cs: int, oov: bool) -> None:
    logits, target = _inputs(4, 30, 256, oov)
    lp_full, g_full = _grad(logits, target, 0)
    lp_ch, g_ch = _grad(logits, target, cs)
    assert torch.equal(lp_full, lp_ch)
    assert torch.equal(g_full, g_ch)


@pytest.mark.parametrize(
    ("b", "s", "v", "cs", "oov"),
    [(1, 1, 64, 4, False), (2, 8, 64, 32, False), (2, 8, 64, 32, "all"), (2, 9, 8, 4, False)],
)
def test_t3_4_edge_cases(b: int, s: int, v: int, cs: int, oov: bool | str) -> None:
    logits, target = _inputs(b, s, v, False)
    if oov == "all":
        target = torch.full_like(target, v)
    lp_full, g_full = _grad(logits, target, 0)
    lp_ch, g_ch = _grad(logits, target, cs)
    assert torch.equal(lp_full, lp_ch) and torch.equal(g_full, g_ch)
    if oov == "all":
        assert torch.count_nonzero(lp_ch) == 0


def test_t3_5_full_coverage_with_poisoned_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, target = _inputs(3, 17, 128, False)  # S = 17 is prime, cs = 5
    _, g_ref = _grad(logits, target, 0)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(lp_mod.torch, "empty", poisoned)
    _, g = _grad(logits, target, 5)
    assert not torch.isnan(g).any()
    assert torch.equal(g, g_ref)


def test_t3_5_mutation_skipping_last_chunk_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the backward loop skipped its last chunk, the poisoned buffer would leak NaN."""
    logits, target = _inputs(3, 17, 128, False)
    real_range = range

    def short_range(*args):  # drops the last chunk of every chunk loop in the module
        r = real_range(*args)
        return r[:-1] if len(args) == 3 else r

    real_empty = torch.empty
    monkeypatch.setattr(
        lp_mod.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
    )
    monkeypatch.setattr(lp_mod, "range", short_range, raising=False)
    _, g = _grad(logits, target, 5)
    assert torch.isnan(g).any()


def test_t3_6_no_cat_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, target = _inputs(2, 40, 64, False)
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprob(x, target, chunk_size=7)

    def no_cat(*a, **k):
        raise AssertionError("torch.cat in the streamed backward")

    monkeypatch.setattr(torch, "cat", no_cat)
    lp.sum().backward()
    assert x.grad is not None


def test_t3_7_saved_logits_untouched() -> None:
    logits, target = _inputs(2, 20, 64, False)
    x = logits.clone().requires_grad_()
    version = x._version
    lp = vocab_parallel_logprob(x, target, chunk_size=6)
    lp.sum().backward()
    assert x._version == version and torch.equal(x.detach(), logits)


def test_bf16_input_gets_bf16_grad() -> None:
    logits, target = _inputs(2, 9, 32, False)
    x = logits.bfloat16().requires_grad_()
    vocab_parallel_logprob(x, target, chunk_size=4).sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_entropy_matches_reference() -> None:
    logits, _ = _inputs(2, 11, 50, False)
    p = torch.softmax(logits.double(), -1)
    want = -(p * p.log()).sum(-1)
    for cs in (0, 4):
        torch.testing.assert_close(
            vocab_parallel_entropy(logits, chunk_size=cs).double(), want, atol=1e-5, rtol=1e-5
        )


@pytest.fixture
def two_threads():
    """torch with 2 intra-op threads, as on this project's CI machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("cs", [1, 2])
def test_chunked_bit_identical_at_qwen_vocab_with_two_threads(cs: int) -> None:
    """At V = 151,936 torch sums one long row over threads in another order than a row among
    several; the kernels' fixed block order keeps chunked == non-chunked bit for bit."""
    torch.manual_seed(0)
    v = 151_936
    logits = torch.randn(3, v) * 2
    target = torch.randint(0, v, (3,))
    lp_full, g_full = _grad(logits, target, 0)
    lp_chunk, g_chunk = _grad(logits, target, cs)
    assert torch.equal(lp_chunk, lp_full)
    assert torch.equal(g_chunk, g_full)
    # And the value is right: equal to float64 log_softmax within fp32 rounding.
    ref = torch.log_softmax(logits.double(), -1).gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(lp_full.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cs", [0, 1])
def test_entropy_with_minus_inf_logits(cs: int) -> None:
    """A -inf logit (masked or padded vocabulary) has p log p = 0, not 0 * -inf = NaN."""
    got = vocab_parallel_entropy(torch.tensor([[0.0, 0.0, -torch.inf]] * 2), chunk_size=cs)
    torch.testing.assert_close(got, torch.full((2,), math.log(2)), atol=1e-7, rtol=0)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=gen)
    logits[:, ::7] = -torch.inf
    want = torch.distributions.Categorical(logits=logits.double()).entropy()
    got = vocab_parallel_entropy(logits, chunk_size=cs).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_entropy_keeps_nan_from_nan_logits() -> None:
    """Only -inf is forgiven: a NaN logit still poisons its row, so a bug stays visible."""
    got = vocab_parallel_entropy(torch.tensor([[0.0, float("nan"), 1.0], [0.0, 0.0, 0.0]]))
    assert torch.isnan(got[0]) and not torch.isnan(got[1])
