"""The reshardable checkpoint format: training state by canonical name, so a checkpoint
written at one parallel layout loads at any other.

Every rank writes the *pieces* it owns of each canonical tensor (``weights.py``): the
parameter's fp32 value (the master weight under bf16), AdamW's two moments and its step.
A piece is one flat range ``[lo, hi)`` of one TP rank's shard of the tensor:

* with the distributed optimizer (ZeRO-1), each DP x CP rank writes the range of every
  parameter its optimizer owns, so the ranks of a replica write disjoint ranges;
* without it, replica 0 writes whole shards (dense tensors: DP x CP rank 0; experts:
  expert-data-parallel rank 0), and no state is written twice;
* a tied output embedding is the input embedding's copy and is not written.

Loading puts each canonical tensor back together from the pieces of every file (read through
``mmap``: only the pages a rank needs are read), checks that the pieces cover it, and cuts
this rank's shard of it for the new layout. Nothing in the format depends on the writer's
DP, CP, PP or EP; its TP only decides how the pieces are cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
        return self.inner.state[self.main]  # type: ignore[index]


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
    every rank file by canonical name, and putting a tensor back together from them."""

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

    def shard(self, name: str, tp_rank: int, tp: int, kind: str = "param") -> Tensor:
        """TP rank ``tp_rank`` of ``tp``'s shard of ``name`` (a tensor of its own, not a view
        of the whole): put together from that rank's pieces alone where the writer's TP was
        the same, else cut from the whole tensor."""
        rule = weights.shard_rule(name)
        pieces = self.index.get(name, [])
        if pieces and rule.kind != "replicated" and pieces[0]["tp_size"] == tp:
            return _assemble(name, [p for p in pieces if p["tp"] == tp_rank], kind)
        return rule.shard(self.full(name, kind), tp_rank, tp).clone()

    def full(self, name: str, kind: str = "param") -> Tensor:
        """The whole canonical tensor ``name`` (``kind``: ``param`` or a moment), from the
        pieces of every file; a ValueError says which part no file holds."""
        if name not in self.index:
            raise ValueError(f"checkpoint: it holds no {name}")
        rule = weights.shard_rule(name)
        by_tp: dict[int, list[dict[str, Any]]] = {}
        for p in self.index[name]:
            by_tp.setdefault(p["tp"], []).append(p)
        tp = self.index[name][0]["tp_size"]
        shards: dict[int, Tensor] = {}
        problems = []
        for rank in sorted(by_tp):
            try:
                shards[rank] = _assemble(name, by_tp[rank], kind)
            except ValueError as e:
                problems.append(str(e))
                continue
            if rule.kind == "replicated":  # every TP rank holds all of it: one will do
                return shards[rank]
        if problems or len(shards) != tp:
            missing = sorted(set(range(tp)) - set(shards))
            raise ValueError("; ".join(problems) or f"checkpoint: {name} lacks TP shards {missing}")
        return rule.unshard_ranks(shards, tp)


@dataclass
class Reader:
    """Every rank file of one checkpoint, read lazily (``mmap``): the writer's scalars
    (``meta``), the base's pieces, and each adapter's spec, step and pieces."""

    meta: dict[str, Any]
    base: Pieces
    adapters: dict[str, tuple[dict[str, Any], int, Pieces]]

    @classmethod
    def open(cls, directory: Path) -> Reader:
        paths = sorted(directory.glob("rank-*.pt"))
        if not paths:
            raise ValueError(f"checkpoint {directory.name}: no rank files")
        files = [torch.load(f, map_location="cpu", weights_only=True, mmap=True) for f in paths]
        for f, path in zip(files, paths, strict=True):
            if f.get("format") != FORMAT:
                raise ValueError(f"checkpoint {directory.name}: {path.name} is not {FORMAT}")
        first = files[0]
        adapters = {
            name: (a["spec"], int(a["step"]), Pieces(f["adapters"][name]["pieces"] for f in files))
            for name, a in first["adapters"].items()
        }
        return cls(first["meta"], Pieces(f["pieces"] for f in files), adapters)


def _assemble(name: str, parts: list[dict[str, Any]], kind: str) -> Tensor:
    """One TP shard of ``name`` from its flat pieces; they must cover it exactly once."""
    shape = parts[0]["shape"]
    numel = int(torch.Size(shape).numel())
    flat = torch.empty(numel, dtype=torch.float32)
    at = 0
    for p in sorted(parts, key=lambda p: p["lo"]):
        if p["lo"] != at:
            raise ValueError(f"checkpoint: {name} (TP shard {p['tp']}) lacks elements {at}..")
        if kind not in p:
            raise ValueError(f"checkpoint: {name} has no {kind}")
        flat[p["lo"] : p["hi"]] = p[kind]
        at = p["hi"]
    if at != numel:
        raise ValueError(f"checkpoint: {name} (TP shard {parts[0]['tp']}) lacks elements {at}..")
    return flat.view(shape)


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
            moments = {k: saved.shard(p.canon, tp_rank, tp, k) for k in MOMENTS}
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
        slot.inner.state.pop(slot.main, None)  # type: ignore[call-overload]
        if optimizer and s.moments is not None:
            state: dict[str, Any] = {
                "step": torch.tensor(s.step, dtype=torch.float32, device=slot.main.device)
            }
            for k, v in s.moments.items():
                part = v.reshape(-1)[slot.lo : slot.hi].view(slot.main.shape)
                state[k] = part.to(device=slot.main.device, dtype=slot.main.dtype).clone()
            slot.inner.state[slot.main] = state  # type: ignore[index]


def params_of(
    chunks: Iterable[Any],
    slots: dict[Tensor, OptimizerSlot],
    *,
    ep_rank: int,
    local_experts: int,
    dense0: bool,
    experts0: bool,
    tied: bool,
) -> Iterator[Param]:
    """Every parameter of ``chunks`` as ``Param``s; ``tied``: include the tied output
    embedding (a load fills it from the embedding; a save leaves it out)."""
    for c in chunks:
        names = weights.canonical_names(c.module, ep_rank=ep_rank, local_experts=local_experts)
        for name, t in c.module.named_parameters():
            if weights.is_tied_copy(t) and not tied:
                continue
            replica0 = experts0 if ".local_experts." in name else dense0
            yield Param(names[name], t, replica0, slots.get(t))


def rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank's torch RNG after a load: derived from the model seed, the step and
    the rank, so a resume on another layout needs no state of the writer's ranks."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (2**63)
