"""Canonical (unsharded) parameters: names, initialisation and the TP shard mapping.

Every parameter has a *canonical name* - its name in the single-rank model: global layer index,
global expert index - and a *shard rule* saying how TP splits the full tensor:
    replicated       norms, routers, experts (no expert tensor parallelism here) and the
                     shared expert's gate
    dim d            a contiguous slice along dim ``d`` (embedding and output rows, QKV rows in
                     megatron's group-major layout, attention-out and fc2 columns)
    glu              fc1 of a gated MLP (the shared expert's too): megatron keeps
                     ``[gate_k; up_k]`` on TP rank ``k``, so the gate and up halves are
                     sliced separately

Initialisation draws each *full* tensor from a generator seeded by ``(seed, canonical name)``
and keeps this rank's shard, so a model is identical on every parallel layout (megatron's own
initialisation depends on the pipeline stage and shards fc1's halves differently). The same
mapping turns shards back into full tensors for checkpoints export and layout-invariance tests.
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from trainctl.workers.engine.config import ModelConfig
from trainctl.workers.engine.families import FAMILIES

if TYPE_CHECKING:
    from trainctl.workers.engine.boundary import OwnedShards

INIT_STD = 0.02
"""Normal init std of every matrix (GPT-2 / Llama convention)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ShardRule:
    kind: str  # "replicated" | "dim" | "glu"
    dim: int = 0

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        if self.kind == "replicated" or size == 1:
            return full
        if self.kind == "glu":
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
        return full.chunk(size, dim=self.dim)[rank]

    def unshard(self, shards: list[Tensor]) -> Tensor:
        if self.kind == "replicated" or len(shards) == 1:
            return shards[0]
        if self.kind == "glu":
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards, dim=self.dim)

    def unshard_ranks(self, by_rank: dict[int, Tensor], size: int) -> Tensor:
        """The full tensor from what each of ``size`` TP ranks holds (``by_rank``): a
        replicated tensor from whichever rank has it (an expert lives on its owner only,
        which at tp2 x ep2 is TP rank 1 for half of them); a split one from every rank."""
        if self.kind == "replicated":
            return next(iter(by_rank.values()))
        return self.unshard([by_rank[r] for r in range(size)])

    def full_shape(self, shard_shape: torch.Size, size: int) -> tuple[int, ...]:
        shape = list(shard_shape)
        if self.kind != "replicated":
            shape[0 if self.kind == "glu" else self.dim] *= size
        return tuple(shape)


def merge_owned(parts: Iterable[OwnedShards], tp: int) -> dict[str, Tensor]:
    """One full copy of the model (or of an adapter), by canonical name, from what every rank
    adds to it (``EngineShard.canonical_shards(owned=True)``): each name's TP shards put back
    together; across pipeline stages and expert ranks the names are disjoint."""
    got = list(parts)
    full = {}
    for name in sorted({n for g in got for n in g.shards}):
        by_tp = {g.tp: g.shards[name] for g in got if name in g.shards}
        full[name] = shard_rule(name).unshard_ranks(by_tp, tp)
    return full


def shard_rule(name: str) -> ShardRule:
    """How TP splits the parameter called ``name`` (canonical or local: the suffix decides)."""
    if name.endswith((".lora_a", ".lora_b")):
        return _lora_rule(name)
    if ".local_experts." in name or name.endswith(
        ("layernorm.weight", "router.weight", "shared_experts.gate_weight")
    ):
        return ShardRule("replicated")
    if "final_layernorm" in name or name.endswith("norm.weight"):
        return ShardRule("replicated")
    if name.endswith(("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")):
        return ShardRule("glu")
    if name.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
        return ShardRule("dim", 1)
    # embedding, output layer, linear_qkv; Gated DeltaNet's in_proj and conv1d (grouped by
    # key head), dt_bias and A_log (by value head)
    return ShardRule("dim", 0)


def _lora_rule(name: str) -> ShardRule:
    """A LoRA factor (``workers/ops/lora.py``): on a row-parallel linear ``A`` is split on its
    input columns and ``B`` replicated; on a column-parallel one ``A`` is replicated and ``B``
    split on its output rows as the weight is (fc1's gate and up halves separately). An
    expert's factors are whole on every rank, as the expert is."""
    if ".local_experts." in name:
        return ShardRule("replicated")
    row = ".linear_proj." in name or ".linear_fc2." in name
    if name.endswith(".lora_a"):
        return ShardRule("dim", 1) if row else ShardRule("replicated")
    if row:
        return ShardRule("replicated")
    return ShardRule("glu") if ".mlp.linear_fc1." in name else ShardRule("dim", 0)


