"""Per-token losses reduced CP-locally against global normalisers (docs/algorithms.md §1.5, §2).

The host folds the normaliser into a per-token ``loss_scale`` (``mask * weight / N``, or
``/ (S * n_i)`` for the sequence mean, see ``workers/control/plan.py``), computed on the *global*
batch and split like every other token field. Each rank's loss is then
``sum(term_t * loss_scale_t)`` over its own tokens, never gathering logits, and the sum over
all DP x CP ranks is exactly the single-process loss. The gradient sync must therefore *sum*
over DP x CP, not average.

Terms, with ``lp`` the current log-prob of the target and ``r = exp(lp - old_lp)``:
    cross_entropy        ``-lp``
    importance_sampling  ``-r * A``
    ppo                  ``max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)``
    cispo                ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * lp * A`` (the clipped
                         ratio is a constant weight on the log-prob's gradient)
    dro                  ``-(lp * A - beta / 2 * (lp - old_lp)^2)`` (old_lp: the sampler's)
    gspo                 PPO's term with GSPO-token's ratio ``exp(s + lp - sg(lp))``, ``s`` the
                         sequence's mean log-ratio (``sequence_loss.gspo_log_ratio``: it needs
                         the whole sequence, so the caller computes it and passes
                         ``seq_log_ratio``)
    + kl_coef * k3       ``exp(ref - lp) - (ref - lp) - 1`` (an unbiased, positive KL estimate)

Truncated importance sampling (``tis_cap``): the policy term (not the KL) is multiplied by
``min(exp(old_lp - sampler_lp), tis_cap)``, the capped ratio of the trainer's behaviour
log-probs to the inference engine's, a constant per token (no gradient through it). Its
sequence-level forms (``sequence_loss.behaviour_weights``) arrive as ``seq_weight``, one constant
per sequence on each of its tokens, multiplying the policy term the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0
"""A log-ratio is capped here before ``exp`` (e^20 ~ 5e8), so a ratio stays finite when a
token's (or a sequence's) log-ratio explodes. Every ratio of the losses and metrics uses it."""


def connected_zero(output: Tensor) -> Tensor:
    """A zero loss whose gradient reaches every parameter that produced ``output``.

    ``sum() * 0`` rather than ``mean() * 0``: the mean of an empty tensor is NaN.
    """
    return output.sum() * 0.0


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where the mask is set, 0 elsewhere: pads never reach ``exp``."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


@dataclass(frozen=True)
class PolicyTerms:
    """What a policy loss reads, per token ``[T]``: the current log-probs, the advantages,
    the masked log-ratio to the behaviour policy and its (capped) exponential."""

    logprobs: Tensor
    advantages: Tensor
    delta: Tensor
    """``lp - old_lp`` where the mask is set, 0 elsewhere."""
    ratio: Tensor
    """``exp(delta)``, the exponent capped so it stays finite."""
    clip_low: float
    clip_high: float
    beta: float


POLICY_LOSSES: dict[str, Callable[[PolicyTerms], Tensor]] = {}
"""Every policy loss by its wire name (``api.LossKind``): the functions below marked
``@policy_loss``. Adding a kind is one such function, beside its member in ``api.LossKind``
and its row in ``api/loss.py``'s ``LOSSES`` (what the API, the engine and Tinker read of it)."""


def policy_loss(fn: Callable[[PolicyTerms], Tensor]) -> Callable[[PolicyTerms], Tensor]:
    """Registers ``fn`` as the formula of the loss kind of its name."""
    POLICY_LOSSES[fn.__name__] = fn
    return fn


@policy_loss
def importance_sampling(t: PolicyTerms) -> Tensor:
    return -t.ratio * t.advantages


@policy_loss
def ppo(t: PolicyTerms) -> Tensor:
    clipped = -t.ratio.clamp(1.0 - t.clip_low, 1.0 + t.clip_high) * t.advantages
    return torch.maximum(importance_sampling(t), clipped)


