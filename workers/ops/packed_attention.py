"""Causal attention within each sequence of a packed buffer, linear in the number of sequences.

The packed buffer holds sequences back to back (boundaries ``cu``, host integers). Attention
must not cross a boundary, and must cost the same per token whether the buffer holds one
sequence of 4,096 tokens or 64 of 64. Three ways, picked per call:

* **varlen** (CUDA, bf16/fp16, no dropout): one flash-attention call over the whole buffer
  (``torch.nn.attention.varlen.varlen_attn``), causal, grouped heads native.
* **runs**: the sequences cut into runs of equal length (``[4096] * 4 + [512] * 32`` is two
  runs); each run is one batched ``scaled_dot_product_attention`` on a *view* of its rows
  (``[n, L, heads, dim]``), and the runs' outputs are concatenated. A buffer of one length is
  one call with no copy at all.
* grouped-query heads go to SDPA as they are (``enable_gqa``) where its kernel supports them
  (``gqa_native``), and are copied to full heads only where it does not (on CUDA: a mask, or
  fp32, where the memory-efficient kernel would otherwise fall back to the math one).

What it avoids: ``x[start:end]`` per sequence, whose backward writes a full-size zero gradient
per slice that autograd then adds up (bytes grow with tokens x sequences), and
``repeat_interleave`` of K/V in every layer.

Context parallelism (``cp_packed_attention``): the queries are this rank's zigzag chunks, the
keys and values every rank's (gathered by the caller, global order); each sequence attends with
a mask over global positions.

Shapes: ``query [t, np, hn]``, ``key/value [t, ng, hn]`` (``np`` a multiple of ``ng``) ->
``[t, np, hn]``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_HALF = (torch.bfloat16, torch.float16)


def gqa_native(q: Tensor, *, masked: bool) -> bool:
    """Whether SDPA's kernel for these inputs takes fewer key/value heads without a copy: the
    CPU flash kernel does (with a mask too); on CUDA the flash and cuDNN kernels do (half
    precision, no mask). Elsewhere the memory-efficient kernel would fall back to the math one,
    which builds the ``[s, s]`` scores."""
    if q.device.type == "cpu":
        return True
    return q.dtype in _HALF and not masked


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
) -> Tensor:
    """``q [b, np, sq, hn]``, ``k/v [b, ng, sk, hn]`` -> ``[b, np, sq, hn]``; causal unless
    ``mask [sq, sk]`` (True = attend) is given."""
    extra: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if gqa_native(q, masked=mask is not None):
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p, scale=scale,
        **extra,
    )  # fmt: skip


def equal_runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``(length, count)`` of each run of consecutive equal, non-zero lengths, in order (empty
    sequences hold no rows and are dropped)."""
    runs: list[tuple[int, int]] = []
    for length, group in itertools.groupby(n for n in lengths if n):
        runs.append((length, sum(1 for _ in group)))
    return runs


def _run_attention(
    q: Tensor, k: Tensor, v: Tensor, length: int, count: int, scale: float, dropout_p: float
) -> Tensor:
    """One batched causal call over ``count`` sequences of ``length`` rows each, as views."""
    qs, ks, vs = (x.unflatten(0, (count, length)).transpose(1, 2) for x in (q, k, v))
    out = sdpa(qs, ks, vs, scale=scale, dropout_p=dropout_p)  # [count, np, length, hn]
    return out.transpose(1, 2).reshape(count * length, q.shape[1], q.shape[2])