EMBEDDING = "embedding.word_embeddings.weight"


def is_tied_copy(p: Tensor) -> bool:
    """The last pipeline stage's copy of tied input/output embeddings (megatron marks it
    ``shared``): the same canonical tensor as the first stage's embedding, counted there once."""
    return bool(getattr(p, "shared", False))


def tied_copies(chunk: nn.Module) -> set[str]:
    """Local names of ``chunk``'s tied-embedding copies (see ``is_tied_copy``)."""
    return {n for n, p in chunk.named_parameters() if is_tied_copy(p)}


def canonical_names(chunk: nn.Module, *, ep_rank: int, local_experts: int) -> dict[str, str]:
    """Local parameter name -> canonical name, for one model chunk (``GPTModel``)."""
    out = {}
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])
    for name, p in chunk.named_parameters():
        if is_tied_copy(p):
            out[name] = EMBEDDING
            continue
        canon = name
        m = _LAYER.match(name)
        if m:
            global_layer = layers[int(m.group(1))].layer_number - 1
            canon = _LAYER.sub(f"decoder.layers.{global_layer}.", canon, count=1)
        e = _EXPERT.search(canon)
        if e:
            global_expert = ep_rank * local_experts + int(e.group(1))
            canon = _EXPERT.sub(f".local_experts.{global_expert}.", canon, count=1)
        out[name] = canon
    return out


def init_full(
    name: str, shape: tuple[int, ...], *, seed: int, num_layers: int, zero_centered: bool = False
) -> Tensor:
    """The full tensor of parameter ``name``, drawn from a generator seeded by the name.
    ``zero_centered``: the residual stream's and q/k norms scale by ``1 + weight``."""
    if name.endswith("norm.weight"):
        if zero_centered and name.endswith("layernorm.weight"):
            return torch.zeros(shape)
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = INIT_STD
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = INIT_STD / math.sqrt(2.0 * num_layers)  # residual-branch outputs, as megatron does
    return torch.randn(shape, generator=gen) * std


FullTensor = Callable[[str, tuple[int, ...]], Tensor]
"""``(canonical name, full shape) -> the full tensor``: where seeded weights come from."""

ShardOf = Callable[[str, tuple[int, ...], int, int], Tensor]
"""``(canonical name, full shape, TP rank, TP size) -> that rank's shard``: where a rank's
weights come from (``of_full`` over a ``FullTensor``; ``hf_read.CheckpointReader.shard``
reads just the shard)."""


def of_full(full_tensor: FullTensor) -> ShardOf:
    """A ``ShardOf`` that makes each full tensor and keeps the rank's shard."""
    return lambda name, shape, rank, size: shard_rule(name).shard(
        full_tensor(name, shape), rank, size
    )


@torch.no_grad()
def assign(
    chunk: nn.Module,
    source: ShardOf,
    *,
    tp_rank: int,
    tp: int,
    ep_rank: int,
    local_experts: int,
) -> None:
    """Overwrite every parameter of ``chunk`` with its shard from ``source``."""
    names = canonical_names(chunk, ep_rank=ep_rank, local_experts=local_experts)
    for name, p in chunk.named_parameters():
        canon = names[name]
        shape = shard_rule(canon).full_shape(p.shape, tp)
        shard = source(canon, shape, tp_rank, tp)
        if shard.shape != p.shape:
            raise ValueError(
                f"{canon}: the source's shard has shape {tuple(shard.shape)}, the model's "
                f"{tuple(p.shape)} (full {shape})"
            )
        p.copy_(shard)


def digest(named: Iterable[tuple[str, Tensor]]) -> str:
    """sha256 over ``(name, tensor)`` pairs in the order given: equal digests, equal bytes."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def seeded(model: ModelConfig) -> FullTensor:
    """The canonical initialisation of ``model`` (its seed) as a ``FullTensor`` source."""
    zero_centered = FAMILIES[model.family].zero_centered_norm
    return lambda name, shape: init_full(
        name, shape, seed=model.seed, num_layers=model.num_layers, zero_centered=zero_centered
    )