@policy_loss
def cispo(t: PolicyTerms) -> Tensor:
    weight = t.ratio.clamp(1.0 - t.clip_low, 1.0 + t.clip_high).detach()
    return -weight * t.logprobs * t.advantages


@policy_loss
def dro(t: PolicyTerms) -> Tensor:
    return -(t.logprobs * t.advantages - 0.5 * t.beta * t.delta * t.delta)


@policy_loss
def gspo(t: PolicyTerms) -> Tensor:
    """PPO's clipped term; ``t.ratio`` is GSPO-token's (``per_token_terms`` builds it)."""
    return ppo(t)


LOSS_KINDS = ("cross_entropy", *POLICY_LOSSES)
"""Every loss kind: supervised ``cross_entropy`` (``-lp``) and the policy losses."""


def per_token_terms(
    logprobs: Tensor,
    *,
    kind: str = "cross_entropy",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    beta: float = 0.0,
    tis_cap: float | None = None,
    loss_mask: Tensor,
    advantages: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    seq_log_ratio: Tensor | None = None,
    seq_weight: Tensor | None = None,
    sequence_ratio: bool = False,
) -> Tensor:
    """Loss term of every token ``[T]`` (0 where the mask is 0).

    ``kind``: ``cross_entropy`` or a policy loss of ``POLICY_LOSSES`` (``clip_low`` /
    ``clip_high``: the ratio's clip distances from 1; ``beta``: ``dro``'s quadratic penalty);
    ``tis_cap`` truncates importance sampling against the sampler; ``kl_coef`` adds the k3
    estimate of the KL to the reference policy. ``seq_log_ratio`` (gspo's ratio, per token) and
    ``seq_weight`` (a sequence-level behaviour correction, per token) come from
    ``workers/ops/sequence_loss.py``."""
    if kind == "cross_entropy":
        terms = -logprobs
    elif kind in POLICY_LOSSES:
        if advantages is None or old_logprobs is None:
            raise ValueError(f"{kind} loss needs advantages and old_logprobs")
        delta = _masked(logprobs - old_logprobs, loss_mask)
        if sequence_ratio:  # every token takes its sequence's ratio
            if seq_log_ratio is None:
                raise ValueError(f"{kind} loss needs seq_log_ratio (sequence_loss.gspo_log_ratio)")
            ratio = _masked(seq_log_ratio, loss_mask).clamp(max=MAX_LOG_RATIO).exp()
        else:
            ratio = delta.clamp(max=MAX_LOG_RATIO).exp()
        policy = PolicyTerms(logprobs, advantages, delta, ratio, clip_low, clip_high, beta)
        terms = POLICY_LOSSES[kind](policy)
    else:
        raise ValueError(f"unknown loss kind {kind!r}; one of {LOSS_KINDS}")
    if tis_cap is not None:
        if kind == "cross_entropy":
            raise ValueError("tis_cap corrects a policy loss, not cross_entropy")
        if sampler_logprobs is None or old_logprobs is None:
            raise ValueError("tis_cap needs old_logprobs and sampler_logprobs")
        behaviour = _masked(old_logprobs - sampler_logprobs, loss_mask).clamp(max=MAX_LOG_RATIO)
        terms = terms * behaviour.exp().clamp(max=tis_cap).detach()
    if seq_weight is not None:
        if kind == "cross_entropy":
            raise ValueError("a sequence-level correction weights a policy loss, not cross_entropy")
        terms = terms * seq_weight.detach()
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        d = _masked(ref_logprobs - logprobs, loss_mask).clamp(max=MAX_LOG_RATIO)
        terms = terms + kl_coef * (d.exp() - d - 1.0)
    return _masked(terms, loss_mask)


def local_loss(terms: Tensor, loss_scale: Tensor) -> Tensor:
    """This rank's share of the global loss: ``sum(term * scale)`` over its own tokens."""
    return (terms * loss_scale).sum()
