"""The reshardable checkpoint format: training state by canonical name, so a checkpoint
written at one parallel layout loads at any other.

Every rank writes the *pieces* it owns of each canonical tensor
(``workers/engine/weights.py``): the parameter's fp32 value (the master weight under bf16),
AdamW's two moments and its step.
A piece is one flat range ``[lo, hi)`` of one TP rank's shard of the tensor:

* with the distributed optimizer (ZeRO-1), each DP x CP rank writes the range of every
  parameter its optimizer owns, so the ranks of a replica write disjoint ranges;
* without it, replica 0 writes whole shards (dense tensors: DP x CP rank 0; experts:
  expert-data-parallel rank 0), and no state is written twice;
* a tied output embedding is the input embedding's copy and is not written.

Loading indexes the pieces of every file (read through ``mmap``: only the pages a rank
needs are read) and cuts this rank's shard for the new layout straight from the writer's
shards it overlaps, reading only the ranges it needs; a range no piece covers is an error
naming the tensor. Nothing in the format depends on the writer's DP, CP, PP or EP; its TP
only decides how the pieces are cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainctl.workers.engine import weights

FORMAT = "reshardable-1"
"""The format tag of a rank file of this kind (a per-rank file has none)."""

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state besides its step, as torch names it."""


@dataclass(frozen=True)
class OptimizerSlot:
    """Where the optimizer keeps one model parameter: its main tensor (the parameter itself,
    its fp32 master, or the master of this rank's ZeRO range), the range ``[lo, hi)`` of the
    flattened parameter that main tensor holds, and the inner torch optimizer whose state is
    keyed by it."""

    main: Tensor
    lo: int
    hi: int
    inner: torch.optim.Optimizer

    @property
    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.inner.state[self.main]
        return state


def optimizer_slots(optimizer: Any) -> dict[Tensor, OptimizerSlot]:
    """Model parameter -> its ``OptimizerSlot``, for megatron's optimizers (chained or not):
    the distributed one, the bf16 one with fp32 masters, and the fp32 one."""
    out: dict[Tensor, OptimizerSlot] = {}
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = o.optimizer
        if hasattr(o, "model_param_group_index_map"):  # DistributedOptimizer
            for p, (gi, go) in o.model_param_group_index_map.items():
                r = o._get_model_param_range_map(p)["param"]
                out[p] = OptimizerSlot(inner.param_groups[gi]["params"][go], r.start, r.end, inner)
        elif hasattr(o, "float16_groups"):  # bf16 parameters with fp32 masters
            for model, main in zip(o.float16_groups, o.fp32_from_float16_groups, strict=True):
                for p, m in zip(model, main, strict=True):
                    out[p] = OptimizerSlot(m, 0, p.numel(), inner)
            for group in o.fp32_from_fp32_groups:
                for p in group:
                    out[p] = OptimizerSlot(p, 0, p.numel(), inner)
        else:  # fp32 parameters, trained in place
            for group in inner.param_groups:
                for p in group["params"]:
                    out[p] = OptimizerSlot(p, 0, p.numel(), inner)
    return out


def _host(t: Tensor) -> Tensor:
    """An fp32 copy in host memory: no second copy of the state on the device while it is
    written, and never a view (``torch.save`` of a view writes the whole storage)."""
    return t.to(device="cpu", dtype=torch.float32, copy=True)


@dataclass(frozen=True)
class Param:
    """One local parameter as the format sees it: its canonical name, the live tensor, whether
    this rank is replica 0 for it, and its optimizer slot (None: frozen)."""

    canon: str
    tensor: Tensor
    replica0: bool
    slot: OptimizerSlot | None