@functools.cache
def _varlen() -> tuple[Callable[..., Tensor], dict[str, Any]] | None:
    """torch's varlen flash attention and its causal keyword arguments, or None where this
    torch has none. Its causal argument changed in 2026 (``is_causal`` -> ``window_size``),
    so the signature decides."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    fn: Callable[..., Tensor] = varlen_attn  # type: ignore[assignment]  # no return_aux: a tensor
    return fn, kw


VARLEN_MIN_RUNS = 4
"""Above this many runs, ``auto`` takes the varlen kernel. On an H200 (bf16, 16 / 8 heads of
128, forward + backward) cuDNN's batched SDPA beat torch's varlen flash at 4 x 4096 (2.1 against
3.9 ms), 32 x 512 (1.0 against 1.2) and 32 x 512 + 4 x 4096 (2.8 against 4.8), but each extra
call costs ~0.35 ms: 32 sequences of 32 lengths as 32 calls took 12.5 ms, varlen 1.2."""

_varlen_failed: list[str] = []
"""Why varlen attention was given up in this process (its first call raised), if it was."""


def varlen_usable(q: Tensor, dropout_p: float) -> bool:
    """Flash attention: CUDA, half precision, no dropout, and this torch has it."""
    return (
        q.is_cuda and q.dtype in _HALF and dropout_p == 0.0 and not _varlen_failed
        and _varlen() is not None
    )  # fmt: skip


def packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Sequence[int],
    *,
    scale: float,
    dropout_p: float = 0.0,
    cu_device: Tensor | None = None,
    max_len: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Causal attention within each sequence ``[cu[i], cu[i+1])`` (see the module docstring).

    ``cu_device`` (int32 on the query's device) and ``max_len`` let the varlen kernel run;
    ``backend``: ``auto``, or ``runs`` / ``varlen`` to force one (the probe compares them)."""
    if cu[0] != 0 or cu[-1] != query.shape[0]:
        raise ValueError(f"boundaries {cu[0]}..{cu[-1]} do not cover {query.shape[0]} rows")
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    runs = equal_runs(lengths)
    want_varlen = backend == "varlen" or (
        backend == "auto" and len(runs) > VARLEN_MIN_RUNS and cu_device is not None
        and varlen_usable(query, dropout_p)
    )  # fmt: skip
    if want_varlen:
        got = _varlen_call(
            query, key, value, cu, cu_device, max_len, scale, strict=backend != "auto"
        )
        if got is not None:
            return got
    # One split per tensor (its backward is one concatenation), never a slice per run.
    sizes = [length * count for length, count in runs]
    parts = zip(query.split(sizes), key.split(sizes), value.split(sizes), strict=True)
    outs = [
        _run_attention(q, k, v, length, count, scale, dropout_p)
        for (length, count), (q, k, v) in zip(runs, parts, strict=True)
    ]
    if not outs:
        return query.new_empty(query.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _varlen_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: Sequence[int],
    cu_device: Tensor | None,
    max_len: int | None,
    scale: float,
    *,
    strict: bool,
) -> Tensor | None:
    found = _varlen()
    if found is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    fn, kw = found
    if cu_device is None:
        cu_device = torch.tensor(list(cu), dtype=torch.int32, device=q.device)
    if max_len is None:
        max_len = max(b - a for a, b in itertools.pairwise(cu))
    if "enable_gqa" not in kw and q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    try:
        return fn(q, k, v, cu_device, cu_device, max_len, max_len, scale=scale, **kw)
    except (RuntimeError, NotImplementedError) as e:
        if strict:
            raise
        # A GPU or build without the flash kernel: the runs path, from now on.
        _varlen_failed.append(f"{type(e).__name__}: {e}")
        return None


def cp_packed_attention(
    query: Tensor,
    key_all: Tensor,
    value_all: Tensor,
    cu: Sequence[int],
    *,
    cp_size: int,
    cp_rank: int,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Context parallelism: ``query [t / cp, np, hn]`` holds the zigzag chunks ``r`` and
    ``2c-1-r`` of every sequence (``cu`` = global padded boundaries), ``key_all/value_all
    [t, ng, hn]`` every rank's rows in global order. The causal mask compares *global*
    positions inside each sequence."""
    c, r = cp_size, cp_rank
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    qs = query.split([n // c for n in lengths])
    ks, vs = key_all.split(lengths), value_all.split(lengths)
    late = 2 * c - 1 - r
    outs = []
    for length, q, k, v in zip(lengths, qs, ks, vs, strict=True):
        if length == 0:
            continue
        h = length // (2 * c)
        dev = query.device
        q_pos = torch.cat(
            [torch.arange(r * h, (r + 1) * h, device=dev),
             torch.arange(late * h, (late + 1) * h, device=dev)]
        )  # fmt: skip
        allowed = q_pos[:, None] >= torch.arange(length, device=dev)[None, :]  # [2h, L]
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = sdpa(q4, k4, v4, scale=scale, dropout_p=dropout_p, mask=allowed)
        outs.append(out[0].transpose(0, 1))
    if not outs:
        return query.new_empty(query.shape)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