def pieces(params: Iterable[Param], *, tp_rank: int, tp: int, zero: bool) -> dict[str, Any]:
    """What this rank writes: canonical name -> its piece (plain containers and tensors, for
    ``torch.load(weights_only=True)``), every tensor an fp32 copy in host memory."""
    out: dict[str, Any] = {}
    for p in params:
        s = p.slot
        if zero and p.tensor.requires_grad:  # the optimizer's owner of each range writes it
            if s is None or s.hi <= s.lo:
                continue
            lo, hi = s.lo, s.hi
        elif p.replica0:
            lo, hi = 0, p.tensor.numel()
        else:
            continue
        value = (s.main if s is not None else p.tensor).detach().reshape(-1)
        if s is None or not zero:
            value = value[lo:hi]
        piece: dict[str, Any] = {
            "tp": tp_rank, "tp_size": tp, "shape": list(p.tensor.shape), "lo": lo, "hi": hi,
            "param": _host(value),
        }  # fmt: skip
        state = s.state if s is not None else {}
        if all(k in state for k in MOMENTS):
            piece["step"] = float(state["step"]) if "step" in state else 0.0
            for k in MOMENTS:
                piece[k] = _host(state[k].detach().reshape(-1))
        out[p.canon] = piece
    return out


class Pieces:
    """Owns the index of one part of a checkpoint (the base, or one adapter): the pieces of
    every rank file by canonical name, and cutting any TP rank's shard of a tensor from
    them."""

    def __init__(self, parts: Iterable[dict[str, Any]]) -> None:
        self.index: dict[str, list[dict[str, Any]]] = {}
        for part in parts:
            for name, piece in part.items():
                self.index.setdefault(name, []).append(piece)

    def full_shape(self, name: str) -> tuple[int, ...]:
        p = self.index[name][0]
        return weights.shard_rule(name).full_shape(torch.Size(p["shape"]), p["tp_size"])

    def has_moments(self, name: str) -> bool:
        return all(MOMENTS[0] in p for p in self.index.get(name, ()))

    def step(self, name: str) -> float:
        return float(self.index[name][0].get("step", 0.0))

    def shard(
        self, name: str, tp_rank: int, tp: int, kind: str = "param", flat: slice | None = None
    ) -> Tensor:
        """TP rank ``tp_rank`` of ``tp``'s shard of ``name`` (``kind``: ``param`` or a
        moment), a tensor of its own: cut from the writer's shards it overlaps, reading only
        the ranges of their pieces it needs, so no rank holds the whole tensor unless its
        shard is the whole. ``flat``: only that range of the flattened shard (a ZeRO rank's
        moments). A ValueError names what no file holds."""
        if name not in self.index:
            raise ValueError(f"checkpoint: it holds no {name}")
        rule = weights.shard_rule(name)
        first = self.index[name][0]
        writers = first["tp_size"]
        span = (0, None) if flat is None else (flat.start, flat.stop)
        if rule.kind == "replicated":  # every writer holds all of it: the first whole one
            problems = []
            for rank in sorted({p["tp"] for p in self.index[name]}):
                try:
                    return self._writer(name, rank, kind).range(*span)
                except ValueError as e:
                    problems.append(str(e))
            raise ValueError("; ".join(problems))
        if writers == tp:  # the writer's TP: its shard as it is
            return self._writer(name, tp_rank, kind).range(*span)
        if flat is not None:
            return self.shard(name, tp_rank, tp, kind).reshape(-1)[flat].clone()
        dim, blocks = (0, 2) if rule.kind == "glu" else (rule.dim, 1)
        shape = list(first["shape"])  # one writer shard's
        per_writer = shape[dim] // blocks  # a block's length in one writer shard
        per_reader = per_writer * writers // tp
        lo, hi = tp_rank * per_reader, (tp_rank + 1) * per_reader
        cuts = []
        for b in range(blocks):
            for k in range(lo // per_writer, -(-hi // per_writer)):
                base = b * per_writer - k * per_writer  # block b of writer k, less its offset
                a, z = base + max(lo, k * per_writer), base + min(hi, (k + 1) * per_writer)
                cuts.append(self._writer(name, k, kind).cut(shape, dim, a, z))
        return cuts[0] if len(cuts) == 1 else torch.cat(cuts, dim=dim)

    def _writer(self, name: str, tp_rank: int, kind: str) -> _Shard:
        parts = sorted((p for p in self.index[name] if p["tp"] == tp_rank), key=lambda p: p["lo"])
        if not parts:
            raise ValueError(f"checkpoint: {name} lacks TP shard {tp_rank}")
        return _Shard(name, tp_rank, parts, kind)

    def full(self, name: str, kind: str = "param") -> Tensor:
        """The whole canonical tensor ``name``, from the pieces of every file."""
        return self.shard(name, 0, 1, kind)


_CHUNK = 1 << 22
"""Elements of a writer shard read at once while cutting across its rows (16 MiB in fp32)."""


@dataclass
class _Shard:
    """One writer TP shard of a tensor as its flat pieces (sorted, ``mmap``-backed): ranges
    of it and cuts along a dimension, read without putting the whole shard together."""

    name: str
    tp: int
    parts: list[dict[str, Any]]
    kind: str

    def range(self, lo: int, hi: int | None) -> Tensor:
        """Flat elements ``[lo, hi)`` (``hi`` None: to the end, shaped as the shard), a new
        tensor; the pieces must cover them."""
        shape = self.parts[0]["shape"]
        whole = hi is None
        hi = int(torch.Size(shape).numel()) if hi is None else hi
        out = torch.empty(hi - lo, dtype=torch.float32)
        at = lo
        for p in self.parts:
            if p["hi"] <= at:
                continue
            if p["lo"] > at or at >= hi:
                break
            if self.kind not in p:
                raise ValueError(f"checkpoint: {self.name} has no {self.kind}")
            end = min(hi, p["hi"])
            out[at - lo : end - lo] = p[self.kind][at - p["lo"] : end - p["lo"]]
            at = end
        if at != hi:
            raise ValueError(f"checkpoint: {self.name} (TP shard {self.tp}) lacks elements {at}..")
        return out.view(shape) if whole else out

    def cut(self, shape: list[int], dim: int, a: int, z: int) -> Tensor:
        """Indices ``[a, z)`` of dimension ``dim`` of this shard (of ``shape``), a new
        tensor: a contiguous range of each outer row, read a bounded chunk at a time."""
        outer = math.prod(shape[:dim])
        rest = math.prod(shape[dim + 1 :])
        cut_shape = (*shape[:dim], z - a, *shape[dim + 1 :])
        if outer == 1:  # a cut along the first dimension: one flat range
            return self.range(a * rest, z * rest).view(cut_shape)
        span = shape[dim] * rest  # one outer row
        out = torch.empty(outer, z - a, rest, dtype=torch.float32)
        if span > _CHUNK:  # each outer row's range alone
            for o in range(outer):
                out[o] = self.range(o * span + a * rest, o * span + z * rest).view(z - a, rest)
        else:  # whole outer rows, a chunk of them at a time
            rows = _CHUNK // span
            for o in range(0, outer, rows):
                e = min(outer, o + rows)
                got = self.range(o * span, e * span).view(e - o, shape[dim], rest)
                out[o:e] = got[:, a:z]
        return out.view(cut_shape)


@dataclass
class Reader:
    """Every rank file of one checkpoint, read lazily (``mmap``): the writer's scalars
    (``meta``), the base's pieces, and each adapter's spec, step and pieces."""

    meta: dict[str, Any]
    base: Pieces
    adapters: dict[str, tuple[dict[str, Any], int, Pieces]]

    @classmethod
    def of(cls, files: list[dict[str, Any]], where: str = "checkpoint") -> Reader:
        """The reader of a checkpoint's rank files (``files.read``, ``mmap``-backed), in rank
        order; a ValueError unless every one is of this format."""
        if not files:
            raise ValueError(f"{where}: no rank files")
        for i, f in enumerate(files):
            if f.get("format") != FORMAT:
                raise ValueError(f"{where}: rank file {i} is not {FORMAT}")
        first = files[0]
        adapters = {
            name: (a["spec"], int(a["step"]), Pieces(f["adapters"][name]["pieces"] for f in files))
            for name, a in first["adapters"].items()
        }
        return cls(first["meta"], Pieces(f["pieces"] for f in files), adapters)


@dataclass
class Staged:
    """One local parameter's values cut from a checkpoint, waiting to be applied."""

    canon: str
    tensor: Tensor
    slot: OptimizerSlot | None
    value: Tensor
    moments: dict[str, Tensor] | None
    step: float


def stage(saved: Pieces, params: Iterable[Param], *, tp_rank: int, tp: int) -> list[Staged]:
    """This rank's shard of every parameter (and of its moments, where the checkpoint has
    them), checked against the live shapes; changes nothing."""
    out = []
    problems = []
    for p in params:
        rule = weights.shard_rule(p.canon)
        want = rule.full_shape(p.tensor.shape, tp)
        if p.canon not in saved.index:
            problems.append(f"{p.canon} is not in the checkpoint")
            continue
        got = saved.full_shape(p.canon)
        if got != want:
            problems.append(f"{p.canon} has shape {list(got)} there, {list(want)} here")
            continue
        value = saved.shard(p.canon, tp_rank, tp)
        moments = None
        if p.slot is not None and saved.has_moments(p.canon):
            ours = slice(p.slot.lo, p.slot.hi)  # this rank's optimizer range alone
            moments = {k: saved.shard(p.canon, tp_rank, tp, k, ours) for k in MOMENTS}
        out.append(Staged(p.canon, p.tensor, p.slot, value, moments, saved.step(p.canon)))
    if problems:
        raise ValueError(
            f"checkpoint: it does not fit this model ({len(problems)} tensors): "
            + "; ".join(problems[:4])
        )
    return out


@torch.no_grad()
def apply(staged: Iterable[Staged], *, optimizer: bool = True) -> None:
    """Copy staged values in: the live parameter, its main tensor's range, and AdamW's state
    (each parameter its own ``step`` tensor). Without ``optimizer``, or where the checkpoint
    holds no moments, AdamW starts afresh for that parameter."""
    for s in staged:
        s.tensor.copy_(s.value.to(s.tensor.dtype))
        if s.slot is None:
            continue
        slot = s.slot
        flat = s.value.reshape(-1)[slot.lo : slot.hi]
        slot.main.copy_(flat.view(slot.main.shape).to(slot.main.dtype))
        slot.inner.state.pop(slot.main, None)
        if optimizer and s.moments is not None:
            state: dict[str, Any] = {
                "step": torch.tensor(s.step, dtype=torch.float32, device=slot.main.device)
            }
            for k, v in s.moments.items():
                part = v.view(slot.main.shape)  # staged as this rank's range
                state[k] = part.to(device=slot.main.device, dtype=slot.main.dtype).clone()
            slot.inner.state[slot.main] = state


def params_of(
    chunks: Iterable[Any],
    slots: dict[Tensor, OptimizerSlot],
    *,
    ep_rank: int,
    local_experts: int,
    replica0: Callable[[str], bool],
    tied: bool,
) -> Iterator[Param]:
    """Every parameter of ``chunks`` as ``Param``s; ``replica0``: whether this rank holds
    replica 0 of a parameter (by its local name); ``tied``: include the tied output embedding
    (a load fills it from the embedding; a save leaves it out)."""
    for c in chunks:
        names = weights.canonical_names(c.module, ep_rank=ep_rank, local_experts=local_experts)
        for name, t in c.module.named_parameters():
            if weights.is_tied_copy(t) and not tied:
                continue
            yield Param(names[name], t, replica0(name), slots.get(t))


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank's torch RNG after a load: derived from the model seed, the step and
    the rank, so a resume on another layout needs no state of the writer's ranks."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (2**63)
